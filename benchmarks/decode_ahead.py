"""SmolLM2-135M greedy decode with the next token kept on the device: steps submitted ahead of the reads
(``Llama.generate(ahead=2)``) against each step waiting for the previous token's read (``ahead=0``),
interleaved in one run, with the host time to encode and submit one decode step and its dispatches.

    python benchmarks/decode_ahead.py [--device wgpu] [--tokens 16] [--rounds 3] [--json out.json]

On a GPU the time per token with steps ahead approaches max(host encode, GPU time) instead of their sum.
On lavapipe a submit blocks while earlier work runs, and the reference executor computes inside
``execute()``, so there both columns measure the same serial work (the host column still holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone

import batchgpu as bg
from batchgpu.models.llama import Llama

PROMPT = [504, 3575, 282, 4649, 314]
WARM = 3  # the prompt's token and the first two decode steps (recording, compiles, graph capture)


def ms_per_token(model: Llama, tokens: int, ahead: int) -> tuple[float, list[int]]:
    """Median ms between consecutive tokens after the warm-up ones."""
    stamps, ids = [], []
    for token in model.generate(PROMPT, tokens, ahead=ahead):
        stamps.append(time.perf_counter())
        ids.append(token)
    gaps = [b - a for a, b in zip(stamps[WARM:], stamps[WARM + 1 :])]
    return statistics.median(gaps) * 1e3, ids


def host_submit_ms(model: Llama, steps: int) -> tuple[float, int]:
    """Median host ms of one decode step's execute (encode and submit) on an idle device, and the
    dispatches of one step."""
    step = model.prefill(PROMPT)
    token = int(step.batch.read(step.next_token)[0])
    times = []
    dispatches = 0
    for _ in range(steps):
        before = model.device.stats.dispatches
        started = time.perf_counter()
        step = model.decode(token)
        times.append(time.perf_counter() - started)
        dispatches = model.device.stats.dispatches - before
        token = int(step.batch.read(step.next_token)[0])
    return statistics.median(times[2:]) * 1e3, dispatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="executors, comma-separated (default: the default device)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of ahead=0 and ahead=2")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    kinds = args.device.split(",") if args.device else [None]
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; {args.tokens} tokens, median gap\n")
    print("| device | dispatches/step | host encode+submit ms/step | ms/token, ahead 0 | ms/token, ahead 2 | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    report = []
    for kind in kinds:
        device = bg.Device(kind)
        model = Llama(device, quantized=True, max_context=128)
        list(model.generate(PROMPT, 4))  # records and compiles every step
        host, dispatches = host_submit_ms(model, 10)
        timings: dict[int, list[float]] = {0: [], 2: []}
        ids = {}
        for _ in range(args.rounds):
            for ahead in timings:
                ms, ids[ahead] = ms_per_token(model, args.tokens, ahead)
                timings[ahead].append(ms)
        serial, overlapped = statistics.median(timings[0]), statistics.median(timings[2])
        assert ids[0] == ids[2], "steps ahead changed the greedy ids"
        print(
            f"| {device.name} | {dispatches} | {host:.2f} | {serial:.2f} | {overlapped:.2f} | "
            f"{overlapped / serial:.2f} |"
        )
        report.append(
            {
                "device": device.name,
                "dispatches_per_step": dispatches,
                "host_submit_ms": host,
                "ms_per_token_ahead0": timings[0],
                "ms_per_token_ahead2": timings[2],
            }
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
