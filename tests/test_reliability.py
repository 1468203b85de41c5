"""Correct or refused (issue 13): the cases where batchgpu used to hand back a wrong array without an error,
or to raise a bare Python error, each as one row of a table run on the wgpu and reference executors.

``SILENT``: each row computes something that used to come back wrong and checks it against numpy.
``BAD_INPUTS``: each row makes one bad call of a public API; it must raise the documented ``BatchError``
subclass naming the op, the tensor and expected vs actual, with nothing recorded, compiled, allocated,
uploaded or submitted. After every row the same batch and device still run a correct op (``Probe``).
The per-invocation loop cap cases (long rows and inner dimensions) live beside their ops' tests:
``test_*_past_loop_cap`` and the ``small_bounds`` tests in test_ops.py and test_llm_ops.py.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array
from .test_errors import Probe, fails, new_batch, rng  # noqa: F401 - rng is a fixture


@pytest.fixture(params=["gpu", "ref"])
def dev(request: pytest.FixtureRequest) -> bg.Device:
    return request.getfixturevalue(request.param)


# silent wrong results --------------------------------------------------------------------------

ACCUMULATE = bg.Kernel(
    wgsl="""
@group(0) @binding(0) var<storage, read_write> total: array<f32>;
@group(0) @binding(1) var<storage, read_write> step: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x < arrayLength(&total) { total[id.x] = total[id.x] + step[id.x]; }
}
""",
    name="accumulate",
    reference=lambda total, step: np.add(total, step, out=total),
)


def kv_cache_in_empty_survives_recording(dev: bg.Device, gen: np.random.Generator) -> None:
    """A KV cache in ``batch.empty`` filled over executes keeps its rows when one more op is recorded."""
    batch = bg.GpuCommandBatch(dev)
    pos = batch.scalar("pos")
    cache = batch.empty((6, 2, 4), np.float32, name="cache")
    new = batch.upload(np.zeros((1, 2, 4), np.float32), name="new")
    batch.kv_write(cache, new, pos)
    rows = [random_array(gen, (1, 2, 4), np.float32) for _ in range(4)]
    for p, row in enumerate(rows[:3]):
        batch.execute({new: row}, scalars={"pos": p})
    doubled = batch.mul(cache, 2.0)  # recording re-plans the batch: new buffers
    batch.execute({new: rows[3]}, scalars={"pos": 3})
    assert_close(batch.read(doubled)[:4], 2 * np.concatenate(rows))


def state_survives_outputs_declaration(dev: bg.Device, gen: np.random.Generator) -> None:
    """``batch.outputs(...)`` after executes re-plans with shared buffers; the cache keeps its rows."""
    batch = bg.GpuCommandBatch(dev)
    pos = batch.scalar("pos")
    cache = batch.empty((5, 1, 3), np.float32)
    new = batch.upload(np.zeros((1, 1, 3), np.float32))
    batch.kv_write(cache, new, pos)
    total = batch.sum(batch.add(cache, 1.0), axis=0)
    rows = [random_array(gen, (1, 1, 3), np.float32) for _ in range(5)]
    for p, row in enumerate(rows[:4]):
        batch.execute({new: row}, scalars={"pos": p})
    batch.outputs(total)
    batch.execute({new: rows[4]}, scalars={"pos": 4})
    assert_close(batch.read(total), np.concatenate(rows).sum(axis=0) + 5, scale=4)


def custom_kernel_input_survives_recording(dev: bg.Device, gen: np.random.Generator) -> None:
    """An input a custom kernel updates in place keeps its device value (not the uploaded one)."""
    batch = bg.GpuCommandBatch(dev)
    start, step = random_array(gen, (100,), np.float32), random_array(gen, (100,), np.float32)
    total = batch.upload(start, name="total")
    batch.launch(ACCUMULATE, 2, buffers=[total, batch.upload(step)])
    for _ in range(3):
        batch.execute()
    negated = batch.neg(total)
    batch.execute()
    assert_close(batch.read(negated), -(start + 4 * step), scale=4)
    assert_close(batch.read(total), start + 4 * step, scale=4)


def feeds_are_copied(dev: bg.Device, gen: np.random.Generator) -> None:
    """Editing a fed array after ``execute`` changes nothing a later re-plan uploads."""
    batch = bg.GpuCommandBatch(dev)
    x = batch.upload(np.zeros(7, np.float32))
    fed = random_array(gen, (7,), np.float32)
    kept = fed.copy()
    batch.execute({x: fed})
    fed[:] = 1e6
    y = batch.add(x, 1.0)
    batch.execute()
    assert_close(batch.read(y), kept + 1)


def feeds_and_scalars_as_pairs(dev: bg.Device, gen: np.random.Generator) -> None:
    batch = bg.GpuCommandBatch(dev)
    pos = batch.scalar("pos", "u32")
    x = batch.upload(np.zeros((1, 1, 2), np.float32))
    cache = batch.upload(np.zeros((4, 1, 2), np.float32))
    batch.kv_write(cache, x, pos)
    row = random_array(gen, (1, 1, 2), np.float32)
    batch.execute([(x, row)], scalars=[("pos", 2)])
    assert_close(batch.read(cache)[2], row[0])


def attention_scale_zero_is_zero(dev: bg.Device, gen: np.random.Generator) -> None:
    """``scale=0.0`` gives uniform weights: the mean of the visible value rows (was the default scale)."""
    batch = bg.GpuCommandBatch(dev)
    q = batch.upload(random_array(gen, (1, 2, 4), np.float32))
    k = batch.upload(random_array(gen, (5, 1, 4), np.float32))
    values = random_array(gen, (5, 1, 4), np.float32)
    out = batch.attention(q, k, batch.upload(values), 2, causal=True, scale=0.0)
    batch.execute()
    assert_close(batch.read(out), np.broadcast_to(values[:3].mean(axis=0), (1, 2, 4)).astype(np.float32))


def argmax_nan_first_wins(dev: bg.Device, gen: np.random.Generator) -> None:
    """numpy's argmax returns the first NaN of a row that has one."""
    data = random_array(gen, (4, 9), np.float32)
    data[0, 5] = data[0, 7] = np.nan
    data[2, 0] = np.nan
    data[3, 8] = np.nan
    batch = bg.GpuCommandBatch(dev)
    out = batch.argmax(batch.upload(data))
    batch.execute()
    np.testing.assert_array_equal(batch.read(out), np.argmax(data, axis=-1))


def quantized_weights_read_dequantized(dev: bg.Device, gen: np.random.Generator) -> None:
    quants = pytest.importorskip("gguf.quants")
    weights = random_array(gen, (3, 64), np.float32)
    blocks = quants.quantize(weights, quants.GGMLQuantizationType.Q8_0)
    w = dev.quantized(memoryview(blocks.tobytes()), "q8_0", (3, 64))  # bytes-like, as GGUF readers give
    expected = quants.dequantize(blocks, quants.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(dev.read(w), expected)
    batch = bg.GpuCommandBatch(dev)
    batch.matmul(batch.upload(random_array(gen, (1, 64), np.float32)), w, transpose_b=True)
    batch.execute()
    np.testing.assert_array_equal(batch.read(w), expected)


def resident_view_reads_through_the_batch(dev: bg.Device, gen: np.random.Generator) -> None:
    data = random_array(gen, (4, 6), np.float32)
    w = dev.tensor(data)
    batch = bg.GpuCommandBatch(dev)
    flat = batch.reshape(w, -1)
    x = batch.upload(random_array(gen, (24,), np.float32))
    y = x + flat  # a resident tensor takes part in operators with batch tensors
    z = w + batch.reshape(x, (4, 6))  # ... on either side
    batch.execute()
    np.testing.assert_array_equal(batch.read(flat), data.reshape(-1))
    assert_close(batch.read(y), batch.read(x) + data.reshape(-1))
    assert_close(batch.read(z), data + batch.read(x).reshape(4, 6))


def common_inputs_take_default_dtypes(dev: bg.Device, gen: np.random.Generator) -> None:
    """Python lists as numpy/torch users write them; big-endian arrays; short dtype names."""
    floats = dev.tensor([[1.0, 2.5]])
    ints = dev.tensor([3, -4])
    assert floats.dtype == np.float32 and ints.dtype == np.int32
    batch = bg.GpuCommandBatch(dev)
    swapped = random_array(gen, (5,), np.float32).astype(">f4")
    x = batch.upload(swapped)
    halves = batch.cast(x, "f16")
    counts = batch.upload(np.arange(5, dtype=">i4"), dtype="i32")
    slot = batch.empty(3, "u32")
    scale = batch.scalar("scale", np.float32, 2.0)
    assert (x.dtype, halves.dtype, counts.dtype, slot.dtype, scale.dtype) == (
        np.float32,
        np.float16,
        np.int32,
        np.uint32,
        "f32",
    )
    total = batch.add(batch.mul(x, floats[0:1, 1:2] if False else 2.5), 0.0)
    both = batch.add(batch.reshape(ints, (2,)), 1)
    batch.execute()
    assert_close(batch.read(total), swapped.astype(np.float32) * np.float32(2.5))
    np.testing.assert_array_equal(batch.read(counts), np.arange(5))
    np.testing.assert_array_equal(batch.read(both), [4, -3])
    np.testing.assert_array_equal(dev.read(floats), [[1.0, 2.5]])


def gelu_is_exact_by_default(dev: bg.Device, gen: np.random.Generator) -> None:
    """``gelu`` is torch's default, x * Phi(x) with erf; ``approximate="tanh"`` the approximation."""
    x = np.concatenate([np.linspace(-12, 12, 241), random_array(gen, (100,), np.float32)]).astype(np.float32)
    wide = x.astype(np.float64)
    exact = 0.5 * wide * np.array([math.erfc(-v / math.sqrt(2)) for v in wide])
    tanh = 0.5 * wide * (1 + np.tanh(math.sqrt(2 / math.pi) * (wide + 0.044715 * wide**3)))
    batch = bg.GpuCommandBatch(dev)
    t = batch.upload(x)
    out, approx = batch.gelu(t), batch.gelu(t, approximate="tanh")
    batch.execute()
    np.testing.assert_allclose(batch.read(out), exact, rtol=2e-6, atol=1e-37)
    np.testing.assert_allclose(batch.read(approx), tanh, rtol=2e-5, atol=2e-6)


SILENT: dict[str, Callable[[bg.Device, np.random.Generator], None]] = {
    fn.__name__: fn
    for fn in (
        kv_cache_in_empty_survives_recording,
        state_survives_outputs_declaration,
        custom_kernel_input_survives_recording,
        feeds_are_copied,
        feeds_and_scalars_as_pairs,
        attention_scale_zero_is_zero,
        argmax_nan_first_wins,
        quantized_weights_read_dequantized,
        resident_view_reads_through_the_batch,
        common_inputs_take_default_dtypes,
        gelu_is_exact_by_default,
    )
}


@pytest.mark.parametrize("case", sorted(SILENT))
def test_formerly_silent_wrong_results(dev: bg.Device, rng: np.random.Generator, case: str) -> None:  # noqa: F811
    _, probe = new_batch(dev, rng)
    SILENT[case](dev, rng)
    probe.check()


# bad inputs: every public call -----------------------------------------------------------------


@dataclass
class Ctx:
    """What the bad calls work on, made before the call (so the call itself may allocate nothing)."""

    dev: bg.Device
    b: bg.GpuCommandBatch
    p: Probe
    blocks: np.ndarray  # Q8_0 blocks of a (2, 32) matrix
    qw: bg.Tensor  # those blocks, resident
    lone: bg.Tensor  # a resident float32 vector that no batch uses
    point: bg.Tensor  # a 0-d batch input
    kcache: bg.Tensor  # a (4, 1, 8) cache
    q1: bg.Tensor  # (1, 1, 8)
    q2: bg.Tensor  # (2, 1, 8)

    @classmethod
    def make(cls, dev: bg.Device, batch: bg.GpuCommandBatch, probe: Probe) -> Ctx:
        quants = pytest.importorskip("gguf.quants")
        weights = np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32)
        blocks = quants.quantize(weights, quants.GGMLQuantizationType.Q8_0)
        return cls(
            dev,
            batch,
            probe,
            blocks,
            dev.quantized(blocks, "q8_0", (2, 32), name="qw"),
            dev.tensor(np.ones(3, np.float32), name="lone"),
            batch.upload(np.float32(2.5), name="point"),
            batch.upload(np.ones((4, 1, 8), np.float32), name="kcache"),
            batch.upload(np.ones((1, 1, 8), np.float32), name="q1"),
            batch.upload(np.ones((2, 1, 8), np.float32), name="q2"),
        )


# name: (call, error, message fragments)
BAD_INPUTS: dict[str, tuple[Callable[[Ctx], Any], type[bg.BatchError], tuple[str, ...]]] = {
    # Device
    "device unknown kind": (lambda c: bg.Device("tpu"), bg.BatchError, ("tpu", "wgpu")),
    "device.tensor float64": (lambda c: c.dev.tensor(np.ones(3)), bg.DTypeError, ("float64", "np.float32")),
    "device.tensor int64 says int32": (lambda c: c.dev.tensor(np.arange(3)), bg.DTypeError, ("int64", "np.int32")),
    "device.tensor python bools": (lambda c: c.dev.tensor([True, False]), bg.DTypeError, ("bool", "dtype")),
    "device.tensor ints out of int32": (lambda c: c.dev.tensor([2**40]), bg.DTypeError, ("int32", "uint32")),
    "device.tensor cast that wraps": (
        lambda c: c.dev.tensor(np.array([2**40]), dtype=np.int32),
        bg.DTypeError,
        ("int32", str(2**40)),
    ),
    "device.tensor nan to int": (
        lambda c: c.dev.tensor(np.array([1.0, np.nan], np.float32), dtype="i32"),
        bg.DTypeError,
        ("NaN", "int32"),
    ),
    "device.tensor string": (lambda c: c.dev.tensor("abc"), bg.DTypeError, ("str",)),
    "device.tensor of a batch tensor": (lambda c: c.dev.tensor(c.p.x), bg.ArgumentError, ("probe_x", "batch.read")),
    "device.write quantized": (
        lambda c: c.dev.write(c.qw, np.ones((2, 32), np.float32)),
        bg.UnsupportedError,
        ("qw", "Device.quantized"),
    ),
    "device.write batch tensor": (
        lambda c: c.dev.write(c.p.x, np.ones((5, 7), np.float32)),
        bg.BatchError,
        ("Device.write", "resident"),
    ),
    "device.read batch tensor": (lambda c: c.dev.read(c.p.x), bg.BatchError, ("Device.read", "resident")),
    "device.quantized float blocks": (
        lambda c: c.dev.quantized(np.ones(68, np.float32), "q8_0", (2, 32)),
        bg.DTypeError,
        ("float32", "block bytes"),
    ),
    "device.quantized 3-d shape": (
        lambda c: c.dev.quantized(c.blocks, "q8_0", (2, 32, 1)),
        bg.ShapeError,
        ("(rows, K)", "(2, 32, 1)"),
    ),
    "device.quantized float shape": (
        lambda c: c.dev.quantized(c.blocks, "q8_0", (2.0, 32)),
        bg.ShapeError,
        ("2.0", "ints"),
    ),
    "device.quantized byte count": (
        lambda c: c.dev.quantized(c.blocks.tobytes()[:-1], "q8_0", (2, 32)),
        bg.ShapeError,
        ("67 bytes", "68"),
    ),
    "device.quantized format": (
        lambda c: c.dev.quantized(c.blocks, "q3_k", (2, 32)),
        bg.DTypeError,
        ("q3_k", "q4_1"),
    ),
    # batch construction and inputs
    "batch on a string device": (lambda c: bg.GpuCommandBatch("wgpu"), bg.ArgumentError, ("Device", "str")),
    "upload float64": (lambda c: c.b.upload(np.ones(3), name="w64"), bg.DTypeError, ("w64", "float64")),
    "upload object": (lambda c: c.b.upload([1.0, None]), bg.DTypeError, ("object",)),
    "empty string shape": (lambda c: c.b.empty("abc"), bg.ShapeError, ("empty", "'abc'")),
    "empty float shape": (lambda c: c.b.empty((2.5, 3)), bg.ShapeError, ("empty", "2.5")),
    "empty bool shape": (lambda c: c.b.empty((True, 3)), bg.ShapeError, ("empty", "True")),
    "empty int8": (lambda c: c.b.empty(3, np.int8), bg.DTypeError, ("empty", "int8")),
    "scalar f16": (lambda c: c.b.scalar("half", "f16"), bg.DTypeError, ("half", "f16")),
    "scalar name": (lambda c: c.b.scalar(""), bg.ArgumentError, ("scalar", "name")),
    # operands
    "numpy array operand": (
        lambda c: np.ones((5, 7), np.float32) + c.p.x,
        bg.ArgumentError,
        ("add", "ndarray", "upload it"),
    ),
    "numpy array operand of a method": (
        lambda c: c.b.maximum(c.p.x, np.ones(7, np.float32)),
        bg.ArgumentError,
        ("maximum", "b", "ndarray", "(7,)"),
    ),
    "np.asarray of a tensor": (lambda c: np.asarray(c.p.x), bg.ArgumentError, ("probe_x", "batch.read")),
    "resident operator without a batch": (
        lambda c: c.lone * 2,
        bg.ArgumentError,
        ("mul", "lone", "resident"),
    ),
    "resident slice without a batch": (
        lambda c: c.lone[1:],
        bg.ArgumentError,
        ("lone", "resident"),
    ),
    "quantized weights in add": (
        lambda c: c.b.add(c.qw, 1.0),
        bg.DTypeError,
        ("add", "qw", "q8_0", "matmul"),
    ),
    "quantized weights as matmul a": (
        lambda c: c.b.matmul(c.qw, c.b.upload(np.ones((32, 2), np.float32))),
        bg.DTypeError,
        ("matmul", "qw", "input 0"),
    ),
    "quantized weights reshaped": (lambda c: c.b.reshape(c.qw, -1), bg.DTypeError, ("reshape", "qw")),
    "sum over an axis of a 0-d tensor": (lambda c: c.b.sum(c.point, axis=0), bg.ShapeError, ("sum", "axis 0")),
    "softmax of a 0-d tensor": (lambda c: c.b.softmax(c.point), bg.ShapeError, ("softmax", "point")),
    "float axis": (lambda c: c.b.max(c.p.x, axis=1.0), bg.ShapeError, ("max", "axis 1.0")),
    "bool axis": (lambda c: c.b.argmax(c.p.x, axis=True), bg.ShapeError, ("argmax", "axis True")),
    "reshape to a float": (lambda c: c.b.reshape(c.p.x, 35.0), bg.ShapeError, ("reshape", "35.0", "ints")),
    "gelu approximate": (
        lambda c: c.b.gelu(c.p.x, approximate="erf"),
        bg.ArgumentError,
        ("gelu", "'erf'", "'tanh'"),
    ),
    "attention int pos past the cache": (
        lambda c: c.b.attention(c.q2, c.kcache, c.kcache, 3),
        bg.LimitError,
        ("attention", "kcache", "3", "4"),
    ),
    "attention nan scale": (
        lambda c: c.b.attention(c.q1, c.kcache, c.kcache, 0, scale=math.nan),
        bg.BatchError,
        ("attention", "nan"),
    ),
    "kv_write int pos past the cache": (
        lambda c: c.b.kv_write(c.kcache, c.q2, 3),
        bg.LimitError,
        ("kv_write", "kcache"),
    ),
    "matmul flag not a bool": (
        lambda c: c.b.matmul(c.p.x, c.p.y, transpose_b="yes"),
        bg.ArgumentError,
        ("matmul", "transpose_b", "'yes'"),
    ),
    "keepdims not a bool": (lambda c: c.b.sum(c.p.x, 0, keepdims=np.ones(2)), bg.ArgumentError, ("sum", "keepdims")),
    "eps not a number": (
        lambda c: c.b.rms_norm(c.p.x, c.b.upload(np.ones(7, np.float32)), eps="1e-5"),
        bg.ArgumentError,
        ("rms_norm", "eps", "str"),
    ),
    "causal not a bool": (
        lambda c: c.b.attention(c.q1, c.kcache, c.kcache, 0, causal=(1, 2)),
        bg.ArgumentError,
        ("attention", "causal"),
    ),
    "upload name not a str": (lambda c: c.b.upload(np.ones(3, np.float32), name=3), bg.ArgumentError, ("name",)),
    "permute axes not a sequence": (lambda c: c.b.permute(c.p.x, 1), bg.ArgumentError, ("permute", "axes", "int")),
    "concat of a tensor": (lambda c: c.b.concat(c.p.x), bg.ArgumentError, ("concat", "tensors", "Tensor")),
    "slice by an array": (lambda c: c.b.slice(c.p.x, np.array([0, 1])), bg.ShapeError, ("slice", "unsupported")),
    "device kind not a str": (lambda c: bg.Device(3), bg.ArgumentError, ("Device", "kind", "int")),
    "export to a non-path": (lambda c: c.b.export_webgpu(3.5), bg.ArgumentError, ("export_webgpu", "out_dir")),
    # execute, read, outputs
    "execute feeds not a mapping": (lambda c: c.b.execute(3), bg.ArgumentError, ("feeds", "mapping")),
    "execute scalars not a mapping": (
        lambda c: c.b.execute(scalars="pos"),
        bg.ArgumentError,
        ("scalars", "mapping"),
    ),
    "execute big-endian feed of the wrong dtype": (
        lambda c: c.b.execute({c.p.x: np.ones((5, 7), ">i4")}),
        bg.DTypeError,
        ("probe_x", "int32", "float32"),
    ),
    "read a non-tensor": (lambda c: c.b.read(np.ones(3)), bg.ArgumentError, ("read", "ndarray")),
    "read an unused resident": (
        lambda c: c.b.read(c.lone),
        bg.BatchError,
        ("lone", "not used", "Device.read"),
    ),
    "outputs of a non-tensor": (lambda c: c.b.outputs(np.ones(3)), bg.ArgumentError, ("outputs", "ndarray")),
    "profile before a profiled execute": (lambda c: c.b.profile(), bg.NotExecutedError, ("profile=True",)),
    # kernels
    "kernel workgroup size contradicts the source": (
        lambda c: bg.Kernel("@compute @workgroup_size(64) fn main() {}", workgroup_size=(32,)),
        bg.ArgumentError,
        ("workgroup_size", "(64, 1, 1)"),
    ),
    "kernel source not a str": (lambda c: bg.Kernel(wgsl=3), bg.ArgumentError, ("Kernel", "wgsl")),
    "kernel workgroup size not ints": (
        lambda c: bg.Kernel("fn main() {}", workgroup_size=2.5),
        bg.ArgumentError,
        ("workgroup_size", "2.5"),
    ),
    "kernel workgroup size unreadable": (
        lambda c: bg.Kernel("const W = 8u;\n@compute @workgroup_size(W * 2u) fn main() {}"),
        bg.ArgumentError,
        ("W * 2u", "workgroup_size="),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused(dev: bg.Device, rng: np.random.Generator, case: str) -> None:  # noqa: F811
    call, error, fragments = BAD_INPUTS[case]
    batch, probe = new_batch(dev, rng)
    ctx = Ctx.make(dev, batch, probe)
    with fails(batch, error, *fragments):
        call(ctx)
    probe.check()


# asynchronous reads ----------------------------------------------------------------------------

CANCELLED_READ = """
import asyncio, numpy as np, batchgpu as bg
dev = bg.Device("wgpu")
a = (np.random.default_rng(0).standard_normal((128, 128)) / 128).astype(np.float32)
batch = bg.GpuCommandBatch(dev)
t = ta = batch.upload(a)
for _ in range(40):
    t = batch.matmul(t, ta)
batch.execute()
expected = batch.read(t)

async def cancelled_read():
    batch.execute()
    try:
        await asyncio.wait_for(batch.read_async(t), 1e-4)
        print("finished before the timeout")
    except asyncio.TimeoutError:
        print("cancelled")

async def read():
    return await batch.read_async(t)

asyncio.run(cancelled_read())  # the loop closes with the read's map in flight
assert np.array_equal(asyncio.run(read()), expected), "a later await on a new loop"
assert np.array_equal(batch.read(t), expected), "read afterwards"

async def cancel_then_await_again():
    batch.execute()
    try:
        await asyncio.wait_for(batch.read_async(t), 1e-4)
    except asyncio.TimeoutError:
        pass
    return await batch.read_async(t)

assert np.array_equal(asyncio.run(cancel_then_await_again()), expected), "a later await on the same loop"
batch.execute()
pending = None

async def abandon():
    global pending
    pending = asyncio.ensure_future(batch.read_async(t))
    await asyncio.sleep(0)

asyncio.run(abandon())  # the loop closes while a read task is pending
assert np.array_equal(batch.read(t), expected), "read after an abandoned task"
print("ok")
"""


def test_cancelled_async_read_does_not_poison_the_execute(gpu: bg.Device) -> None:
    """In a fresh interpreter (stderr must stay clean: no 'Event loop is closed' from a callback)."""
    done = subprocess.run([sys.executable, "-c", CANCELLED_READ], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok"), done.stdout
    noise = [line for line in done.stderr.splitlines() if "Task was destroyed but it is pending" not in line]
    assert not any(line.strip() for line in noise), done.stderr


@pytest.mark.asyncio
async def test_cancelled_read_on_the_reference_executor(ref: bg.Device) -> None:
    batch = bg.GpuCommandBatch(ref)
    x = batch.upload(np.arange(6, dtype=np.float32))
    y = batch.mul(x, 3.0)
    batch.execute()
    assert_close(await asyncio.wait_for(batch.read_async(y), 5), np.arange(6, dtype=np.float32) * 3)


# readback larger than one staging buffer -------------------------------------------------------


def test_readback_split_over_staging_buffers(rng: np.random.Generator) -> None:  # noqa: F811
    """Reading back more than the largest staging buffer at once (max_buffer_size; lowered here on a
    device of its own) spreads the copies over several staging buffers instead of failing."""
    dev = bg.Device("wgpu", poison=True)
    dev.executor.staging.limit = 3000  # bytes: each 1,000-float output needs a staging buffer of its own
    batch = bg.GpuCommandBatch(dev)
    arrays = [random_array(rng, (1000,), np.float32) for _ in range(3)]
    outs = [batch.neg(batch.upload(a)) for a in arrays] + [batch.add(batch.upload(arrays[0]), 1.0)]
    batch.execute()
    for out in outs:
        batch.read(out)  # every output joins the readback set of later executes
    before = dev.stats.buffers_created
    for _ in range(2):
        batch.execute()
        got = [batch.read(out) for out in outs]
    for value, a in zip(got[:3], arrays):
        assert_close(value, -a)
    assert_close(got[3], arrays[0] + 1)
    assert dev.stats.buffers_created - before <= len(outs)  # the pool reuses the staging parts
