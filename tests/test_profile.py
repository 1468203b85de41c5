"""Profiling: ``execute(profile=True)``, the ``profile()`` table and the Chrome trace file, on the real
wgpu device (GPU timestamps inside the one compute pass) and on the numpy reference (host time). Batches
whose rows are checked against the recorded ops run unfused (``fusion=False``); tests/test_fusion.py
checks the rows of fused kernels."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.executors.wgpu_timing import MAX_QUERIES

from .conftest import random_array


def record_mixed(batch: bg.GpuCommandBatch, rng: np.random.Generator):
    """matmul, elementwise, softmax and a two-launch reduction (permute + reduce) on inputs."""
    x = batch.upload(random_array(rng, (6, 40), np.float32))
    w = batch.upload(random_array(rng, (40, 24), np.float32))
    h = batch.gelu(batch.matmul(x, w))
    s = batch.softmax(batch.add(h, 1.0))
    cube = batch.reshape(s, (2, 3, 24))
    return x, w, batch.sum(cube, axis=(0, 2))


def expected_rows(batch: bg.GpuCommandBatch) -> list[tuple[int, str]]:
    return [(i, node.spec.name) for i, node in enumerate(batch.nodes) for _ in node.launches]


def test_profile_table_one_row_per_dispatch_with_gpu_times(gpu):
    rng = np.random.default_rng(50)
    batch = bg.GpuCommandBatch(gpu, fusion=False)
    _, _, out = record_mixed(batch, rng)
    batch.execute()
    plain = batch.read(out)
    submits = gpu.stats.submits
    batch.execute(profile=True)
    assert gpu.stats.submits == submits + 1  # the timestamps ride in the execute's one submit
    np.testing.assert_array_equal(batch.read(out), plain)  # profiling changes no result
    assert gpu.stats.submits == submits + 1

    profile = batch.profile()
    rows = profile.rows
    assert [(r.index, r.op) for r in rows] == expected_rows(batch)
    assert [r.op for r in rows].count("sum") == 2  # the reduction's two launches, both mapped to the op
    assert profile.gpu_timing and not profile.message
    assert all(r.gpu_us is not None and r.gpu_us > 0 for r in rows)
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert profile.total_gpu_us == pytest.approx(sum(r.gpu_us for r in rows))
    matmul = rows[0]
    assert matmul.kernel.startswith("matmul.") and matmul.shape == "6x40, 40x24 -> 6x24"
    assert all(d >= 1 for d in matmul.dispatch)
    text = str(profile)
    for column in ("op", "kernel", "shape", "dispatch", "GPU us", "share"):
        assert column in text.splitlines()[1]
    assert len([line for line in text.splitlines() if line.startswith("| ") and matmul.kernel in line]) == 1
    host = profile.host_summary()
    assert set(host) == {"record", "upload", "encode", "submit", "execute"}  # no "plan": the first execute planned


def test_gpu_times_are_nanosecond_plausible(gpu):
    """The GPU total cannot exceed the wall time from execute to the read returning."""
    rng = np.random.default_rng(51)
    batch = bg.GpuCommandBatch(gpu)
    _, _, out = record_mixed(batch, rng)
    batch.execute()
    batch.read(out)
    started = time.perf_counter()
    batch.execute(profile=True)
    batch.read(out)
    wall_us = (time.perf_counter() - started) * 1e6
    total = batch.profile().total_gpu_us
    assert 0 < total <= wall_us


def test_profile_needs_a_profiled_execute_and_survives_later_executes(gpu):
    rng = np.random.default_rng(52)
    batch = bg.GpuCommandBatch(gpu)
    x, _, out = record_mixed(batch, rng)
    with pytest.raises(bg.NotExecutedError, match="profile=True"):
        batch.profile()
    batch.execute()
    with pytest.raises(bg.NotExecutedError):
        batch.profile()
    batch.execute(profile=True)
    batch.execute({x: random_array(rng, (6, 40), np.float32)})  # supersedes the profiled execute unread
    profile = batch.profile()
    assert profile.gpu_timing and all(r.gpu_us > 0 for r in profile.rows)
    batch.read(out)


def test_profile_of_a_fresh_batch_includes_planning(gpu):
    rng = np.random.default_rng(53)
    batch = bg.GpuCommandBatch(gpu)
    record_mixed(batch, rng)
    batch.execute(profile=True)
    profile = batch.profile()
    assert [name for name, *_ in profile.host_spans] == ["plan", "upload", "encode", "submit"]
    assert len(profile.record_spans) == len(batch.nodes)


def test_reference_executor_profiles_host_time_per_op(ref):
    rng = np.random.default_rng(54)
    batch = bg.GpuCommandBatch(ref)
    _, _, out = record_mixed(batch, rng)
    batch.execute(profile=True)
    batch.read(out)
    profile = batch.profile()
    assert "unavailable on the reference executor" in profile.message
    assert not profile.gpu_timing and profile.total_gpu_us is None
    assert all(r.gpu_us is None for r in profile.rows)
    first_rows = [r for i, r in enumerate(profile.rows) if i == 0 or profile.rows[i - 1].index != r.index]
    assert all(r.host_us is not None and r.host_us >= 0 for r in first_rows)
    text = profile.table()
    assert "host us" in text and "unavailable" in text


def test_timestamp_features_missing_fall_back_with_a_message():
    """On a device whose feature set lacks timestamps inside passes (or timestamps at all), the profile
    says so and still returns the rows: the whole pass's time, or host-side timing only."""
    dev = bg.Device("wgpu")
    full = dev.executor.features
    assert "timestamp-query" in full  # lavapipe has it; the fallbacks are exercised by hiding features
    rng = np.random.default_rng(55)
    batch = bg.GpuCommandBatch(dev, fusion=False)
    _, _, out = record_mixed(batch, rng)
    try:
        dev.executor.features = full - {"timestamp-query-inside-passes"}
        batch.execute(profile=True)
        batch.read(out)
        profile = batch.profile()
        assert "timestamp-query-inside-passes" in profile.message
        assert not profile.gpu_timing and profile.total_gpu_us > 0
        assert all(r.gpu_us is None for r in profile.rows)

        dev.executor.features = full - {"timestamp-query", "timestamp-query-inside-passes"}
        submits = dev.stats.submits
        batch.execute(profile=True)
        assert dev.stats.submits == submits + 1
        profile = batch.profile()
        assert "host-side timing only" in profile.message
        assert profile.total_gpu_us is None and len(profile.rows) == len(expected_rows(batch))
        assert "| -" in profile.table() or " - |" in profile.table()
    finally:
        dev.executor.features = full


def test_more_dispatches_than_one_query_set_holds(gpu):
    n = MAX_QUERIES // 2 + 30  # 2 timestamps per dispatch: needs a second query set
    batch = bg.GpuCommandBatch(gpu, fusion=False)
    t = batch.upload(np.zeros(8, np.float32))
    for _ in range(n):
        t = batch.add(t, 1.0)
    batch.execute(profile=True)
    np.testing.assert_array_equal(batch.read(t), np.full(8, n, np.float32))
    profile = batch.profile()
    assert len(profile.rows) == n and all(r.gpu_us is not None for r in profile.rows)
    assert profile.gpu_spans[-1][1] >= profile.gpu_spans[0][2]  # the last dispatch ran after the first


def _events(trace: dict, tid: int, ph: str = "X") -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph and e["tid"] == tid]


def _inside(child: dict, parent: dict) -> bool:
    return parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3


def test_trace_file_orders_and_nests_host_and_gpu_events(gpu, tmp_path):
    rng = np.random.default_rng(56)
    batch = bg.GpuCommandBatch(gpu, fusion=False)
    _, _, out = record_mixed(batch, rng)
    batch.execute(profile=True)
    path = batch.save_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    batch.read(out)

    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[1].startswith("host") and names[2] == "GPU ops"
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0 and event["pid"] == 1

    host = _events(trace, 1)
    assert [e["ts"] for e in host] == sorted(e["ts"] for e in host)
    record = next(e for e in host if e["name"] == "record" and e["cat"] == "record" and "ops" in e["args"])
    per_op = [e for e in host if e["cat"] == "record" and e is not record]
    assert [e["name"] for e in per_op] == [node.spec.name for node in batch.nodes]
    assert all(_inside(e, record) for e in per_op)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in itertools.pairwise(per_op))  # one after another
    execute = next(e for e in host if e["name"] == "execute")
    phases = [e for e in host if e["cat"] == "execute" and e is not execute]
    assert [e["name"] for e in phases] == ["plan", "upload", "encode", "submit"]
    assert all(_inside(e, execute) for e in phases)
    assert record["ts"] + record["dur"] <= execute["ts"] + 1e-3  # recorded before executing

    device = _events(trace, 2)
    compute_pass = device[0]
    dispatches = device[1:]
    assert compute_pass["name"] == "compute pass" and compute_pass["args"]["dispatches"] == len(dispatches)
    assert [(e["args"]["index"], e["name"]) for e in dispatches] == expected_rows(batch)
    assert all(_inside(e, compute_pass) for e in dispatches)
    assert all(a["ts"] <= b["ts"] for a, b in itertools.pairwise(dispatches))
    submit = next(e for e in phases if e["name"] == "submit")
    assert compute_pass["ts"] >= submit["ts"] + submit["dur"] - 1e-3  # the GPU track starts after submit
    rows = batch.profile().rows
    assert [e["args"]["gpu_us"] for e in dispatches] == [r.gpu_us for r in rows]


def test_trace_of_the_reference_executor_has_an_ops_track(ref, tmp_path):
    rng = np.random.default_rng(57)
    batch = bg.GpuCommandBatch(ref, fusion=False)
    record_mixed(batch, rng)
    batch.execute(profile=True)
    trace = json.loads(batch.save_trace(tmp_path / "ref.json").read_text())
    ops = _events(trace, 2)
    assert [e["name"] for e in ops] == [node.spec.name for node in batch.nodes if node.launches]
    run = next(e for e in _events(trace, 1) if e["name"] == "run ops")
    assert all(_inside(e, run) for e in ops)


@pytest.mark.asyncio
async def test_profile_after_an_async_read(gpu):
    import asyncio

    rng = np.random.default_rng(58)
    batch = bg.GpuCommandBatch(gpu, fusion=False)
    _, _, out = record_mixed(batch, rng)
    batch.execute(profile=True)
    reading = asyncio.ensure_future(batch.read_async(out))
    await asyncio.sleep(0)  # the read is mapping the staging buffer now
    batch.profile()  # does not break the read in flight (its GPU times may not be readable yet)
    await reading
    profile = batch.profile()
    assert profile.gpu_timing and all(r.gpu_us > 0 for r in profile.rows)


def test_an_executor_without_profiling_support_runs_unprofiled():
    """Executors written before profiling existed (no ``profile`` keyword in ``run``) still execute."""
    from batchgpu.executors.reference import ReferenceExecutor

    class NoProfiling(ReferenceExecutor):
        def run(self, plan, writes, readback, scalars):
            return super().run(plan, writes, readback, scalars)

    dev = bg.Device("reference")
    dev.executor = NoProfiling()
    rng = np.random.default_rng(59)
    batch = bg.GpuCommandBatch(dev)
    _, _, out = record_mixed(batch, rng)
    batch.execute(profile=True)
    assert batch.read(out).shape == (3,)
    profile = batch.profile()
    assert "does not support profiling" in profile.message
    assert all(r.gpu_us is None and r.host_us is None for r in profile.rows)
    assert profile.execute_span[1] >= profile.execute_span[0]
