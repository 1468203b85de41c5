"""Speculative decoding: acceptance, target steps per generated token and tokens/s with and without, per task
(a copy task: repeat a given text; a summary of a given text; free chat), per batch size, per drafter
(prompt lookup, draft models), beside the engine without speculation in the same run; every run's greedy
ids are checked equal to the plain engine's. With ``--http``: the copy task and free chat through ``batchgpu
serve`` with and without ``--speculative`` (issue 42's targets: at most 0.6 target steps per token and at
least 1.3x the tokens/s on the copy task, the same text; free chat at most 5% slower).

    python benchmarks/speculative.py [--device reference,wgpu] [--batch 1,4,16] [--tokens 64]
        [--methods ngram:4,draft:smollm2:3,draft:tiny:3] [--fp32] [--http] [--json out.json]

Drafters: ``ngram:K`` (prompt lookup), ``draft:smollm2:K`` (SmolLM2's Q4_1 file drafting; with ``--fp32``
the target runs float32: a quantized draft of its target), ``draft:tiny:K`` (a synthetic two-layer model
with SmolLM2's vocabulary: the mechanics, nearly nothing accepted) or ``draft:PATH:K``. Timed: the batch's
requests submitted at once, greedy, end-of-sequence ignored, after a warm-up of the same requests (steps
recorded, pipelines compiled); tokens/s is generated tokens over wall time (the machine is shared: compare
ratios of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from math import isnan, nan
from pathlib import Path
from typing import Any

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.llama import smollm2_path
from batchgpu.models.speculative import Speculative

TEXT = (
    "The river rises in the northern hills, runs south through three market towns, and reaches the sea at a "
    "wide estuary where the old harbour stands. Its water mills ground grain for two centuries; the last one "
    "closed in 1962 and is now a museum of farming tools. Each spring the town holds a boat race from the "
    "bridge to the harbour wall, and the winning crew rings the bell that hangs above the customs house door."
)
TASKS = {
    "copy": [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{TEXT}"}],
    "summary": [{"role": "user", "content": f"Summarize this text in two sentences:\n\n{TEXT}"}],
    "chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and a cat."}],
}
"""Chat prompts: the output copies its input (copy), reuses its words (summary), or invents (chat)."""


def drafter(method: str, folder: Path) -> Speculative:
    """``ngram:K``, ``draft:smollm2:K``, ``draft:tiny:K`` or ``draft:PATH:K`` as settings."""
    kind, _, rest = method.partition(":")
    if kind == "ngram":
        return Speculative("ngram", int(rest))
    name, _, tokens = rest.rpartition(":")
    if name == "smollm2":
        return Speculative("draft", int(tokens), draft=smollm2_path())
    if name == "tiny":
        path = folder / "tiny-smollm2.gguf"
        if not path.exists():
            command = [sys.executable, "-m", "batchgpu", "synth", "--preset", "tiny-smollm2", "--format", "q8_0"]
            subprocess.run([*command, "--vocab", "smollm2", "--out", str(path)], check=True, capture_output=True)
        return Speculative("draft", int(tokens), draft=path)
    return Speculative("draft", int(tokens), draft=name)


async def crowd(engine: Engine, prompts: list[Any], tokens: int) -> tuple[list[list[int]], float]:
    """Each prompt's greedy ids (all submitted at once) and the wall seconds."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: Any) -> list[int]:
        return [t async for piece in engine.generate(prompt, params) for t in piece.token_ids]

    started = time.perf_counter()
    ids = await asyncio.gather(*(one(prompt) for prompt in prompts))
    return list(ids), time.perf_counter() - started


def measure(engine: Engine, prompts: list[Any], tokens: int, rounds: int) -> dict[str, Any]:
    """The batch after a warm-up: tokens/s (median of ``rounds``), steps per token, acceptance, the ids."""
    asyncio.run(crowd(engine, prompts, tokens))
    stats, runs = engine.scheduler.stats, []
    for _ in range(rounds):
        before = (sum(engine.steps.values()), stats.drafted_tokens, stats.accepted_tokens)
        ids, wall = asyncio.run(crowd(engine, prompts, tokens))
        generated = sum(map(len, ids))
        runs.append({
            "ids": ids, "tokens_per_s": generated / wall, "steps": sum(engine.steps.values()) - before[0],
            "drafted": stats.drafted_tokens - before[1], "accepted": stats.accepted_tokens - before[2],
            "generated": generated,
        })  # fmt: skip
    last = runs[-1]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "steps_per_token": last["steps"] / (last["generated"] / len(prompts)),
        "acceptance": last["accepted"] / last["drafted"] if last["drafted"] else nan,
        "ids": last["ids"],
    }


def run_device(kind: str, args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    """Every task x batch x drafter on ``kind``, each beside the plain engine."""
    settings = {"max_batch": max(args.batch), "max_context": 512, "quantized": not args.fp32}
    device = bg.Device(kind)
    engines = {"none": Engine(device=device, **settings)}
    for method in args.methods:
        engines[method] = Engine(device=device, speculative=drafter(method, folder), **settings)
    rows = []
    for task, messages in TASKS.items():
        for batch in args.batch:
            prompts = [messages] * batch
            plain = measure(engines["none"], prompts, args.tokens, args.rounds)
            rows.append({"task": task, "batch": batch, "method": "none", **without_ids(plain)})
            for method in args.methods:
                figures = measure(engines[method], prompts, args.tokens, args.rounds)
                same = figures["ids"] == plain["ids"]
                speedup = figures["tokens_per_s"] / plain["tokens_per_s"]
                rows.append({"task": task, "batch": batch, "method": method, "same_ids": same,
                             "speedup": speedup, **without_ids(figures)})  # fmt: skip
    return rows


def without_ids(figures: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in figures.items() if key != "ids"}


def print_table(kind: str, name: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n{name} ({kind}); load (1 min) {load_average():.2f}")
    print("| task | batch | drafter | tokens/s | x without | target steps per token | acceptance | same ids |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for row in rows:
        speedup = f"{row['speedup']:.2f}" if "speedup" in row else "1"
        same = {True: "yes", False: "**no**"}.get(row.get("same_ids"), "-")
        acceptance = "-" if isnan(row["acceptance"]) else f"{row['acceptance']:.2f}"
        print(f"| {row['task']} | {row['batch']} | {row['method']} | {row['tokens_per_s']:.1f} | {speedup} | "
              f"{row['steps_per_token']:.2f} | {acceptance} | {same} |")  # fmt: skip


# over HTTP ---------------------------------------------------------------------------------------------


def http_run(url: str, messages: list[dict[str, str]], batch: int, tokens: int) -> tuple[list[str], float]:
    """``batch`` chat completions at once (threads), greedy; their texts and the wall seconds."""
    from concurrent.futures import ThreadPoolExecutor

    body = json.dumps({"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}).encode()

    def one(_: int) -> str:
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)["choices"][0]["message"]["content"]

    started = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        texts = list(pool.map(one, range(batch)))
    return texts, time.perf_counter() - started


def counts_of(url: str) -> tuple[int, float, float]:
    """The server's steps so far (``/v1/engine``), and its drafted and accepted tokens (``/metrics``)."""
    with urllib.request.urlopen(f"{url}/v1/engine", timeout=60) as response:
        steps = sum(json.load(response)["steps"].values())
    with urllib.request.urlopen(f"{url.removesuffix('/v1')}/metrics", timeout=60) as response:
        lines = response.read().decode().splitlines()
    total = {name: sum(float(line.split()[-1]) for line in lines if line.startswith(f"batchgpu_{name}_total"))
             for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}  # fmt: skip
    return steps, total["spec_decode_num_draft_tokens"], total["spec_decode_num_accepted_tokens"]


def http_device(kind: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The copy task and free chat through two ``batchgpu serve`` at once, without and with ``--speculative
    ngram:4``, their requests interleaved round by round (the machine's load hits both alike)."""
    from contextlib import ExitStack

    from serve_load import servers

    base = ["--device", kind, "--max-batch", str(max(args.batch)), "--max-context", "512"]
    base += ["--fp32"] if args.fp32 else []
    methods, rows = {"none": base, "ngram:4": [*base, "--speculative", "ngram:4"]}, []
    with ExitStack() as stack:
        urls = {name: stack.enter_context(servers().serve_process(*options))[0] for name, options in methods.items()}
        for task in ("copy", "chat"):
            for batch in args.batch:
                runs: dict[str, list[tuple[list[str], float, float, float]]] = {name: [] for name in urls}
                for url in urls.values():
                    http_run(url, TASKS[task], batch, args.tokens)  # warm-up
                for _ in range(args.rounds):
                    for name, url in urls.items():
                        steps, drafted, accepted = counts_of(url)
                        texts, wall = http_run(url, TASKS[task], batch, args.tokens)
                        after = counts_of(url)
                        acceptance = (after[2] - accepted) / (after[1] - drafted) if after[1] > drafted else nan
                        runs[name].append((texts, batch * args.tokens / wall, (after[0] - steps) / args.tokens,
                                           acceptance))  # fmt: skip
                for name, done in runs.items():
                    rows.append({
                        "task": task, "batch": batch, "method": name, "texts": done[-1][0],
                        "tokens_per_s": statistics.median(r[1] for r in done), "steps_per_token": done[-1][2],
                        "acceptance": done[-1][3],
                    })  # fmt: skip
    plain = {(r["task"], r["batch"]): r for r in rows if r["method"] == "none"}
    for row in rows:
        other = plain[(row["task"], row["batch"])]
        row.update(speedup=row["tokens_per_s"] / other["tokens_per_s"], same_ids=row["texts"] == other["texts"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference", help="comma-separated device kinds")
    parser.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--methods", default="ngram:4,draft:smollm2:3,draft:tiny:3", help="comma-separated drafters")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--fp32", action="store_true", help="the target model in float32 (draft: its Q4_1 file)")
    parser.add_argument("--http", action="store_true", help="through batchgpu serve (prompt lookup only)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    args.methods = [m for m in args.methods.split(",") if m]
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load (1 min) {load_average():.2f}")
    report = []
    with tempfile.TemporaryDirectory() as folder:
        for kind in args.device.split(","):
            rows = http_device(kind, args) if args.http else run_device(kind, args, Path(folder))
            print_table(kind, bg.Device(kind).name, rows)
            report.append({"kind": kind, "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows]})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
