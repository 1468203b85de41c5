"""Quantized GEMV speed per block format: one row of x times a (rows, K) weight matrix kept in each GGUF
block format, executed and read back, as GB/s of weight bytes read and as a fraction of the machine's
measured memory bandwidth (a numpy copy), formats interleaved in one run.

    python benchmarks/formats.py [--device wgpu,reference] [--rows 2048] [--k 2048] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import batchgpu as bg
from batchgpu import quant

sys.path.append(str(Path(__file__).resolve().parent))
from decode import copy_bandwidth

SCALE_OFFSETS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2)}
SCALE_OFFSETS |= {"q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(rng: np.random.Generator, name: str, rows: int, k: int) -> np.ndarray:
    """GGUF bytes of a (rows, k) matrix with random quants and finite float16 scales."""
    fmt = quant.FORMATS[name]
    count = rows * k // fmt.weights
    if name in ("f16", "bf16"):
        values = rng.standard_normal(count * 32).astype(np.float32)
        return (values.astype(np.float16) if name == "f16" else (values.view(np.uint32) >> 16).astype(np.uint16)).view(
            np.uint8
        )
    blocks = rng.integers(0, 256, (count, fmt.gguf_bytes), dtype=np.uint8)
    for at in SCALE_OFFSETS[name]:
        blocks[:, at : at + 2] = rng.uniform(-0.1, 0.1, (count, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="wgpu,reference")
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    rng = np.random.default_rng(0)
    blocks = {name: random_blocks(rng, name, args.rows, args.k) for name in quant.FORMATS}
    x = rng.standard_normal((1, args.k), dtype=np.float32)
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"date: {stamp}; GEMV 1 x {args.k} @ ({args.rows}, {args.k}).T")
    print(f"host memory bandwidth (numpy copy, read + write): {bandwidth / 1e9:.1f} GB/s\n")
    print("| device | format | bits/weight | ms (median) | GB/s | of bandwidth |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in args.device.split(","):
        device = bg.Device(kind)
        runs = {}
        for name, raw in blocks.items():
            w = device.quantized(raw, name, (args.rows, args.k))
            batch = bg.GpuCommandBatch(device)
            y = batch.matmul(batch.upload(x), w, transpose_b=True)
            batch.execute()
            batch.read(y)
            runs[name] = (batch, y, w.nbytes)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.repeat):
            for name, (batch, y, _) in runs.items():
                started = time.perf_counter()
                batch.execute()
                batch.read(y)
                times[name].append(time.perf_counter() - started)
        for name, (_, _, nbytes) in runs.items():
            median = statistics.median(times[name])
            bits = 8 * nbytes / (args.rows * args.k)
            rate = nbytes / median
            figures = f"{bits:.2f} | {median * 1e3:.2f} | {rate / 1e9:.2f} | {rate / bandwidth:.2f}"
            print(f"| {device.name} | {name} | {figures} |")


if __name__ == "__main__":
    main()
