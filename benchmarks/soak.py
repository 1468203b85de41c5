"""Memory soak (issue 7): many executes + reads of the FFN example on one device; host RSS and the
device's live buffer count must stay flat.

Run from a checkout: ``python benchmarks/soak.py [--rounds 10000] [--layers 1 --tokens 4 --hidden 64 --ffn 128]``.
``tests/test_soak.py`` runs :func:`soak` with a bound; this script prints the figures for RESULTS.md.

Timed window (ms per round): the ``--rounds`` rounds after 200 untimed warm-up rounds (plan,
pipeline compiles, first runs, staging pool); it includes the numpy checks (about every 500 rounds) and
an RSS probe every 1000. The machine's 1-minute load average before and after the timed rounds is printed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import batchgpu as bg

try:
    from machine_load import load_average
except ImportError:  # loaded by path (tests/test_soak.py), not run as a script
    sys.path.append(str(Path(__file__).resolve().parent))
    from machine_load import load_average

ROOT = Path(__file__).resolve().parent.parent


def load_ffn() -> Any:
    """examples/ffn_layer.py as a module (record_ffn, make_weights, numpy_ffn)."""
    spec = importlib.util.spec_from_file_location("ffn_layer", ROOT / "examples" / "ffn_layer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def soak(
    dev: bg.Device,
    rounds: int = 10_000,
    *,
    layers: int = 1,
    tokens: int = 4,
    hidden: int = 64,
    ffn: int = 128,
    warmup: int = 200,
    check_every: int = 500,
) -> dict[str, Any]:
    """Execute the FFN batch ``rounds`` times with a new input each time and read the result each time;
    every ``check_every`` rounds the result is compared with numpy. Returns the figures: RSS and
    ``buffers_live`` / ``buffers_created`` / ``staging_idle`` after ``warmup`` rounds and at the end,
    the peak RSS seen, the time per round (the warm-up rounds untimed) and the 1-minute load average
    before and after the timed rounds."""
    ffn_module = load_ffn()
    rng = np.random.default_rng(7)
    host_weights = ffn_module.make_weights(rng, layers, hidden, ffn)
    weights = [{name: dev.tensor(w) for name, w in layer.items()} for layer in host_weights]
    x_data = rng.standard_normal((tokens, hidden)).astype(np.float32)
    batch = bg.GpuCommandBatch(dev, name="soak")
    x = batch.upload(x_data)
    y = ffn_module.record_ffn(batch, x, weights)
    inputs = [(x_data * (1 + i / 8)).astype(np.float32) for i in range(8)]
    expected = [ffn_module.numpy_ffn(a, host_weights) for a in inputs]
    process = psutil.Process()

    def run(count: int, offset: int) -> float:
        worst = 0.0
        for i in range(count):
            k = (offset + i) % len(inputs)
            batch.execute({x: inputs[k]})
            out = batch.read(y)
            if i % check_every == 0 or i == count - 1:
                error = float(np.abs(out - expected[k]).max() / np.abs(expected[k]).max())
                assert error < 1e-4, f"round {offset + i}: relative error {error:.2e}"
                worst = max(worst, error)
        return worst

    run(warmup, 0)  # allocators, pipelines, staging pool and the plan settle
    gc.collect()
    before = {"rss": process.memory_info().rss, **dev.stats.snapshot()}
    peak = before["rss"]
    load_before = load_average()
    started = time.perf_counter()
    worst = 0.0
    done = 0
    while done < rounds:
        step = min(1000, rounds - done)
        worst = max(worst, run(step, warmup + done))
        done += step
        peak = max(peak, process.memory_info().rss)
    seconds = time.perf_counter() - started
    load_after = load_average()
    gc.collect()
    after = {"rss": process.memory_info().rss, **dev.stats.snapshot()}
    batch.release()
    return {
        "rounds": rounds,
        "warmup_rounds": warmup,
        "ops": len(weights) * 6,
        "ms_per_round": 1e3 * seconds / rounds,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "worst_relative_error": worst,
        "rss_before": before["rss"],
        "rss_after": after["rss"],
        "rss_peak": peak,
        "buffers_live_before": before["buffers_live"],
        "buffers_live_after": after["buffers_live"],
        "buffers_created_during": after["buffers_created"] - before["buffers_created"],
        "staging_idle_before": before["staging_idle"],
        "staging_idle_after": after["staging_idle"],
        "submits_during": after["submits"] - before["submits"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    args = parser.parse_args()
    dev = bg.Device()
    figures = soak(dev, args.rounds, layers=args.layers, tokens=args.tokens, hidden=args.hidden, ffn=args.ffn)
    mib = 2**20
    print(f"device: {dev.name}; CPython {platform.python_version()}, numpy {np.__version__}")
    shape = f"x {args.tokens}x{args.hidden}, ffn {args.ffn}"
    print(f"FFN {args.layers} layer(s), {shape}: {figures['ops']} ops per execute")
    print(
        f"rounds (execute + read_sync): {figures['rounds']} after {figures['warmup_rounds']} untimed warm-up rounds, "
        f"{figures['ms_per_round']:.3f} ms per round; load average (1 min) {figures['load_average_before']:.2f} "
        f"before, {figures['load_average_after']:.2f} after, on {os.cpu_count()} CPUs"
    )
    print(
        f"host RSS: before {figures['rss_before'] / mib:.1f} MiB, after {figures['rss_after'] / mib:.1f} MiB "
        f"(growth {(figures['rss_after'] - figures['rss_before']) / mib:+.2f} MiB), "
        f"peak {figures['rss_peak'] / mib:.1f} MiB"
    )
    print(
        f"device buffers live: before {figures['buffers_live_before']}, after {figures['buffers_live_after']}; "
        f"created during the soak: {figures['buffers_created_during']}; staging idle {figures['staging_idle_after']}; "
        f"submits {figures['submits_during']}"
    )
    print(f"worst relative error vs numpy float64 (checked every 500 rounds): {figures['worst_relative_error']:.2e}")


if __name__ == "__main__":
    main()
