"""Host overhead over op counts, for ``batchgpu bench`` (shipped in the wheel).

A chain of ``n`` elementwise ops alternating ``y = y + a`` / ``y = y * m`` on a small float32 tensor,
each op one tiny dispatch, so what is measured is the cost of getting work to the GPU: (a) one batch of
all ops, (b) one submit per op, (c) naive raw wgpu-py (compile, allocate, submit and map per op).
``benchmarks/batch_overhead.py`` in a source checkout imports these workloads and adds the raw wgpu-py
floor, the re-record figures and its targets.

Each ``setup_*`` builds its workload once, checks the result against numpy, warms up, and returns a
:class:`Bench`: figures measured once, and ``one_round()`` which times every figure of the bench once.
The callers run the rounds of all benches interleaved, so a load change on the machine hits all of them
alike.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import coldstart
from .errors import UnsupportedError

if TYPE_CHECKING:
    from .batch import GpuCommandBatch
    from .device import Device
    from .tensor import Tensor

ADD_VALUE = 0.01
MUL_VALUE = 0.99

RAW_WGSL = """
struct Params { n: u32, pad0: u32, pad1: u32, pad2: u32 }

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i >= p.n { return; }
    out[i] = a[i] OP b[i];
}
"""


class WrongResultError(RuntimeError):
    """A workload computed the wrong thing; nothing of it is timed."""


@dataclass
class Bench:
    """One workload, built and warmed up: ``one_round()`` times each of its figures once; ``once`` holds
    the figures timed a single time during the setup (first record, first execute, ...)."""

    one_round: Callable[[], dict[str, float]]
    close: Callable[[], None] = lambda: None
    once: dict[str, float] = field(default_factory=dict)


def is_add(index: int) -> bool:
    return index % 2 == 0


def numpy_chain(x0: np.ndarray, ops: int, start: int = 0) -> np.ndarray:
    """The chain computed on the host in float32, op ``start`` to ``ops - 1``."""
    y = x0.copy()
    add, mul = np.float32(ADD_VALUE), np.float32(MUL_VALUE)
    for i in range(start, ops):
        y = y + add if is_add(i) else y * mul
    return y


def check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """Refuse to time a workload that computes the wrong thing."""
    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
        raise WrongResultError(f"{name}: wrong result, max abs error {np.abs(got - want).max():.3g}")


def timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def record_chain(dev: Device, x0: np.ndarray, ops: int) -> tuple[GpuCommandBatch, Tensor, float]:
    """A fresh batch holding the whole chain, unfused (one dispatch per op: the overhead measured); returns
    it, the last tensor and the host time of the op calls."""
    from .batch import GpuCommandBatch

    batch = GpuCommandBatch(dev, fusion=False)
    y = batch.upload(x0, name="x")
    a = batch.upload(np.full_like(x0, ADD_VALUE), name="a")
    m = batch.upload(np.full_like(x0, MUL_VALUE), name="m")
    started = time.perf_counter()
    for i in range(ops):
        y = batch.add(y, a) if is_add(i) else batch.mul(y, m)
    return batch, y, time.perf_counter() - started


def setup_library_batch(dev: Device, x0: np.ndarray, ops: int) -> Bench:
    """(a) one batch holding the whole chain. Each round: ``execute_read_s`` (execute + read the last
    tensor) and ``execute_s`` (execute alone: host encode + submit; the GPU is drained outside the timed
    region). Once: ``first_record_s`` (the op calls) and ``first_execute_s`` (plan and pipeline compiles)."""
    batch, last, first_record = record_chain(dev, x0, ops)  # built-in ops compile nothing at record
    first_execute = timed(batch.execute)  # plans: buffers, bind groups, the two pipeline compiles
    check("(a)", batch.read(last), numpy_chain(x0, ops))
    batch.execute()  # warm-up
    batch.read(last)

    def one_round() -> dict[str, float]:
        execute_read = timed(lambda: (batch.execute(), batch.read(last)))
        execute = timed(batch.execute)
        batch.read(last)  # drain the GPU outside the timed region
        return {"execute_read_s": execute_read, "execute_s": execute}

    return Bench(one_round, batch.release, once={"first_record_s": first_record, "first_execute_s": first_execute})


def setup_library_per_op(dev: Device, x0: np.ndarray, ops: int) -> Bench:
    """(b) one one-op batch per op, each executed with its own submit. Batches cannot share tensors, so each
    op reads resident tensors (``Device.tensor``) instead of the previous op's output; the GPU work per op
    is the same. Each round: ``execute_read_s`` (execute all + read the last) and ``execute_s`` (execute
    all alone, host)."""
    from .batch import GpuCommandBatch

    x = dev.tensor(x0, name="x")
    a = dev.tensor(np.full_like(x0, ADD_VALUE), name="a")
    m = dev.tensor(np.full_like(x0, MUL_VALUE), name="m")
    batches: list[GpuCommandBatch] = []
    outputs: list[Tensor] = []
    for i in range(ops):
        batch = GpuCommandBatch(dev)
        outputs.append(batch.add(x, a) if is_add(i) else batch.mul(x, m))
        batches.append(batch)

    def execute_all() -> None:
        for batch in batches:
            batch.execute()

    execute_all()  # plan every batch once (warm-up)
    check("(b)", batches[-1].read(outputs[-1]), numpy_chain(x0, ops, start=ops - 1))

    def one_round() -> dict[str, float]:
        execute_read = timed(lambda: (execute_all(), batches[-1].read(outputs[-1])))
        execute = timed(execute_all)
        batches[-1].read(outputs[-1])  # drain the GPU outside the timed region
        return {"execute_read_s": execute_read, "execute_s": execute}

    def close() -> None:
        for batch in batches:
            batch.release()

    return Bench(one_round, close)


def setup_naive(device: Any, x0: np.ndarray, ops: int) -> Bench:
    """(c) naive raw wgpu-py on the raw ``device``: shader module and pipeline (no cache), buffers with the
    data, bind group, encode, submit and map the result back, per op; the host array feeds the next op.
    Each round: ``total_s``, the whole chain."""
    usage = coldstart.import_wgpu().BufferUsage
    n = x0.size
    params = np.array([n, 0, 0, 0], np.uint32)
    operands = {True: np.full_like(x0, ADD_VALUE), False: np.full_like(x0, MUL_VALUE)}

    def one_op(y: np.ndarray, index: int) -> np.ndarray:
        module = device.create_shader_module(code=RAW_WGSL.replace("OP", "+" if is_add(index) else "*"))
        pipeline = device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": "main"})
        buffers = [
            device.create_buffer_with_data(data=y, usage=usage.STORAGE),
            device.create_buffer_with_data(data=operands[is_add(index)], usage=usage.STORAGE),
            device.create_buffer(size=y.nbytes, usage=usage.STORAGE | usage.COPY_SRC),
            device.create_buffer_with_data(data=params, usage=usage.UNIFORM),
        ]
        staging = device.create_buffer(size=y.nbytes, usage=usage.MAP_READ | usage.COPY_DST)
        entries = [{"binding": i, "resource": {"buffer": buffer}} for i, buffer in enumerate(buffers)]
        bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(-(-n // 256))
        compute.end()
        encoder.copy_buffer_to_buffer(buffers[2], 0, staging, 0, y.nbytes)
        device.queue.submit([encoder.finish()])
        staging.map_sync("READ")
        result = np.frombuffer(staging.read_mapped(), np.float32).copy()
        staging.unmap()
        return result

    def run() -> np.ndarray:
        y = x0
        for i in range(ops):
            y = one_op(y, i)
        return y

    check("(c)", run(), numpy_chain(x0, ops))  # also the warm-up (first-use costs of wgpu-native and the driver)
    return Bench(lambda: {"total_s": timed(run)})


SWEEP_FIGURE = {"batched": "execute_read_s", "per_op_submit": "execute_read_s", "naive": "total_s"}


def sweep(
    dev: Device,
    op_counts: list[int],
    *,
    repeat: int = 5,
    size: int = 256,
    naive_ops: int = 50,
    progress: Callable[..., Any] | None = None,
) -> list[dict[str, float]]:
    """Milliseconds per batch of ``n`` chained ops for each ``n`` in ``op_counts``: (a) one batch,
    execute + read; (b) one submit per op, execute all + read the last; (c) naive raw wgpu-py (run for
    at most ``naive_ops`` ops and scaled to ``n``). Medians of ``repeat`` interleaved rounds, after each
    setup's warm-up; ``load_average`` is the machine's 1-minute load average after the row's rounds."""
    raw_device = getattr(dev.executor, "device", None)  # the wgpu-py device under a wgpu executor
    if dev.kind != "wgpu" or raw_device is None:
        raise UnsupportedError(
            f"the overhead sweep compares with raw wgpu-py: it needs a wgpu device, not {dev.kind!r}"
        )
    x0 = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    rows = []
    for ops in progress(op_counts, "op counts") if progress else op_counts:
        naive = min(naive_ops, ops)
        benches = {
            "batched": setup_library_batch(dev, x0, ops),
            "per_op_submit": setup_library_per_op(dev, x0, ops),
            "naive": setup_naive(raw_device, x0, naive),
        }
        samples: dict[str, list[float]] = {name: [] for name in benches}
        for _ in range(max(1, repeat)):  # interleaved: a load change on the machine hits every figure alike
            for name, bench in benches.items():
                samples[name].append(bench.one_round()[SWEEP_FIGURE[name]])
        for bench in benches.values():
            bench.close()
        rows.append(
            {
                "ops": ops,
                "batched_ms": 1e3 * statistics.median(samples["batched"]),
                "per_op_submit_ms": 1e3 * statistics.median(samples["per_op_submit"]),
                "naive_ms": 1e3 * statistics.median(samples["naive"]) * ops / naive,
                "naive_ops_run": naive,
                "load_average": load_average(),
            }
        )
    return rows
