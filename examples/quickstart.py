"""Quickstart: a tiny dense layer recorded once, executed twice with one submit each."""

from __future__ import annotations

import asyncio

import numpy as np

import batchgpu as bg


def main() -> None:
    dev = bg.Device()  # wgpu on the best adapter (BATCHGPU_DEVICE=reference for numpy)
    print(f"device: {dev.name}")
    rng = np.random.default_rng(0)
    x_data = rng.standard_normal((4, 64)).astype(np.float32)
    w_data = rng.standard_normal((64, 32)).astype(np.float32)
    b_data = rng.standard_normal(32).astype(np.float32)

    w = dev.tensor(w_data)  # weights: uploaded once, resident on the device
    b = dev.tensor(b_data)
    batch = bg.GpuCommandBatch(dev)
    x = batch.upload(x_data)  # a batch input, uploaded by execute()
    y = batch.relu(batch.add(batch.matmul(x, w), b))

    batch.execute()  # one command encoder, one queue submit
    out = batch.read(y)
    expected = np.maximum(x_data @ w_data + b_data, 0)
    print(f"relu(x @ w + b): shape {out.shape}, max |error| vs numpy {np.abs(out - expected).max():.2e}")

    async def again() -> np.ndarray:
        await batch.execute_async({x: 2 * x_data})  # new input, no re-recording, no new pipeline
        return await batch.read_async(y)

    out2 = asyncio.run(again())
    expected2 = np.maximum(2 * x_data @ w_data + b_data, 0)
    print(f"re-executed with new input: max |error| {np.abs(out2 - expected2).max():.2e}")
    stats = dev.stats
    print(
        f"stats: {stats.submits} submits, {stats.dispatches} dispatches, {stats.pipelines_compiled} pipelines compiled"
    )
    assert np.allclose(out, expected, rtol=1e-4, atol=1e-4) and np.allclose(out2, expected2, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    main()
