"""The exported chat app (``batchgpu.export.chat.export_chat``) beside wllama (llama.cpp compiled to WebAssembly,
npm ``@wllama/wllama``) on the same GGUF file and the same prompt ids, in one headless Chromium session.

The GGUF file is exported into a temporary folder that is served over HTTP on 127.0.0.1 with the headers of
cross-origin isolation (wllama's threads need ``SharedArrayBuffer``), beside a small wllama page
(benchmarks/browser_chat/) that loads the same file. Per round, interleaved: batchgpu's page once, then
wllama's page once per ``--threads`` count; each page loads the model afresh. Per engine the median over
rounds of:

- load s: batchgpu: its page's load (plan, shaders, the GGUF file fetched and its weight buffers built);
  wllama: the GGUF file fetched as a Blob and ``loadModel`` (wasm start, llama.cpp's load);
- prefill tokens/s: prompt tokens over the time from the first prefill call to the first sampled id;
- decode tokens/s: the ids after the first over the time from the first id to the last;
- the greedy ids, compared with batchgpu's: llama.cpp is the reference implementation of GGUF files, so
  equal ids are a correctness check; where they differ the first index is reported.

Both are timed from their page's first request after the load (nothing warmed up), the way a user meets
them. batchgpu's page loads with ``cache=none`` (its model fetched every time, as wllama's); ``--stored`` adds a
row of the page loading the model from the browser's storage (OPFS, kept by one load before the rounds, not
timed), ``--main-thread`` one of the page running the model on its own thread (``worker=0``) instead of its
worker; their details hold ``loaded_from``, ``network_bytes`` and the main thread's long tasks while generating.
wllama runs on its CPU backend (``n_gpu_layers`` 0; 2.x has no other); its ids are fed as they are
through its token API (no tokenizer, no BOS added), sampled greedily (top_k 1, temperature 0), and decoding
goes on past end-of-generation ids (batchgpu's page stops at its tokenizer's stop ids: ids are compared
over the shorter list). ``--python`` adds batchgpu's Python side on the numpy reference executor: the very
steps the page runs (:class:`~batchgpu.export.chat_steps.ChatSteps`) and ``Llama.generate``, so a
difference can be placed (page, Python or llama.cpp); where the prompt is longer than the model's sliding
window, also the same steps with the window taken out (a control: ids that differ from it show that the
comparison covers the window); where ids differ, the reference executor's logits of both ids there.

wllama is fetched once with npm into ``$BATCHGPU_NPM_CACHE`` (default ``~/.cache/batchgpu/npm``) and never
copied into this repository (its wasm files are ~10 MB).

    python benchmarks/browser_chat.py                                  # SmolLM2-135M, 32-token prompt, 32 tokens
    python benchmarks/browser_chat.py --model FILE.gguf --prompt-tokens 600 --max-tokens 16 --python
    python benchmarks/browser_chat.py --prompt-ids 1,4093,314 --threads 1 --cpu-kernels --json out.json
    python benchmarks/browser_chat.py --threads '' --cpu-kernels --stored --main-thread   # batchgpu's loads only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchgpu.errors import ArgumentError, BatchError

HERE = Path(__file__).resolve().parent
PAGE_FILES = ("wllama.html", "wllama_run.js")
"""The wllama page's files, in benchmarks/browser_chat/."""
WLLAMA_PACKAGE = "@wllama/wllama@2.4.0"
"""The npm package: 2.x, whose token API (decode, samplingSample) takes prompt ids as they are; 3.x only
takes text."""
ENV_NPM_CACHE = "BATCHGPU_NPM_CACHE"
NORMAL_TOKEN = 1
CONTROL = "python ChatSteps, no window"
"""The control row: the page's steps in Python with the sliding window taken out (not part of the agreement)."""
"""``tokenizer.ggml.token_type`` of ordinary vocabulary entries (not control, unknown or byte tokens)."""


class WllamaUnavailable(RuntimeError):
    """npm is missing, or could not fetch the wllama package."""


# wllama from npm -------------------------------------------------------------------------------------


def npm_cache() -> Path:
    """``$BATCHGPU_NPM_CACHE``, else ``~/.cache/batchgpu/npm``."""
    configured = os.environ.get(ENV_NPM_CACHE)
    return Path(configured) if configured else Path.home() / ".cache" / "batchgpu" / "npm"


def wllama_package(spec: str = WLLAMA_PACKAGE, cache: Path | None = None) -> Path:
    """The folder of the npm package ``spec`` (its ``esm/``), installed with ``npm install`` into ``cache`` on
    first use: into a private folder, renamed into place, so concurrent first uses never see half of it."""
    cache = cache or npm_cache()
    folder = cache / spec.replace("/", "+")
    package = folder / "node_modules" / Path(spec.rsplit("@", 1)[0])
    if (package / "esm" / "index.js").is_file():
        return package
    npm = shutil.which("npm")
    if npm is None:
        raise WllamaUnavailable(f"npm is not on PATH: install Node.js and npm to fetch {spec}")
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=cache))
    command = [npm, "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--ignore-scripts", spec]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise WllamaUnavailable(f"`{' '.join(command[1:])}` failed ({done.returncode}): {done.stderr[-1500:]}")
        try:
            staging.rename(folder)
        except OSError:  # another process put it in place first
            if not (package / "esm" / "index.js").is_file():
                raise
    except subprocess.TimeoutExpired as slow:
        raise WllamaUnavailable(f"`{' '.join(command[1:])}` took over {slow.timeout} s") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return package


# prompts -------------------------------------------------------------------------------------------


def synthetic_prompt(model: Path, tokens: int, seed: int = 0) -> list[int]:
    """``tokens`` ids: the file's BOS where it asks for one, then ordinary vocabulary ids (token type 1) drawn
    at random (``seed``)."""
    from batchgpu.models.gguf_reader import GGUFFile

    metadata = GGUFFile(model).metadata
    kinds = np.asarray(metadata.get("tokenizer.ggml.token_type", []))
    vocab = len(metadata["tokenizer.ggml.tokens"])
    normal = np.flatnonzero(kinds == NORMAL_TOKEN) if kinds.size else np.arange(vocab)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    head = [int(bos)] if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", False) else []
    drawn = np.random.default_rng(seed).choice(normal, tokens - len(head))
    return head + [int(i) for i in drawn]


def text_prompt(model: Path, text: str) -> list[int]:
    """``text`` tokenized by batchgpu's codec for the file (with the tokens its tokenizer adds, such as BOS)."""
    from batchgpu.models.loader import open_weights

    return open_weights(model).codec().encode(text, special=True)


# the runs ------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One page's figures."""

    engine: str
    load_s: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    ids: list[int]
    threads: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ, over the shorter one; None where they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def page_run(engine: str, result: Any, prompt: Sequence[int], threads: int | None = None) -> Run:
    """A page's result as a :class:`Run`; a page's ``{error}`` raises."""
    if not isinstance(result, dict) or "error" in result:
        raise RuntimeError(f"{engine}: the page failed: {json.dumps(result)[:3000]}")
    if list(result["prompt_ids"]) != list(prompt):
        raise RuntimeError(f"{engine}: the page ran prompt {result['prompt_ids'][:8]}..., not {list(prompt)[:8]}...")
    prefill = len(prompt) / (result["prefill_ms"] / 1000) if result["prefill_ms"] > 0 else float("inf")
    keep = ("adapter", "multithread", "cross_origin_isolated", "prefill_ms", "decode_ms", "worker", "loaded_from")
    keep += ("weights_s", "network_bytes", "shader_f16", "self_test")
    detail = {k: result[k] for k in keep if k in result}
    if "long_tasks" in result:
        detail["long_tasks_ms"] = [round(task["duration"]) for task in result["long_tasks"]]
    return Run(
        engine,
        result["load_s"],
        prefill,
        result["tokens_per_s"],
        [int(i) for i in result["token_ids"]],
        threads if threads is None else int(result["threads"]),
        detail,
    )


def measure(
    site: Path,
    prompt: Sequence[int],
    max_tokens: int,
    *,
    threads: Sequence[int],
    rounds: int,
    n_ctx: int,
    timeout: float,
    log: Callable[[str], None] = print,
    stored: bool = False,
    main_thread: bool = False,
) -> list[Run]:
    """``rounds`` rounds of batchgpu's page (``stored``: also loading the model from storage; ``main_thread``: also
    without its worker) and wllama's (once per thread count) in one headless Chromium."""
    from batchgpu.export.browser import CROSS_ORIGIN_ISOLATION, Chromium, serve

    ids = ",".join(str(i) for i in prompt)
    runs = []
    pages = [("batchgpu", "cache=none")]
    pages += [("batchgpu stored", "cache=opfs")] if stored else []
    pages += [("batchgpu main thread", "cache=none&worker=0")] if main_thread else []
    with serve(site, headers=CROSS_ORIGIN_ISOLATION) as base, Chromium() as browser:
        if stored:  # keep the model in OPFS first (a load like any first one: not timed)
            keep = browser.evaluate(f"{base}chat/index.html?cache=opfs", "window.batchgpuChat", timeout)
            if not isinstance(keep, dict) or not keep.get("stored"):
                raise RuntimeError(f"batchgpu: the page did not keep the model: {json.dumps(keep)[:2000]}")
        for round_ in range(rounds):
            for engine, query in pages:
                page = f"{base}chat/index.html?ids={ids}&max_tokens={max_tokens}&{query}"
                runs.append(page_run(engine, browser.evaluate(page, "window.batchgpuChat", timeout), prompt))
                speed = runs[-1].decode_tokens_per_s
                log(f"round {round_ + 1}: {engine} load {runs[-1].load_s:.2f} s, {speed:.2f} tokens/s")
            for count in threads:
                page = f"{base}wllama.html?model=chat/model.gguf&ids={ids}&max_tokens={max_tokens}"
                page += f"&threads={count}&n_ctx={n_ctx}"
                runs.append(page_run("wllama", browser.evaluate(page, "window.wllamaRun", timeout), prompt, count))
                log(f"round {round_ + 1}: wllama x{runs[-1].threads} {runs[-1].decode_tokens_per_s:.2f} tokens/s")
    return runs


def python_runs(
    model: Path, prompt: Sequence[int], max_tokens: int, max_context: int, chunk: int
) -> tuple[list[Run], Any]:
    """batchgpu's Python side on the numpy reference executor: the page's own steps, then ``Llama.generate``;
    and that ``Llama`` (for :func:`tie_margins`)."""
    import batchgpu as bg
    from batchgpu.export.chat_steps import ChatSteps
    from batchgpu.export.plan import WEBGPU_DEFAULT_LIMITS
    from batchgpu.models.llama import Llama, upload_weights
    from batchgpu.models.loader import open_weights

    device = bg.Device("reference", limits=WEBGPU_DEFAULT_LIMITS)
    weights = open_weights(model)
    uploaded = upload_weights(device, weights, fuse=True)
    steps = ChatSteps(device, weights.config, uploaded, max_context=max_context, chunk=chunk)
    runs = [timed_python("python ChatSteps", lambda: list(steps.generate(prompt, max_tokens)))]
    if 0 < weights.config.sliding_window < len(prompt):  # a control: do these ids depend on the window at all?
        unwindowed = dataclasses.replace(weights.config, sliding_window=0)
        full = ChatSteps(device, unwindowed, uploaded, max_context=max_context, chunk=chunk)
        runs.append(timed_python(CONTROL, lambda: list(full.generate(prompt, max_tokens))))
        del full
    llama = Llama(bg.Device("reference"), model, max_context=max_context)
    runs.append(timed_python("python Llama", lambda: [int(i) for i in llama.generate(list(prompt), max_tokens)]))
    return runs, llama


def tie_margins(llama: Any, prompt: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
    """Per row whose ids differ from batchgpu's page: the reference executor's logits of both ids where they
    first differ (``margin``: batchgpu's id's logit minus the other's; a near-tie is small against
    ``max_abs_logit``), added to the row."""
    reference = next(row["ids"] for row in rows if row["engine"] == "batchgpu")
    for row in rows:
        index = row["first_difference"]
        if index is None:
            continue
        step = llama.prefill([*prompt, *reference[:index]])
        logits = np.asarray(step.batch.read(step.logits)[0], np.float64)
        ours, theirs = reference[index], row["ids"][index]
        row["margin"] = {
            "index": index,
            "batchgpu_id": ours,
            "other_id": theirs,
            "batchgpu_logit": float(logits[ours]),
            "other_logit": float(logits[theirs]),
            "margin": float(logits[ours] - logits[theirs]),
            "max_abs_logit": float(np.abs(logits).max()),
            "argmax": int(np.argmax(logits)),
        }


def timed_python(engine: str, generate: Callable[[], list[int]]) -> Run:
    started = time.perf_counter()
    ids = generate()
    return Run(engine, float("nan"), float("nan"), len(ids) / (time.perf_counter() - started), ids)


# the report ----------------------------------------------------------------------------------------


def summary(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per engine (and thread count): medians over rounds, ids of the first round, and where they
    first differ from batchgpu's page (None: equal over the shorter list)."""
    reference = next(r.ids for r in runs if r.engine == "batchgpu")
    rows: dict[tuple[str, int | None], list[Run]] = {}
    for run in runs:
        rows.setdefault((run.engine, run.threads), []).append(run)
    table = []
    for (engine, threads), group in rows.items():
        table.append(
            {
                "engine": engine,
                "threads": threads,
                "rounds": len(group),
                "load_s": statistics.median(r.load_s for r in group),
                "prefill_tokens_per_s": statistics.median(r.prefill_tokens_per_s for r in group),
                "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in group),
                "ids": group[0].ids,
                "same_ids_every_round": all(r.ids == group[0].ids for r in group),
                "first_difference": first_difference(group[0].ids, reference),
                "detail": group[0].detail,
            }
        )
    return table


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| engine | threads | load s | prefill tokens/s | decode tokens/s | ids | same ids as batchgpu |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        differs = row["first_difference"]
        agree = "yes" if differs is None else f"no: first differs at {differs}"
        if row["engine"] == CONTROL:
            agree += " (control)"
        threads = "-" if row["threads"] is None else str(row["threads"])
        lines.append(
            f"| {row['engine']} | {threads} | {row['load_s']:.2f} | {row['prefill_tokens_per_s']:.1f} | "
            f"{row['decode_tokens_per_s']:.2f} | {len(row['ids'])} | {agree} |"
        )
    return "\n".join(lines)


def build_site(folder: Path, package: Path) -> None:
    """Beside the exported app in ``folder/chat``: the wllama page's files and ``wllama`` (a link to the npm
    package)."""
    for name in PAGE_FILES:
        shutil.copyfile(HERE / "browser_chat" / name, folder / name)
    (folder / "wllama").symlink_to(package, target_is_directory=True)


def checked_prompt(args: argparse.Namespace, model: Path) -> list[int]:
    """The prompt ids ``args`` ask for, each checked against the file's vocabulary (before anything is built)."""
    from batchgpu.models.gguf_reader import GGUFFile

    if not model.is_file():
        raise ArgumentError(f"--model {model} is not a file; pass a GGUF model file")
    if args.max_tokens < 1:
        raise ArgumentError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    vocab = len(GGUFFile(model).metadata.get("tokenizer.ggml.tokens", ()))
    if args.prompt_ids:
        try:
            prompt = [int(i) for i in args.prompt_ids.split(",") if i.strip()]
        except ValueError:
            raise ArgumentError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    elif args.prompt_text:
        prompt = text_prompt(model, args.prompt_text)
    elif args.prompt_tokens < 1:
        raise ArgumentError(f"--prompt-tokens must be >= 1, got {args.prompt_tokens}")
    else:
        prompt = synthetic_prompt(model, args.prompt_tokens, args.seed)
    if not prompt:
        raise ArgumentError("the prompt has no ids: pass --prompt-ids, --prompt-tokens N or a non-empty --prompt-text")
    bad = next((i for i in prompt if not 0 <= i < vocab), None)
    if bad is not None:
        raise ArgumentError(f"prompt id {bad} is not in the file's vocabulary [0, {vocab})")
    return prompt


def benchmark(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Export, serve, measure; returns the report (``rows``, ``prompt_ids``, ``table``, ...)."""
    from batchgpu.export.chat import export_chat

    model = Path(args.model)
    prompt = checked_prompt(args, model)
    max_context = args.max_context or 1 << (len(prompt) + args.max_tokens).bit_length()
    if max_context < len(prompt) + args.max_tokens:
        raise ArgumentError(
            f"--max-context {max_context} is under the prompt ({len(prompt)}) + --max-tokens ({args.max_tokens})"
        )
    chunk = min(args.chunk, 1 << (max_context.bit_length() - 1))
    package = wllama_package() if args.threads else None
    with tempfile.TemporaryDirectory(prefix="batchgpu-browser-chat-") as temp:
        site = Path(temp)
        started = time.perf_counter()
        export_chat(model, site / "chat", max_context=max_context, chunk=chunk, gpu_kernels=args.gpu_kernels)
        log(f"exported in {time.perf_counter() - started:.1f} s (max_context {max_context}, chunk {chunk})")
        if package is not None:
            build_site(site, package)
        runs = measure(
            site,
            prompt,
            args.max_tokens,
            threads=args.threads,
            rounds=args.rounds,
            n_ctx=max_context,
            timeout=args.timeout,
            log=log,
            stored=args.stored,
            main_thread=args.main_thread,
        )
    llama = None
    if args.python:
        python, llama = python_runs(model, prompt, args.max_tokens, max_context, chunk)
        runs += python
    rows = summary(runs)
    if llama is not None:
        tie_margins(llama, prompt, rows)
    return {
        "model": str(model),
        "prompt_ids": prompt,
        "max_tokens": args.max_tokens,
        "max_context": max_context,
        "chunk": chunk,
        "gpu_kernels": args.gpu_kernels,
        "wllama": WLLAMA_PACKAGE,
        "rows": rows,
        "table": markdown(rows),
        "agree": all(row["first_difference"] is None for row in rows if row["engine"] != CONTROL),
    }


def default_model() -> str | None:
    from batchgpu.models.llama import smollm2_path

    try:
        return str(smollm2_path())
    except BatchError:  # not installed: --model is then required
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model(), help="GGUF file (default: SmolLM2-135M)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    prompt.add_argument("--prompt-tokens", type=int, default=32, help="a synthetic prompt of N ids (default 32)")
    prompt.add_argument("--prompt-text", help="a prompt tokenized by batchgpu's codec for the file")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    kernels = parser.add_mutually_exclusive_group()
    kernels.add_argument("--gpu-kernels", dest="gpu_kernels", action="store_true", default=True)
    kernels.add_argument("--cpu-kernels", dest="gpu_kernels", action="store_false", help="for CPU WebGPU drivers")
    parser.add_argument("--threads", default="1,2", help="wllama thread counts, one run each ('' : no wllama)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64, help="the export's largest prefill step")
    parser.add_argument("--max-context", type=int, default=0, help="default: prompt + max tokens, to a power of 2")
    parser.add_argument("--python", action="store_true", help="also batchgpu's Python side (reference executor)")
    parser.add_argument("--stored", action="store_true", help="also batchgpu's page loading the model from storage")
    parser.add_argument("--main-thread", action="store_true", help="also batchgpu's page without its worker")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per page")
    parser.add_argument("--json", help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (SmolLM2 is not installed)")
    args.threads = [int(t) for t in args.threads.split(",") if t.strip()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = benchmark(args, log=lambda line: print(line, file=sys.stderr))
    except WllamaUnavailable as missing:
        print(f"wllama is unavailable: {missing}", file=sys.stderr)
        return 2
    except BatchError as refused:
        print(f"browser_chat: {refused}", file=sys.stderr)
        return 2
    print(report["table"])
    for row in report["rows"]:
        print(f"{row['engine']} x{row['threads']}: {row['ids']}")
        if "margin" in row:
            print(f"  where it first differs, the reference executor's logits: {json.dumps(row['margin'])}")
    print("greedy ids agree" if report["agree"] else "greedy ids DIFFER (first index per row above)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
