"""A Qwen-style feed-forward stack: per layer gate/up matmuls, silu(gate) * up, down matmul and a
residual add, all layers recorded into ONE batch, executed with one submit, checked against numpy."""

from __future__ import annotations

import argparse
import time

import numpy as np

import batchgpu as bg


def make_weights(rng: np.random.Generator, layers: int, hidden: int, ffn: int) -> list[dict[str, np.ndarray]]:
    scale_in, scale_out = 1 / np.sqrt(hidden), 1 / np.sqrt(ffn)
    return [
        {
            "gate": (rng.standard_normal((hidden, ffn)) * scale_in).astype(np.float32),
            "up": (rng.standard_normal((hidden, ffn)) * scale_in).astype(np.float32),
            "down": (rng.standard_normal((ffn, hidden)) * scale_out).astype(np.float32),
        }
        for _ in range(layers)
    ]


def record_ffn(batch: bg.GpuCommandBatch, x: bg.Tensor, weights: list[dict[str, bg.Tensor]]) -> bg.Tensor:
    """h = x; per layer: h = h + down(silu(h @ gate) * (h @ up))."""
    h = x
    for layer in weights:
        gate = batch.matmul(h, layer["gate"])
        up = batch.matmul(h, layer["up"])
        h = batch.add(h, batch.matmul(batch.mul(batch.silu(gate), up), layer["down"]))
    return h


def numpy_ffn(x: np.ndarray, weights: list[dict[str, np.ndarray]]) -> np.ndarray:
    h = x.astype(np.float64)
    for layer in weights:
        gate, up = h @ layer["gate"], h @ layer["up"]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ layer["down"]
    return h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()

    started = time.perf_counter()
    dev = bg.Device()
    rng = np.random.default_rng(0)
    host_weights = make_weights(rng, args.layers, args.hidden, args.ffn)
    weights = [
        {name: dev.tensor(w, name=f"l{i}.{name}") for name, w in layer.items()} for i, layer in enumerate(host_weights)
    ]
    x_data = rng.standard_normal((args.tokens, args.hidden)).astype(np.float32)

    batch = bg.GpuCommandBatch(dev)
    x = batch.upload(x_data)
    y = record_ffn(batch, x, weights)
    batch.outputs(y)  # only y is read: the other activations share device buffers
    submits = dev.stats.submits
    batch.execute()
    out = batch.read(y)
    first_result = time.perf_counter() - started
    print(f"device: {dev.name}")
    print(
        f"{args.layers} layers, {len(batch)} ops, {dev.stats.submits - submits} submit, "
        f"{dev.stats.pipelines_compiled} pipelines; Device() to first result {first_result * 1e3:.0f} ms"
    )
    planned, unshared = batch.memory()["planned"] / 1024, batch.memory()["unshared"] / 1024
    print(f"batch buffers: {planned:.0f} KiB ({unshared:.0f} KiB with one buffer per tensor)")

    expected = numpy_ffn(x_data, host_weights)
    error = np.abs(out - expected).max() / np.abs(expected).max()
    print(f"max relative error vs numpy float64: {error:.2e}")
    assert error < 1e-4, error

    times = []
    for i in range(args.repeat):
        new_x = (x_data * (1 + i / args.repeat)).astype(np.float32)
        t0 = time.perf_counter()
        batch.execute({x: new_x})
        out = batch.read(y)
        times.append(time.perf_counter() - t0)
    error = np.abs(out - numpy_ffn(new_x, host_weights)).max() / np.abs(out).max()
    assert error < 1e-4, error
    print(
        f"re-execute + read: median {np.median(times) * 1e3:.2f} ms over {args.repeat} runs "
        f"(pipelines compiled still {dev.stats.pipelines_compiled})"
    )


if __name__ == "__main__":
    main()
