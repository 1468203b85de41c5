"""Prefix caching in ``batchgpu.llm.Engine`` (SmolLM2-135M): requests that share a long system prompt,
on one engine with the prefix cache and one without, rounds interleaved in one run: tokens/s, time to
first token and prefill rows computed, and their ratios (cache on / off). Every request's greedy ids
must be the same on both engines (checked).

    python benchmarks/prefix_cache.py [--device reference] [--concurrency 1,8] [--rounds 3] [--tokens 16]

Each round sends ``concurrency`` requests at once, each the shared system prompt (about 250 tokens)
and a question of its own; the first round of each engine is a warm-up (untimed; with the cache it
fills it). Tokens/s counts generated tokens over the round's wall time. The 1-minute load average is
printed (the host is shared: compare the figures of one run).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams

SYSTEM = (
    "You are a careful assistant for a small library. You answer questions about books, opening hours, "
    "membership and events. Keep answers short, polite and factual; when you do not know, say so and "
    "suggest asking the front desk. Opening hours: Monday to Friday 9 to 18, Saturday 10 to 14, closed on "
    "Sunday. Membership is free for residents and costs 20 euros a year for others. Books are lent for "
    "three weeks and may be renewed twice unless reserved by another member. Late returns cost 10 cents a "
    "day. Events: a reading club on Tuesdays at 18, a children's story hour on Saturdays at 11, and a "
    "monthly talk by a local author. The library has free wifi, two printers and quiet study rooms that "
    "can be booked for two hours at a time.\n\n"
)
QUESTIONS = ["When do you open on Saturday?", "How much is membership?", "Can I renew a book?", "Is there wifi?"]


async def one(engine: Engine, prompt: str, tokens: int) -> tuple[list[int], float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    started, first, ids = time.perf_counter(), None, []
    async for piece in engine.generate(prompt, params):
        first = first if first is not None else time.perf_counter()
        ids += piece.token_ids
    return ids, (first or started) - started


def round_of(engine: Engine, concurrency: int, tokens: int, offset: int) -> dict[str, object]:
    """One round: ``concurrency`` requests at once; their ids, tokens/s, median TTFT and prefill rows."""
    prompts = [SYSTEM + f"Question {offset + i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(concurrency)]
    rows = engine.scheduler.stats.prompt_tokens_computed

    async def all_of() -> list[tuple[list[int], float]]:
        return list(await asyncio.gather(*(one(engine, p, tokens) for p in prompts)))

    started = time.perf_counter()
    results = asyncio.run(all_of())
    wall = time.perf_counter() - started
    return {
        "ids": [ids for ids, _ in results],
        "tokens_per_s": sum(len(ids) for ids, _ in results) / wall,
        "ttft_s": statistics.median(t for _, t in results),
        "prefill_rows": engine.scheduler.stats.prompt_tokens_computed - rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference")
    parser.add_argument("--concurrency", default="1,8", help="comma-separated request counts")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and level")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per request")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    device = bg.Device(args.device)
    settings = dict(max_batch=max(levels), max_context=512, block_size=16)
    engines = {cached: Engine(device=device, prefix_caching=cached, **settings) for cached in (False, True)}
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; device {device.name} ({args.device})")
    print(f"system prompt: {len(engines[True].codec.encode(SYSTEM))} tokens; {args.tokens} tokens per request")
    print("| requests | cache | tokens/s | TTFT p50 ms | prefill rows per round | load |")
    print("|---:|---|---:|---:|---:|---:|")
    for concurrency in levels:
        for engine in engines.values():
            round_of(engine, concurrency, args.tokens, offset=0)  # warm-up (fills the cache)
        figures: dict[bool, list[dict[str, object]]] = {False: [], True: []}
        for r in range(args.rounds):
            for cached, engine in engines.items():  # interleaved
                figures[cached].append(round_of(engine, concurrency, args.tokens, offset=1000 * (r + 1)))
        for r in range(args.rounds):
            if figures[True][r]["ids"] != figures[False][r]["ids"]:
                raise SystemExit(f"round {r} at {concurrency} requests: the ids differ with the prefix cache")
        keys = ("tokens_per_s", "ttft_s", "prefill_rows")
        medians = {cached: {k: statistics.median(f[k] for f in figures[cached]) for k in keys} for cached in figures}
        for cached in (False, True):
            m = medians[cached]
            print(
                f"| {concurrency} | {'on' if cached else 'off'} | {m['tokens_per_s']:.1f} | {1e3 * m['ttft_s']:.0f} | "
                f"{m['prefill_rows']:.0f} | {load_average():.2f} |"
            )
        on, off = medians[True], medians[False]
        print(
            f"| {concurrency} | on / off | {on['tokens_per_s'] / off['tokens_per_s']:.2f}x | "
            f"{on['ttft_s'] / off['ttft_s']:.2f}x | {on['prefill_rows'] / off['prefill_rows']:.2f}x | |"
        )


if __name__ == "__main__":
    main()
