"""The skeleton the device executors share (batchgpu/executors/base.py) and the wgpu planning rules
(batchgpu/executors/wgpu_plan.py), checked on their own and on the real wgpu device."""

from __future__ import annotations

import asyncio
import struct

import numpy as np

import batchgpu as bg
from batchgpu.executors.base import (
    POISON_BYTE,
    Executor,
    ReadbackLayout,
    StagingPool,
    Stats,
    padded,
    plan_buffers,
)
from batchgpu.executors.wgpu_plan import bind_entries, params_layout, pipeline_spec, plan_launches
from batchgpu.kernels import Binding, Kernel, Launch
from batchgpu.scalars import SCALAR_BYTES
from batchgpu.tensor import Storage

from .conftest import random_array


class HostPool(StagingPool[bytearray]):
    """Host byte arrays, with a set of buffers the "device" is still writing (not ready)."""

    def __init__(self, stats: Stats, limit: int) -> None:
        super().__init__(stats, limit, max_idle_per_size=2)
        self.busy: set[int] = set()
        self.discarded: list[bytearray] = []

    def create(self, size: int) -> bytearray:
        return bytearray(size)

    def size(self, buffer: bytearray) -> int:
        return len(buffer)

    def ready(self, buffer: bytearray) -> bool:
        return id(buffer) not in self.busy

    def discard(self, buffer: bytearray) -> None:
        self.discarded.append(buffer)


def test_staging_pool_buckets_reuse_and_counts():
    stats = Stats()
    pool = HostPool(stats, limit=4096)
    assert [pool.bucket(n) for n in (0, 1, 256, 257, 3000, 4096, 4097, 5001)] == [
        256, 256, 256, 512, 4096, 4096, 4100, 5004,
    ]  # fmt: skip
    a, b = pool.acquire(300), pool.acquire(300)
    assert len(a) == 512 and stats.buffers_created == 2
    pool.release(a)
    pool.release(b)
    assert stats.staging_idle == 2
    pool.busy.add(id(a))  # the device still writes into a: b is handed out instead
    assert pool.acquire(400) is b and stats.staging_idle == 1 and stats.buffers_created == 2
    pool.busy.clear()
    assert pool.acquire(512) is a and stats.staging_idle == 0
    for buffer in [pool.acquire(500) for _ in range(3)]:
        pool.release(buffer)
    assert stats.staging_idle == 2 and len(pool.discarded) == 1  # at most two idle per size


def test_plan_buffers_poison_alias_and_resident():
    out, scratch, inp, shared, weight = (
        Storage(8, "output", np.dtype(np.float32)),
        Storage(6, "scratch", np.dtype(np.float16)),
        Storage(4, "input", np.dtype(np.int32)),
        Storage(8, "output", np.dtype(np.float32)),
        Storage(12, "resident", np.dtype(np.float32)),
    )
    resident = {weight: np.zeros(12, np.uint8)}
    launch = Launch("op", "main", 1, (Binding(0, "read", weight), Binding(1, "write", shared)))
    buffers = plan_buffers(
        [out, scratch, inp],
        [launch],
        {shared: out},
        allocate=lambda s: np.zeros(padded(s.nbytes), np.uint8),
        resident=resident.__getitem__,
        poison=lambda a: a.fill(POISON_BYTE),
    )
    assert buffers[shared] is buffers[out] and buffers[weight] is resident[weight]
    assert (
        (buffers[out] == POISON_BYTE).all() and (buffers[scratch] == POISON_BYTE).all() and len(buffers[scratch]) == 8
    )
    assert (buffers[inp] == 0).all()
    unpoisoned = plan_buffers([out], [], None, allocate=lambda s: np.zeros(s.nbytes, np.uint8), resident=dict)
    assert (unpoisoned[out] == 0).all()
    assert Executor.poison is False  # declared on the protocol; Device(poison=True) sets it on device executors


def test_readback_layout_single_and_nbytes():
    storage = Storage(6, "output", np.dtype(np.float16))
    single = ReadbackLayout.single(storage, "buffer")
    assert single.copies == [(storage, "buffer", 0, 8)] and single.total == 8
    other = Storage(4, "output", np.dtype(np.int32))
    layout = ReadbackLayout.build([storage, other], {storage: 1, other: 2}, align=256)
    assert layout.total == 512 and layout.nbytes == 12  # the bytes copied, without the alignment gaps


def _custom(params: bytes, uniform: bool) -> Launch:
    storage = Storage(40, "output", np.dtype(np.float32))
    bindings = (Binding(0, "write", storage), *((Binding(1, "uniform"),) if uniform else ()))
    kernel = Kernel("@compute @workgroup_size(1) fn main() {}", name="k")
    return Launch("custom", "main", 3, bindings, params=params, kernel=kernel)


def test_params_layout_aligns_each_launch_with_parameters():
    with_params = [_custom(b"\1" * 20, True), _custom(b"", False), _custom(b"\2" * 4, True), _custom(b"\3" * 40, True)]
    offsets, data = params_layout(with_params, 32)
    assert offsets == [0, 32, 32, 64] and len(data) == 128  # the launch without parameters takes no slot
    assert data[0:20] == b"\1" * 20 and data[32:36] == b"\2" * 4 and data[64:104] == b"\3" * 40
    offsets, data = params_layout(with_params, 256)  # an export's alignment, valid on every browser
    assert offsets == [0, 256, 256, 512] and len(data) == 768
    assert params_layout([_custom(b"", False)], 32) == ([0], b"")


def test_bind_entries_and_pipeline_spec():
    launch = _custom(b"\0" * 16, True)
    scalars = Launch(
        "s", "main", 1, (Binding(0, "scalars"), Binding(1, "read", Storage(7, "input", np.dtype(np.int8))))
    )
    entries = bind_entries(launch, 64)
    assert [(e.slot, e.kind, e.offset, e.size) for e in entries] == [(0, "storage", 0, 40), (1, "params", 64, 16)]
    assert entries[0].storage is launch.bindings[0].storage
    assert [(e.kind, e.size) for e in bind_entries(scalars, 0)] == [("scalars", SCALAR_BYTES), ("storage", 8)]
    spec = pipeline_spec(launch)
    assert spec.layout == (1, True) and spec.shader_name == "kernel k" and spec.label == "custom:main"
    assert spec.key == (launch.kernel.wgsl, "main", (), (1, True)) and spec.source == launch.kernel.wgsl


def test_wgpu_plan_follows_the_planning_rules(gpu):
    """The executor's params buffer, pipelines and dispatches are plan_launches' for the same launches."""
    x = random_array(np.random.default_rng(90), (300,), np.float32)
    batch = bg.GpuCommandBatch(gpu, fusion=False)  # the plan runs the recorded launches
    tx = batch.upload(x)
    y = batch.softmax(batch.add(batch.mul(tx, 2.0), 1.0))
    batch.execute()
    np.testing.assert_allclose(
        batch.read(y), np.exp(2 * x - (2 * x).max()) / np.exp(2 * x - (2 * x).max()).sum(), rtol=1e-5
    )
    plan = batch.view().plan
    launches = [gpu.executor.form(launch) for node in batch.view().nodes for launch in node.launches]
    layout = plan_launches(launches, gpu.limits.min_uniform_buffer_offset_alignment)
    assert plan.params_buffer.size == len(layout.params)
    assert len(plan.dispatches) == len(layout.launches)
    for (pipeline, *_), planned in zip(plan.dispatches, layout.launches):
        assert gpu.executor.pipelines.get(planned.launch) is pipeline


def test_unwritten_output_of_a_poisoned_device_reads_the_poison_byte(gpu):
    """Device(poison=True) fills new output buffers with POISON_BYTE (gpu is poisoned): a kernel that
    writes nothing leaves it there, through the shared read path (an extra copy-only execution)."""
    batch = bg.GpuCommandBatch(gpu)
    state = batch.empty((5,), np.int32)
    kernel = Kernel(
        "@group(0) @binding(0) var<storage, read_write> x: array<i32>;\n@compute @workgroup_size(1) fn main() {}"
    )
    batch.launch(kernel, 1, buffers=[state])
    batch.execute()
    want = struct.unpack("<i", bytes([POISON_BYTE]) * 4)[0]
    assert (batch.read(state) == want).all()
    assert (asyncio.run(batch.read_async(state)) == want).all()
