"""Structured outputs' cost: ``batchgpu.llm.Engine`` tokens/s with and without a JSON schema (SmolLM2-135M),
at 1 and 16 concurrent requests, the two alternated round by round on one engine; and the host time spent
on grammars per step (filling the allowed-token masks and advancing the guides, llguidance).

    python benchmarks/structured.py [--device reference,wgpu] [--concurrency 1,16] [--tokens 48] [--rounds 3]
                                    [--ahead N] [--json out.json]

Every request generates exactly ``--tokens`` tokens (end-of-sequence ignored for free text; the schema, a
long array of short strings, cannot end sooner), sampled at temperature 0.8 with its own seed. Timed: from
submitting a level's requests to the last token; the engine is built and warmed up (masked step variants
recorded) first. Target (issue 29): a JSON schema at most 10% slower. A decode step with grammar rows is
split (forward, then sampling once the step before is read and the masks filled), so with ``ahead`` > 0
(a GPU's default) the masks are filled while the forward part runs; on these CPU devices steps are not run
ahead by default (``--ahead`` sets it).
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

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams, StructuredOutput
from batchgpu.llm import step as step_module

SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 200}},
    "required": ["words"],
}
PROMPT = [{"role": "user", "content": "List many English words as JSON."}]


class GrammarClock:
    """Host seconds spent filling masks (``pack_masks``) and advancing guides (``Guide.accept``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        from batchgpu.llm import grammar

        self.originals = (step_module.pack_masks, grammar.Guide.accept)
        step_module.pack_masks = self.timed(step_module.pack_masks)
        grammar.Guide.accept = self.timed(grammar.Guide.accept)

    def timed(self, function):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return run


async def one(engine: Engine, params: SamplingParams) -> int:
    return sum([len(piece.token_ids) async for piece in engine.generate(PROMPT, params)])


async def level(engine: Engine, requests: int, tokens: int, schema: bool) -> dict[str, float]:
    structured = StructuredOutput(json_schema=SCHEMA) if schema else None
    params = [
        SamplingParams(max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True, structured=structured)
        for i in range(requests)
    ]
    steps = sum(engine.steps.values())
    started = time.perf_counter()
    generated = sum(await asyncio.gather(*(one(engine, p) for p in params)))
    wall = time.perf_counter() - started
    return {"tokens_per_s": generated / wall, "steps": sum(engine.steps.values()) - steps}


def run_device(kind: str, levels: list[int], tokens: int, rounds: int, ahead: int | None) -> list[dict[str, object]]:
    device = bg.Device(kind)
    blocks = max(levels) * -(-(64 + tokens) // 16)
    engine = Engine(device=device, max_batch=max(levels), max_context=256, kv_blocks=blocks, ahead=ahead)
    clock = GrammarClock()
    for requests in levels:  # warm up: every step size and its masked variant recorded
        asyncio.run(level(engine, requests, 4, False))
        asyncio.run(level(engine, requests, 4, True))
    rows = []
    for requests in levels:
        runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        grammar_seconds = 0.0
        for turn in range(rounds):
            for schema in (turn % 2 == 1, turn % 2 == 0):  # alternate which goes first
                before = clock.seconds
                runs[schema].append(asyncio.run(level(engine, requests, tokens, schema)))
                if schema:
                    grammar_seconds += clock.seconds - before
        free = statistics.median(r["tokens_per_s"] for r in runs[False])
        guided = statistics.median(r["tokens_per_s"] for r in runs[True])
        guided_steps = sum(r["steps"] for r in runs[True])
        rows.append(
            {
                "device": device.name,
                "kind": kind,
                "requests": requests,
                "free_tokens_per_s": free,
                "schema_tokens_per_s": guided,
                "ratio": guided / free,
                "grammar_us_per_step": 1e6 * grammar_seconds / max(1, guided_steps),
                "grammar_us_per_token": 1e6 * grammar_seconds / (rounds * requests * tokens),
                "load": load_average(),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference,wgpu", help="comma-separated device kinds")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated request counts")
    parser.add_argument("--tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each (alternated)")
    parser.add_argument("--ahead", type=int, default=None, help="steps submitted ahead (default: the device's)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load (1 min) {load_average():.2f}")
    print(
        "| device | requests | tokens/s free | tokens/s JSON schema | ratio | grammar host µs/step | µs/token | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    report = []
    for kind in args.device.split(","):
        for row in run_device(kind, levels, args.tokens, args.rounds, args.ahead):
            report.append(row)
            print(
                f"| {row['device']} | {row['requests']} | {row['free_tokens_per_s']:.1f} | "
                f"{row['schema_tokens_per_s']:.1f} | {row['ratio']:.2f} | {row['grammar_us_per_step']:.0f} | "
                f"{row['grammar_us_per_token']:.0f} | {row['load']:.2f} |"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
