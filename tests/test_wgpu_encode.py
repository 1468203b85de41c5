"""The wgpu executor's two encode paths (batchgpu/executors/wgpu_encode.py) on the real device: the direct
path through wgpu-native's C functions gives the same results and the same errors as wgpu-py's methods."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.executors.wgpu_encode import ENV, DirectEncoder, direct_encoder, encode_plain

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def wgpu_device(monkeypatch: pytest.MonkeyPatch, path: str) -> bg.Device:
    monkeypatch.setenv(ENV, path)
    device = bg.Device("wgpu")
    assert (device.executor.direct is not None) == (path == "direct")
    return device


def mixed_batch(device: bg.Device, rng: np.random.Generator) -> tuple[bg.GpuCommandBatch, list[bg.Tensor]]:
    """Ops of several kernels, repeated pipelines side by side (the direct path skips repeated
    ``set_pipeline`` calls), split-K and multi-launch ops included; unfused: a dispatch per recorded launch."""
    batch = bg.GpuCommandBatch(device, fusion=False)
    a = batch.upload(rng.standard_normal((37, 131)).astype(np.float32))
    b = batch.upload(rng.standard_normal((131, 29)).astype(np.float32))
    h = batch.matmul(a, b)
    h = batch.add(h, h)
    h = batch.add(h, batch.relu(h))
    soft = batch.softmax(h)
    norm = batch.rms_norm(h, batch.upload(rng.standard_normal(29).astype(np.float32)), 1e-5)
    ids = batch.argmax(batch.mul(soft, norm))
    return batch, [soft, norm, ids]


def test_direct_and_plain_paths_give_identical_results(monkeypatch):
    outputs = {}
    for path in ("plain", "direct"):
        device = wgpu_device(monkeypatch, path)
        batch, tensors = mixed_batch(device, np.random.default_rng(3))
        for _ in range(3):  # re-executes reuse the plan's handles
            batch.execute()
        outputs[path] = [batch.read(t) for t in tensors]
        assert device.stats.dispatches > 0
    for plain, direct in zip(outputs["plain"], outputs["direct"]):
        np.testing.assert_array_equal(plain, direct)
        assert plain.dtype == direct.dtype


def test_profiled_execute_still_times_each_dispatch(monkeypatch):
    device = wgpu_device(monkeypatch, "direct")
    batch, _ = mixed_batch(device, np.random.default_rng(4))
    batch.execute(profile=True)
    assert batch.profile().gpu_timing and len(batch.profile().rows) >= len(batch.view().nodes)


ADD_ONE = """
@group(0) @binding(0) var<storage, read_write> data: array<f32>;
@compute @workgroup_size(1) fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < arrayLength(&data) { data[id.x] += 1.0; }
}
"""


def pipelines_and_group(device: bg.Device, count: int) -> tuple[list, object]:
    """``count`` distinct compute pipelines of one kernel and a bind group of a 4-float buffer, made with
    wgpu-py on the executor's device."""
    gpu = device.executor.device
    wgpu = device.executor.wgpu
    module = gpu.create_shader_module(code=ADD_ONE)
    layout = gpu.create_bind_group_layout(
        entries=[{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": "storage"}}]
    )
    pipeline_layout = gpu.create_pipeline_layout(bind_group_layouts=[layout])
    pipelines = [
        gpu.create_compute_pipeline(layout=pipeline_layout, compute={"module": module, "entry_point": "main"})
        for _ in range(count)
    ]
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    buffer = gpu.create_buffer_with_data(data=np.zeros(4, np.float32).tobytes(), usage=usage)
    group = gpu.create_bind_group(layout=layout, entries=[{"binding": 0, "resource": {"buffer": buffer}}])
    return pipelines, (group, buffer)


def test_handles_skip_repeated_pipelines(monkeypatch):
    device = wgpu_device(monkeypatch, "direct")
    (p, q), (group, _) = pipelines_and_group(device, 2)
    dispatches = [(p, group, 1, 1, 1), (p, group, 2, 1, 1), (q, group, 3, 1, 1), (p, group, 4, 5, 6)]
    calls = DirectEncoder.handles(dispatches)
    assert [c[0] is None for c in calls] == [False, True, False, False]
    assert [c[2:] for c in calls] == [(1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 5, 6)]


def encode_error(device: bg.Device, use_direct: bool, grids: list[tuple[int, int, int]]) -> tuple[str, np.ndarray]:
    """Encode dispatches of the add-one kernel over 4 floats with ``grids`` through one path, finish and
    submit; the error wgpu raises ("" when none) and the buffer's contents."""
    executor = device.executor
    (pipeline,), (group, buffer) = pipelines_and_group(device, 1)
    dispatches = [(pipeline, group, *grid) for grid in grids]
    encoder = executor.device.create_command_encoder()
    compute = encoder.begin_compute_pass()
    if use_direct:
        direct = direct_encoder(executor.device)
        assert direct is not None
        direct.encode(compute, DirectEncoder.handles(dispatches))
    else:
        encode_plain(compute, dispatches)
    try:
        compute.end()
        executor.device.queue.submit([encoder.finish()])
    except executor.wgpu.GPUError as exc:
        return str(exc), np.zeros(0)
    return "", np.frombuffer(executor.device.queue.read_buffer(buffer), np.float32)


def test_direct_and_plain_paths_encode_the_same_commands_and_errors(monkeypatch, caplog):
    device = wgpu_device(monkeypatch, "plain")
    monkeypatch.setenv(ENV, "direct")  # for direct_encoder below
    too_many = device.limits.max_compute_workgroups_per_dimension + 1
    with caplog.at_level(logging.ERROR):
        plain = encode_error(device, False, [(1, 1, 1), (too_many, 1, 1)])
        direct = encode_error(device, True, [(1, 1, 1), (too_many, 1, 1)])
        runs = [encode_error(device, use_direct, [(1, 1, 1), (3, 1, 1), (2, 1, 1)]) for use_direct in (False, True)]
    assert plain[0] and direct[0] == plain[0], (plain, direct)
    for error, data in runs:
        assert error == ""
        np.testing.assert_array_equal(data, [3.0, 2.0, 1.0, 0.0])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "an error went to the log, not raised"
