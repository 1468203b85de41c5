"""``execute(profile=True)`` on the native executors: timing events around every launch.

Runs on a CUDA or HIP device; without the vendor's driver or a device each test skips, the reason
naming what is missing (as in tests/test_native_ops.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.executors import native_timing

from .conftest import assert_close, native_device_or_skip, random_array


@pytest.fixture(params=["cuda", "hip"])
def native_device(request) -> bg.Device:
    return native_device_or_skip(request.param)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def record(batch: bg.GpuCommandBatch, rng: np.random.Generator) -> tuple[bg.Tensor, bg.Tensor, bg.Tensor, bg.Tensor]:
    """matmul, add, softmax and a reduction (two launches) on random inputs."""
    x = batch.upload(random_array(rng, (6, 40), np.float32))
    w = batch.upload(random_array(rng, (40, 24), np.float32) * 0.1)
    s = batch.softmax(batch.add(batch.matmul(x, w), 1.0))
    return x, w, s, batch.sum(batch.reshape(s, (2, 3, 24)), axis=(0, 2))


def expected(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = softmax((x @ w + np.float32(1.0)).astype(np.float32))
    return s, s.reshape(2, 3, 24).sum(axis=(0, 2))


def test_profiled_execute_times_every_launch_and_keeps_results(native_device):
    rng = np.random.default_rng(70)
    batch = bg.GpuCommandBatch(native_device)
    x, w, s, total = record(batch, rng)
    for round_ in range(3):  # first execute plans; later ones reuse the plan's timing events
        feeds = {x: random_array(rng, (6, 40), np.float32), w: random_array(rng, (40, 24), np.float32) * 0.1}
        batch.execute(feeds, profile=True)
        want_s, want_total = expected(feeds[x], feeds[w])
        assert_close(batch.read(s), want_s, scale=10)
        assert_close(batch.read(total), want_total, scale=10)

        profile = batch.profile()
        rows = profile.rows
        assert [(r.index, r.op) for r in rows] == [
            (i, n.spec.name) for i, n in enumerate(batch.nodes) for _ in n.launches
        ]
        assert profile.gpu_timing, profile.message
        assert all(r.gpu_us is not None and r.gpu_us > 0 for r in rows), [r.gpu_us for r in rows]
        assert all(min(r.dispatch) >= 1 for r in rows)
        names = [name for name, *_ in profile.host_spans]
        assert names[-3:] == ["upload", "launch", "submit"] and (round_ > 0 or names[0] == "plan")
        if round_ == 0:
            events = native_timing._events[batch.view().plan].handles
        else:
            assert native_timing._events[batch.view().plan].handles is events  # created once per plan


def test_unprofiled_executes_after_a_profiled_one_agree(native_device):
    """Profiled (eager) and plain executes (graph replay from the second run on) give the same values."""
    rng = np.random.default_rng(71)
    batch = bg.GpuCommandBatch(native_device)
    _, _, s, total = record(batch, rng)
    batch.execute(profile=True)
    profiled = batch.read(s), batch.read(total)
    for _ in range(3):
        batch.execute()
        np.testing.assert_array_equal(batch.read(s), profiled[0])
        np.testing.assert_array_equal(batch.read(total), profiled[1])
    batch.execute(profile=True)
    assert all(r.gpu_us > 0 for r in batch.profile().rows)
