"""Faults (issue 7): a device destroyed mid-execute fails pending reads with a DeviceError naming the
batch and tensor (no hang, no bare wgpu exception, no abort inside wgpu-native), later use of that
Device fails the same way, and a new Device works; a GPU validation error inside a submit surfaces as
a DeviceError naming the op. Each test makes its own wgpu Device: the session one must survive."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array

LOST = "was destroyed"


def small_batch(dev: bg.Device, rng: np.random.Generator) -> tuple[bg.GpuCommandBatch, bg.Tensor, np.ndarray]:
    xa = random_array(rng, (64,), np.float32)
    batch = bg.GpuCommandBatch(dev, name="victim")
    y = batch.tanh(batch.add(batch.mul(batch.upload(xa), 2.0), 1.0))
    return batch, y, np.tanh(xa * 2 + 1)


def check_new_device_works(rng: np.random.Generator) -> None:
    fresh = bg.Device("wgpu")
    batch, y, expected = small_batch(fresh, rng)
    batch.execute()
    assert_close(batch.read(y), expected.astype(np.float32))


def test_destroy_after_execute_fails_the_read_and_later_use() -> None:
    rng = np.random.default_rng(71)
    dev = bg.Device("wgpu")
    w = dev.tensor(random_array(rng, (64,), np.float32), name="w")
    batch, y, expected = small_batch(dev, rng)
    z = batch.add(y, w)
    batch.execute()
    assert_close(batch.read(y), expected)
    batch.execute()  # pending: submitted, not read
    dev.executor.device.destroy()
    with pytest.raises(bg.DeviceError, match=rf"read .*of batch 'victim'.*{LOST}.*new bg.Device\(\)"):
        batch.read(z)
    with pytest.raises(bg.DeviceError, match=rf"execute: .*{LOST}"):
        batch.execute()
    other = bg.GpuCommandBatch(dev)
    t = other.neg(other.upload(np.ones(4, np.float32)))  # recording touches no GPU memory: allowed
    with pytest.raises(bg.DeviceError, match=LOST):
        other.execute()
    with pytest.raises(bg.NotExecutedError, match="never executed"):
        other.read(t)  # the failed execute left nothing to read
    with pytest.raises(bg.NotExecutedError, match="last execute\\(\\) of batch 'victim' failed"):
        batch.read(y)
    with pytest.raises(bg.DeviceError, match=rf"Device.tensor: .*{LOST}"):
        dev.tensor(np.ones(4, np.float32))
    with pytest.raises(bg.DeviceError, match=rf"Device.read: .*{LOST}"):
        dev.read(w)
    check_new_device_works(rng)


def hold_readback_waits(dev: bg.Device) -> threading.Event:
    """Queue a job that blocks until the returned event is set on the executor's worker for asyncio reads
    (``executor.waits``, which runs its jobs in order): a read started now stays pending however fast the
    device is. Without it, a GPU that finishes a small batch within microseconds can have the read's map
    resolved and its result returned before the reading task first yields (the race seen on an H100
    under 16 pytest workers; lavapipe's matmuls take milliseconds, so it rarely shows there)."""
    gate = threading.Event()
    dev.executor.waits.submit(gate.wait)
    return gate


async def start_pending_read(dev: bg.Device, rng: np.random.Generator) -> asyncio.Future:
    """An executed batch of ``dev`` named 'pending' and an asyncio read of its result, started and waiting
    behind :func:`hold_readback_waits`' gate (the caller opens it)."""
    a = (random_array(rng, (256, 256), np.float32) / 256).astype(np.float32)
    batch = bg.GpuCommandBatch(dev, name="pending")
    t = ta = batch.upload(a)
    for _ in range(8):
        t = batch.matmul(t, ta)
    batch.execute()
    batch.read(t)
    await batch.execute_async()
    pending = asyncio.ensure_future(batch.read_async(t))
    await asyncio.sleep(0)  # the read has queued its wait behind the gate
    assert not pending.done()
    return pending


@pytest.mark.asyncio
async def test_destroy_while_an_async_read_is_pending() -> None:
    """Destroyed before the read's staging buffer is mapped: the map is never attempted on the destroyed
    device (mapping there aborts the process inside wgpu-native); the read fails naming the batch."""
    rng = np.random.default_rng(72)
    dev = bg.Device("wgpu")
    gate = hold_readback_waits(dev)
    pending = await start_pending_read(dev, rng)
    dev.executor.device.destroy()
    gate.set()
    with pytest.raises(bg.DeviceError, match=rf"read .*of batch 'pending'.*{LOST}"):
        await asyncio.wait_for(pending, 60)
    check_new_device_works(rng)


@pytest.mark.asyncio
async def test_destroy_after_an_async_reads_map_resolved() -> None:
    """The map resolved before the destroy and the read resumes after it: reading the mapped range would
    abort the process inside wgpu-native, so the executor checks the device first."""
    rng = np.random.default_rng(74)
    dev = bg.Device("wgpu")
    gate = hold_readback_waits(dev)
    pending = await start_pending_read(dev, rng)
    gate.set()
    dev.executor.waits.submit(lambda: None).result(timeout=60)  # the read's map, queued before it, is done
    assert not pending.done()  # and the event loop has not resumed the read yet
    dev.executor.device.destroy()
    with pytest.raises(bg.DeviceError, match=rf"read .*of batch 'pending'.*{LOST}"):
        await asyncio.wait_for(pending, 60)
    check_new_device_works(rng)


def test_destroy_before_the_first_execute() -> None:
    rng = np.random.default_rng(73)
    dev = bg.Device("wgpu")
    batch, y, _ = small_batch(dev, rng)
    dev.executor.device.destroy()
    with pytest.raises(bg.DeviceError, match=rf"execute: .*{LOST}"):
        batch.execute()
    with pytest.raises(bg.NotExecutedError):
        batch.read(y)
    check_new_device_works(rng)


ADD_ONE = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@compute @workgroup_size(1)
fn main(@builtin(global_invocation_id) id: vec3<u32>) { if id.x < arrayLength(&x) { x[id.x] = x[id.x] + 1.0; } }
"""


@pytest.mark.parametrize("encode", ["direct", "plain"])
def test_gpu_validation_error_in_submit_names_the_op(monkeypatch: pytest.MonkeyPatch, encode: str) -> None:
    """Fault injection: the device's Limits are swapped for a copy claiming more workgroups per
    dimension than the adapter has, so record-time checks pass a dispatch that wgpu's own validation
    rejects when the command encoder is finished. wgpu-py 0.32 raises that (GPUValidationError at
    ``finish()``); batchgpu turns it into a DeviceError naming the op. (Validation errors in
    ``queue.submit`` itself, e.g. a destroyed buffer, abort the process in wgpu-native 0.32;
    batchgpu never destroys a buffer a plan uses.)"""
    rng = np.random.default_rng(74)
    monkeypatch.setenv("BATCHGPU_WGPU_ENCODE", encode)  # both encode paths (batchgpu/executors/wgpu_encode.py)
    dev = bg.Device("wgpu")
    assert (dev.executor.direct is not None) == (encode == "direct")
    real = dev.executor.limits
    too_many = real.max_compute_workgroups_per_dimension + 1
    kernel = bg.Kernel(wgsl=ADD_ONE, entry="main", name="add_one")
    batch = bg.GpuCommandBatch(dev, name="invalid")
    xa = random_array(rng, (16,), np.float32)
    x = batch.upload(xa)
    y = batch.neg(x)
    dev.executor.limits = dataclasses.replace(real, max_compute_workgroups_per_dimension=too_many * 2)
    try:
        batch.launch(kernel, (too_many, 1, 1), buffers=[x])
    finally:
        dev.executor.limits = real
    submits = dev.stats.submits
    named = rf"execute: op 'launch add_one' .*dispatch {too_many}x1x1 failed GPU validation"
    with pytest.raises(bg.DeviceError, match=named):
        batch.execute()
    assert dev.stats.submits == submits
    with pytest.raises(bg.NotExecutedError, match="never executed"):
        batch.read(y)
    # the device is fine: a correct batch runs on it, and a new device too
    good, out, expected = small_batch(dev, rng)
    good.execute()
    assert_close(good.read(out), expected)
    check_new_device_works(rng)
