"""``@bg.jit``: a function captured into one batch per input signature and replayed with one submit per
call, on every executor; results equal the same function run op by op in numpy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array

DEVICES = ["reference", "wgpu"]


def mlp_numpy(x: np.ndarray, w1: np.ndarray, w2: np.ndarray, scale: float) -> dict[str, np.ndarray]:
    h = np.maximum(x @ w1 * np.float32(scale), 0)
    logits = h @ w2
    return {"logits": logits, "best": logits.argmax(-1).astype(np.int32), "mean": logits.mean()}


@pytest.fixture(params=DEVICES)
def dev(request) -> bg.Device:
    return bg.Device(request.param)


def test_capture_once_per_signature_and_replay(dev):
    rng = np.random.default_rng(1)
    w1, w2 = random_array(rng, (6, 5), np.float32), random_array(rng, (5, 3), np.float32)
    weights = dev.tensor(w1), dev.tensor(w2)

    @bg.jit
    def mlp(x, w1, w2, scale=1.0):
        logits = ((x @ w1) * scale).relu() @ w2
        return {"logits": logits, "best": logits.argmax(-1), "mean": logits.mean()}

    before = dev.stats.snapshot()
    for rows in (2, 2, 7, 2):
        x = random_array(rng, (rows, 6), np.float32)
        got = mlp(x, *weights)
        for key, want in mlp_numpy(x, w1, w2, 1.0).items():
            assert_close(got[key], want, want.dtype if want.dtype != np.int32 else None)
    assert len(mlp.captures) == 2  # (2, 6) and (7, 6)
    got = mlp(x, *weights, scale=0.5)  # another static value: a third capture
    assert_close(got["logits"], mlp_numpy(x, w1, w2, 0.5)["logits"])
    assert len(mlp.captures) == 3
    if dev.executor.name == "wgpu":
        assert dev.stats.snapshot()["submits"] - before["submits"] == 5  # one submit per call


def test_async_calls_interleave(dev):
    rng = np.random.default_rng(2)

    @bg.jit(device=dev)
    def scaled(x, y):
        return (x * y + 1.0, (x - y).abs())

    async def main() -> list:
        arrays = [(random_array(rng, (33,), np.float32), random_array(rng, (33,), np.float32)) for _ in range(4)]
        results = await asyncio.gather(*(scaled.call_async(x, y) for x, y in arrays))
        return list(zip(arrays, results))

    for (x, y), (first, second) in asyncio.run(main()):
        assert_close(first, x * y + np.float32(1.0))
        assert_close(second, np.abs(x - y))
    assert len(scaled.captures) == 1


def test_refusals(dev):
    @bg.jit(device=dev)
    def double(x):
        return x * 2

    with pytest.raises(bg.ArgumentError, match=r"jit: argument 0 of type list"):
        double([[1.0, 2.0]])
    with pytest.raises(bg.DTypeError, match=r"float64"):
        double(np.ones(3))
    with pytest.raises(bg.ArgumentError, match=r"returned no tensor"):
        bg.jit(lambda x: 3, device=dev)(np.ones(3, np.float32))
    np.testing.assert_array_equal(double(np.arange(3, dtype=np.int32)), [0, 2, 4])  # still works afterwards
    double.release()
    assert not double.captures
