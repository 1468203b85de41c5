"""Elementwise fusion: chains of elementwise ops executed fused and unfused, interleaved in one run (each
first in every other round): dispatches and ms per execute. ``gelu-style``: a GELU-style activation
with bias and residual, and a cast round trip; ``where``: a leaky ReLU and a clamp written with
comparisons and ``where``.

    python benchmarks/fusion.py [--device wgpu,reference] [--elements 1048576] [--repeat 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import numpy as np

import batchgpu as bg
from batchgpu import Tensor


def gelu_style(batch: bg.GpuCommandBatch, t: Tensor, b: Tensor) -> Tensor:
    h = batch.add(t, b)  # bias, broadcast over rows
    h = batch.mul(batch.tanh(batch.mul(h, 0.79788456)), 0.5)
    h = batch.add(batch.mul(h, t), t)  # a gate and the residual
    h = batch.cast(batch.cast(h, np.float16), np.float32)
    return batch.maximum(batch.neg(h), -4.0)


def where_chain(batch: bg.GpuCommandBatch, t: Tensor, b: Tensor) -> Tensor:
    h = batch.where(t > b, t, 0.1 * t)  # a leaky ReLU around a per-column threshold
    return batch.where(h < 1.5, h, 1.5)


CHAINS: dict[str, Callable[[bg.GpuCommandBatch, Tensor, Tensor], Tensor]] = {
    "gelu-style": gelu_style,
    "where": where_chain,
}


def record(
    device: bg.Device, x: np.ndarray, bias: np.ndarray, chain: str, fusion: bool
) -> tuple[bg.GpuCommandBatch, Tensor]:
    batch = bg.GpuCommandBatch(device, fusion=fusion)
    out = CHAINS[chain](batch, batch.upload(x), batch.upload(bias))
    batch.outputs(out)
    return batch, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="wgpu,reference")
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    width = 1024
    x = rng.standard_normal((args.elements // width, width), dtype=np.float32)
    bias = rng.standard_normal(width, dtype=np.float32)
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; {x.size} float32 elements\n")
    print("| device | chain | dispatches unfused | dispatches fused | ms unfused | ms fused | fused / unfused |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, chain in [(kind, chain) for kind in args.device.split(",") for chain in CHAINS]:
        device = bg.Device(kind)
        runs = {fusion: record(device, x, bias, chain, fusion) for fusion in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        dispatches = {}
        for fusion, (batch, out) in runs.items():
            batch.execute()
            batch.read(out)
            before = device.stats.dispatches
            batch.execute()
            batch.read(out)
            dispatches[fusion] = device.stats.dispatches - before
        for round_ in range(args.repeat):  # which runs first alternates: the second of a pair ran slower
            for fusion in (False, True) if round_ % 2 == 0 else (True, False):
                batch, out = runs[fusion]
                started = time.perf_counter()
                batch.execute()
                batch.read(out)
                times[fusion].append(time.perf_counter() - started)
        np.testing.assert_allclose(runs[True][0].read(runs[True][1]), runs[False][0].read(runs[False][1]))
        plain, fused = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        counts = f"{dispatches[False]} | {dispatches[True]}"
        print(f"| {device.name} | {chain} | {counts} | {plain:.2f} | {fused:.2f} | {fused / plain:.2f} |")


if __name__ == "__main__":
    main()
