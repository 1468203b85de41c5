"""What reading per-token values costs (SmolLM2-135M, quantized): ms per token of a teacher-forced loop
(``Llama.decode(token)``, each token from the host) that reads only the next token id, against the same
loop reading the step's 49,152 logits (and taking their float64 log-softmax on the host, as a scorer
would), interleaved in one run, with the submits, plans and bytes read back per token. Where the engine
has logprobs (issue 29), also: generated tokens with and without logprobs (the device's ``logprobs`` op,
its small rows read back) and the prompt scored in prefill steps (``prompt_logprobs``, what ``echo`` with
``max_tokens`` 0 serves), per prompt token.

    python benchmarks/logits_read.py [--device reference,wgpu] [--tokens 8] [--rounds 3] [--json out.json]

Every loop runs once untimed first (recording, compiles); each figure is the median over ``--rounds``
interleaved rounds of the median step. Bytes read are ``device.stats.bytes_read`` (the executor's
copies into host memory); plans are the batches' runners made during the timed steps. The load average
is printed beside the table (the host is shared: compare figures of one run).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

try:
    from machine_load import load_average
except ImportError:  # loaded by path from elsewhere
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine_load import load_average

import batchgpu as bg
from batchgpu import runner
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.llama import Llama

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
FORCED = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]  # its greedy continuation, fed back


class Counts:
    """Submits, plans (runners made) and bytes read back over a stretch of steps."""

    plans = 0

    def __init__(self, device: bg.Device) -> None:
        self.device = device

    def __enter__(self) -> Counts:
        self.stats, self.plans_before = self.device.stats.snapshot(), Counts.plans
        return self

    def __exit__(self, *exc: object) -> None:
        after = self.device.stats.snapshot()
        self.submits = after["submits"] - self.stats["submits"]
        self.bytes = after["bytes_read"] - self.stats["bytes_read"]
        self.made = Counts.plans - self.plans_before


def count_plans() -> None:
    """Count every Runner made (a new plan of a batch) from now on."""
    made = runner.Runner.__init__

    def counting(self: runner.Runner, *args: object, **kwargs: object) -> None:
        Counts.plans += 1
        made(self, *args, **kwargs)

    runner.Runner.__init__ = counting  # type: ignore[method-assign]


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    x = logits.astype(np.float64)
    return float(x[token] - x.max() - np.log(np.exp(x - x.max()).sum()))


def teacher_forced(model: Llama, tokens: int, read_logits: bool) -> tuple[list[float], Counts]:
    """Seconds per step of decode(token) + a read, over FORCED[:tokens]; the counts of the whole loop."""
    step = model.prefill(PROMPT)
    step.batch.read(step.next_token)
    times = []
    with Counts(model.device) as counts:
        for token, following in itertools.pairwise(FORCED[: tokens + 1]):
            started = time.perf_counter()
            step = model.decode(token)
            if read_logits:
                log_softmax_at(step.batch.read(step.logits)[0], following)
            else:
                int(step.batch.read(step.next_token)[0])
            times.append(time.perf_counter() - started)
    return times, counts


def engine_steps(engine: Engine, params: SamplingParams, prompt: list[int]) -> tuple[list[float], Counts]:
    """Seconds per generated token of one request (its prefill step included); its counts."""
    with Counts(engine.device) as counts:
        started = time.perf_counter()
        engine.complete(prompt, params)
        elapsed = time.perf_counter() - started
    return [elapsed / params.max_tokens], counts


def prompt_scoring(engine: Engine, prompt: list[int], scored: bool) -> tuple[list[float], Counts]:
    """Seconds per prompt token of a one-token request (prefill steps), with prompt logprobs or without."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1 if scored else None)
    with Counts(engine.device) as counts:
        started = time.perf_counter()
        engine.complete(prompt, params)
        elapsed = time.perf_counter() - started
    return [elapsed / len(prompt)], counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="reference,wgpu", help="executors, comma-separated")
    parser.add_argument("--tokens", type=int, default=8, help="teacher-forced tokens per loop (at most 11)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    count_plans()
    logprobs = "logprobs" in SamplingParams.__dataclass_fields__
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; load average {load_average():.2f}")
    print(f"SmolLM2-135M Q4_1/Q8_0; teacher-forced over {args.tokens} tokens; median of {args.rounds} rounds\n")
    print("| device | loop | ms/token | x next-token-only | submits/token | plans/token | bytes read/token |")
    print("|---|---|---:|---:|---:|---:|---:|")
    report = []
    for kind in args.device.split(","):
        device = bg.Device(kind)
        model = Llama(device, quantized=True, max_context=64)
        loops: dict[str, Callable[[], tuple[list[float], Counts]]] = {
            "decode + read next token": functools.partial(teacher_forced, model, args.tokens, False),
            "decode + read logits + host log-softmax": functools.partial(teacher_forced, model, args.tokens, True),
        }
        if logprobs:
            engine = Engine(device=device, max_batch=1, max_context=64)
            forced = PROMPT + FORCED[: args.tokens]
            plain = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
            asked = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=5)
            loops.update(
                {
                    "engine generate, no logprobs": functools.partial(engine_steps, engine, plain, PROMPT),
                    "engine generate, logprobs=5": functools.partial(engine_steps, engine, asked, PROMPT),
                    "engine prefill per prompt token, not scored": functools.partial(
                        prompt_scoring, engine, forced, False
                    ),
                    "engine prefill per prompt token, scored (echo)": functools.partial(
                        prompt_scoring, engine, forced, True
                    ),
                }
            )
        for loop in loops.values():
            loop()  # untimed: recording, compiles
        medians: dict[str, list[float]] = {name: [] for name in loops}
        counts: dict[str, Counts] = {}
        for _ in range(args.rounds):
            for name, loop in loops.items():
                times, counts[name] = loop()
                medians[name].append(statistics.median(times))
        base = statistics.median(medians["decode + read next token"])
        for name, values in medians.items():
            ms = statistics.median(values) * 1e3
            steps = args.tokens if "prompt token" not in name else len(PROMPT) + args.tokens
            c = counts[name]
            print(
                f"| {device.name} | {name} | {ms:.2f} | {ms / (base * 1e3):.2f} | {c.submits / steps:.2f} | "
                f"{c.made / steps:.2f} | {c.bytes / steps:.0f} |"
            )
            report.append({"device": device.name, "loop": name, "ms": values, "submits": c.submits, "bytes": c.bytes})
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
