"""``@bg.jit``: a function captured into one batch per input signature and replayed with one submit per
call, on every executor; results equal the same function run op by op in numpy."""

from __future__ import annotations

import asyncio
import math
import struct
import weakref

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.jit import DEFAULT_MAX_CAPTURES

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


# what makes a new capture: static values keyed by type and bits, resident tensors by identity -----------

NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]  # a quiet NaN, another payload


def test_signed_zeros_and_nans_key_by_bits(dev):
    """-0.0 and 0.0 are equal but different constants; NaN never equals itself yet is one constant."""
    x = random_array(np.random.default_rng(3), (9,), np.float32)

    @bg.jit(device=dev)
    def signed(x, k):
        return x + math.copysign(1.0, k)  # the Python branch makes the sign visible exactly on any device

    np.testing.assert_array_equal(signed(x, 0.0), x + np.float32(1))
    np.testing.assert_array_equal(signed(x, -0.0), x - np.float32(1))  # was x + 1: the 0.0 capture again
    np.testing.assert_array_equal(signed(x, (-0.0,)[0]), x - np.float32(1))
    assert len(signed.captures) == 2
    for k in (float("nan"), float("nan"), np.float64("nan"), np.float64("nan"), NAN_PAYLOAD, NAN_PAYLOAD):
        signed(x, k)
    assert len(signed.captures) == 5  # one NaN float, one NaN float64, one other payload: was 6 more


def test_static_values_key_by_type_inside_containers(dev):
    """1 == 1.0 == True and hash alike, inside tuples too: each type is its own capture."""
    x = random_array(np.random.default_rng(4), (2, 5), np.int32)

    @bg.jit(device=dev)
    def shifted(x, ks):
        return x + ks[0] * math.copysign(1.0, ks[1]) if isinstance(ks[0], float) else x + ks[0]

    ints = shifted(x, (1, 0.0))
    floats = shifted(x, (1.0, -0.0))  # was the int capture again: int32 x + 1
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    np.testing.assert_array_equal(ints, x + 1)
    np.testing.assert_array_equal(floats, x.astype(np.float32) - 1)
    np.testing.assert_array_equal(shifted(x, (np.int32(1), 0.0)), x + 1)
    assert len(shifted.captures) == 3


def test_resident_tensors_key_by_identity_for_the_captures_lifetime(dev):
    """A capture keyed by a resident tensor holds that tensor: freed, a new tensor at its address (CPython
    reuses them) would replay the old capture, here of the wrong shape."""
    rng = np.random.default_rng(5)
    x = random_array(rng, (8,), np.float32)

    @bg.jit(device=dev)
    def head(x, w):
        return x[: w.shape[0]] * 2.0  # reads only the weight's shape: no op of the capture holds the weight

    first = dev.tensor(random_array(rng, (2,), np.float32))
    np.testing.assert_array_equal(head(x, first), x[:2] * 2)
    held = weakref.ref(first)
    del first
    assert held() is not None  # was freed: its id free for the next tensor
    second = dev.tensor(random_array(rng, (5,), np.float32))
    np.testing.assert_array_equal(head(x, second), x[:5] * 2)
    head.release()
    assert held() is None  # released captures let go of their tensors


def test_captures_are_bounded_least_recently_used_first(dev):
    x = random_array(np.random.default_rng(6), (5,), np.float32)

    @bg.jit(device=dev, max_captures=2)
    def scaled(x, k):
        return x * k

    for k in (1.0, 2.0, 1.0, 3.0):  # 2.0 is the least recently used when 3.0 comes
        np.testing.assert_array_equal(scaled(x, k), x * np.float32(k))
    assert len(scaled.captures) == 2 and (scaled.recorded, scaled.evicted) == (3, 1)
    batches = [capture.batch for capture in scaled.captures.values()]
    np.testing.assert_array_equal(scaled(x, 1.0), x)  # still captured: no new recording
    assert scaled.recorded == 3
    for step in range(20):
        scaled(x, float(step + 10))  # an unbounded stream of values stays within the bound
    assert len(scaled.captures) == 2 and (scaled.recorded, scaled.evicted) == (23, 21)
    assert all(batch.released for batch in batches)  # evicted captures gave their device buffers back
    assert bg.jit(lambda x: x, device=dev).max_captures == DEFAULT_MAX_CAPTURES
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(bg.ArgumentError, match=r"jit: max_captures must be an int >= 1"):
            bg.jit(lambda x: x, device=dev, max_captures=bad)


def test_eviction_waits_for_calls_in_flight(dev):
    """An async call whose capture is evicted while it awaits its reads still returns its values."""
    rng = np.random.default_rng(7)

    @bg.jit(device=dev, max_captures=1)
    def parts(x, k):
        return x * k, x + k, (x - k).abs()

    async def main() -> list:
        arrays = [random_array(rng, (17,), np.float32) for _ in range(4)]
        calls = [parts.call_async(x, float(k)) for k, x in enumerate(arrays)]  # each evicts the previous
        return list(zip(arrays, await asyncio.gather(*calls)))

    for k, (x, (product, total, distance)) in enumerate(asyncio.run(main())):
        k32 = np.float32(k)
        np.testing.assert_array_equal(product, x * k32)
        np.testing.assert_array_equal(total, x + k32)
        np.testing.assert_array_equal(distance, np.abs(x - k32))
    assert len(parts.captures) == 1 and parts.evicted == 3
