"""Serving throughput of ``batchgpu.llm.Engine`` (SmolLM2-135M): aggregate generated tokens/s and
per-request time to first token and inter-token latency (p50/p99) at several numbers of concurrent
requests, beside sequential ``Llama.generate`` on the same device in the same run.

    python benchmarks/serve.py [--device reference,wgpu] [--concurrency 1,4,16,32] [--tokens 64] [--json out.json]
    python benchmarks/serve.py --ray --device reference --concurrency 16,32   # HTTP: one process vs Ray Serve
    python benchmarks/serve.py --ray --device reference --engine-cpus 1       # the engine on 1 core, 1 left for Ray

Each request generates ``--tokens`` tokens greedily (end-of-sequence ignored) from its own short prompt;
all of a level's requests are submitted at once. Timed: from submitting the requests to the last token;
the engine is built (weights uploaded, steps recorded) and warmed up by one untimed request first, and
the ``Llama`` baseline times its decode steps after the first two (recording, first runs). The KV cache
holds every request of the largest level at once (none waits for blocks). The 1-minute
load average is printed beside each table (the host is shared: compare figures of one run).

Host cost: per level, the CPU time the engine's thread spends per decode step outside the device's work,
over the steps in which every request of the level decodes (``host_step.py`` explains the method and
compares two checkouts), in µs per step and per sequence. At one request the engine's ms per token (its
median inter-token gap) is printed beside ``Llama.generate``'s (its median decode step), and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average
from host_step import Clock, Window, device_clock

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.llama import Llama

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The best way to learn a language is",
    "import numpy as np\n",
    "Water boils at",
    "My favourite book is",
    "In the year 2050,",
    "The recipe for pancakes:",
]


async def one_request(engine: Engine, prompt: str, tokens: int, window: Window | None = None) -> dict[str, object]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    arrivals = []
    async for piece in engine.generate(prompt, params):
        arrivals.extend([time.perf_counter()] * len(piece.token_ids))
        if window is not None and len(arrivals) == len(piece.token_ids):
            window.first_token()
        if window is not None and piece.finish_reason is not None:
            window.finished()
    return {"ttft": arrivals[0] - started, "gaps": np.diff(arrivals).tolist(), "tokens": len(arrivals)}


async def level(engine: Engine, clock: Clock, concurrency: int, tokens: int) -> dict[str, float]:
    window = Window(engine, clock, None, concurrency)
    started = time.perf_counter()
    results = await asyncio.gather(
        *(one_request(engine, PROMPTS[i % len(PROMPTS)] + f" ({i})", tokens, window) for i in range(concurrency))
    )
    wall = time.perf_counter() - started
    gaps = [g for r in results for g in r["gaps"]]  # type: ignore[union-attr]
    ttft = [r["ttft"] for r in results]
    generated = sum(r["tokens"] for r in results)  # type: ignore[misc]
    decoding = window.per_step()
    host_us = 1e6 * decoding["host_s"] / decoding["steps"] if decoding["steps"] else float("nan")
    return {
        "concurrency": concurrency,
        "tokens_per_s": generated / wall,
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)) if gaps else float("nan"),
        "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)) if gaps else float("nan"),
        "wall_s": wall,
        "host_us_per_step": host_us,
        "host_us_per_sequence": host_us / concurrency,
        "load": load_average(),
    }


def sequential_llama(device: bg.Device, tokens: int) -> float:
    """Tokens/s of the one-sequence path (``Llama.generate``): one over its median decode step after the
    first two."""
    model = Llama(device, max_context=256)
    stamps = [time.perf_counter() for _ in model.generate([504, 3575, 282, 4649, 314], tokens)]
    steps = np.diff(stamps)[2:]
    return 1.0 / float(statistics.median(steps))


def run_device(kind: str, levels: list[int], tokens: int) -> dict[str, object]:
    device = bg.Device(kind)
    baseline = sequential_llama(device, min(tokens, 24))
    blocks = max(levels) * -(-(16 + tokens) // 16)  # every request's prompt (<= 16 tokens) and output at once
    engine = Engine(device=device, max_batch=max(levels), max_context=256, kv_blocks=blocks)
    clock = device_clock(device.executor, kind)
    asyncio.run(one_request(engine, "warm up", 4))
    rows = [asyncio.run(level(engine, clock, c, tokens)) for c in levels]
    return {"device": device.name, "kind": kind, "llama_tokens_per_s": baseline, "levels": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference,wgpu", help="comma-separated device kinds")
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--engine-cpus", type=int, help="with --ray: CPUs (BLAS threads) of the one-process and 1-replica engines"
    )
    parser.add_argument(
        "--ray", action="store_true", help="over HTTP: the one-process server against Ray Serve, 1 and 2 replicas"
    )
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.ray:
        from serve_ray import run

        print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load (1 min) {load_average():.2f}")
        print("| device | server | concurrent requests | tokens/s |\n|---|---|---:|---:|")
        rows = run(args.device.split(","), levels, args.tokens, args.engine_cpus)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load (1 min) {load_average():.2f}")
    report = []
    for kind in args.device.split(","):
        result = run_device(kind, levels, args.tokens)
        report.append(result)
        single = result["levels"][0]["tokens_per_s"]  # type: ignore[index]
        llama_ms = 1e3 / result["llama_tokens_per_s"]  # type: ignore[operator]
        print(f"\n{result['device']} ({kind}); sequential Llama.generate: {llama_ms:.2f} ms/token")
        print(
            "| requests | tokens/s | x one request | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
            "host µs/step | host µs/sequence | load |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for row in result["levels"]:  # type: ignore[union-attr]
            print(
                f"| {row['concurrency']} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / single:.2f} | "
                f"{row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['itl_p50_ms']:.1f} | "
                f"{row['itl_p99_ms']:.1f} | {row['host_us_per_step']:.0f} | {row['host_us_per_sequence']:.1f} | "
                f"{row['load']:.2f} |"
            )
        one = next((row for row in result["levels"] if row["concurrency"] == 1), None)  # type: ignore[union-attr]
        if one is not None:
            print(
                f"one request: engine {one['itl_p50_ms']:.2f} ms/token, Llama.generate {llama_ms:.2f} ms/token: "
                f"{one['itl_p50_ms'] / llama_ms:.2f}x"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
