"""Bad input fails at record time with a documented BatchError subclass whose message names the op,
the tensor and expected vs actual; a failed record leaves the batch, the caches and other tensors
usable (every test re-executes the same batch afterwards and checks the results against numpy)."""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array


@pytest.fixture(params=["gpu", "ref"])
def dev(request: pytest.FixtureRequest) -> bg.Device:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def other_device() -> bg.Device:
    """A second device (the reference executor is cheap to create)."""
    return bg.Device("reference")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


class Probe:
    """A small graph recorded and executed before the errors; ``check()`` proves afterwards that the
    same batch still reads old results, records new ops on old inputs and executes them correctly."""

    def __init__(self, batch: bg.GpuCommandBatch, rng: np.random.Generator) -> None:
        self.batch, self.rng = batch, rng
        self.xa = random_array(rng, (5, 7), np.float32)
        self.ya = random_array(rng, (5, 7), np.float32)
        self.x = batch.upload(self.xa, name="probe_x")
        self.y = batch.upload(self.ya, name="probe_y")
        self.s = batch.add(self.x, self.y)
        batch.execute()
        assert_close(batch.read(self.s), self.xa + self.ya)

    def check(self) -> None:
        b = self.batch
        za = random_array(self.rng, (5, 7), np.float32)
        t = b.add(b.mul(self.x, b.upload(za)), self.y)
        # recording after an execute must not disturb reading that execute's results
        assert_close(b.read(self.s), self.xa + self.ya)
        b.execute()
        assert_close(b.read(t), self.xa * za + self.ya)
        assert_close(b.read(self.s), self.xa + self.ya)


def new_batch(dev: bg.Device, rng: np.random.Generator) -> tuple[bg.GpuCommandBatch, Probe]:
    batch = bg.GpuCommandBatch(dev)
    return batch, Probe(batch, rng)


@contextlib.contextmanager
def fails(batch: bg.GpuCommandBatch, error: type[bg.BatchError], *fragments: str) -> Iterator[None]:
    """Expect exactly ``error`` with every fragment in its message, and no trace of the attempt:
    nothing recorded, compiled, allocated, uploaded or submitted."""
    before = batch.device.stats.snapshot()
    ops = len(batch)
    with pytest.raises(bg.BatchError) as info:
        yield
    assert type(info.value) is error, f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"
    after = batch.device.stats.snapshot()
    for counter in ("pipelines_compiled", "buffers_created", "bytes_uploaded", "submits", "dispatches"):
        assert after[counter] == before[counter], (counter, before[counter], after[counter], message)
    assert len(batch) == ops


# shapes ----------------------------------------------------------------------------------------


def test_add_shapes_that_do_not_broadcast(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    lhs = b.upload(random_array(rng, (3, 4), np.float32), name="lhs")
    rhs = b.upload(random_array(rng, (5,), np.float32), name="rhs")
    with fails(b, bg.ShapeError, "add", "lhs", "rhs", "(3, 4)", "(5,)"):
        b.add(lhs, rhs)
    with fails(b, bg.ShapeError, "sub", "lhs", "rhs"):
        _ = lhs - rhs
    probe.check()


def test_matmul_inner_dims(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    left = b.upload(random_array(rng, (3, 4), np.float32), name="left")
    right = b.upload(random_array(rng, (5, 6), np.float32), name="right")
    with fails(b, bg.ShapeError, "matmul", "left", "right", "K=4", "K=5"):
        b.matmul(left, right)
    with fails(b, bg.ShapeError, "matmul", "K=3", "K=6"):
        b.matmul(left, right, transpose_a=True, transpose_b=True)
    batched = b.upload(random_array(rng, (2, 4, 5), np.float32), name="batched")
    other = b.upload(random_array(rng, (3, 5, 6), np.float32), name="other")
    with fails(b, bg.ShapeError, "matmul", "batch dims", "(2,)", "(3,)"):
        b.matmul(batched, other)
    probe.check()


# dtypes ----------------------------------------------------------------------------------------


def test_mixed_dtypes_promote_or_are_refused(dev: bg.Device, rng: np.random.Generator) -> None:
    """float32 + int32 -> float32 and float16 + float32 -> float32 (batchgpu.promotion); int32 with uint32
    has no common dtype and is refused, naming both, before anything is recorded."""
    b, probe = new_batch(dev, rng)
    af, ai = random_array(rng, (6,), np.float32), random_array(rng, (6,), np.int32)
    ah, au = random_array(rng, (3, 1), np.float16), random_array(rng, (6,), np.uint32)
    xf, xi, xh = b.upload(af, name="xf"), b.upload(ai, name="xi"), b.upload(ah, name="xh")
    xu = b.upload(au, name="xu")
    with fails(b, bg.DTypeError, "add", "int32 and uint32", "no common supported dtype"):
        b.add(xi, xu)
    with fails(b, bg.ShapeError, "maximum", "cannot broadcast"):  # refused before its casts are recorded
        b.maximum(xh, b.upload(np.ones((2, 5), np.float32)))
    mixed = [b.add(xf, xi), b.maximum(xi, xf), b.mul(xh, xf), b.sub(xi, 2.5), b.div(xi, xi)]
    assert [t.dtype for t in mixed] == [np.float32] * 5
    b.execute()
    f32 = ai.astype(np.float32)
    expected = [af + f32, np.maximum(f32, af), ah.astype(np.float32) * af, f32 - np.float32(2.5), f32 / f32]
    for tensor, want in zip(mixed, expected):
        np.testing.assert_allclose(b.read(tensor), want, rtol=1e-6)
    probe.check()


def test_float64_upload_needs_dtype(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    data = rng.standard_normal((4, 7)) * 3 + 1
    with fails(b, bg.DTypeError, "upload", "weights", "float64", "float32"):
        b.upload(data, name="weights")
    with fails(b, bg.DTypeError, "upload", "int64"):
        b.upload(rng.integers(1, 100, 5, dtype=np.int64))
    with fails(b, bg.DTypeError, "Device.tensor", "float64"):
        dev.tensor(data)
    weights = b.upload(data, dtype=np.float32, name="weights")
    assert weights.dtype == np.float32 and weights.shape == (4, 7)
    doubled = b.mul(weights, 2.0)
    b.execute()
    assert_close(b.read(doubled), data.astype(np.float32) * np.float32(2))
    probe.check()


def test_int_tensor_with_fractional_or_out_of_range_scalar(dev: bg.Device, rng: np.random.Generator) -> None:
    """A Python float makes an int tensor's op float32 (as torch); an int out of the tensor's range is refused."""
    b, probe = new_batch(dev, rng)
    xa = random_array(rng, (9,), np.int32)
    xi = b.upload(xa, name="counts")
    with fails(b, bg.DTypeError, "add", str(2**40), "int32"):
        b.add(xi, 2**40)
    unsigned = b.upload(random_array(rng, (9,), np.uint32), name="unsigned")
    with fails(b, bg.DTypeError, "sub", "-1", "uint32", "unsigned"):
        b.sub(unsigned, -1)
    plus, half, three = b.add(xi, 3), 0.5 * xi, b.add(xi, 3.0)
    assert (plus.dtype, half.dtype, three.dtype) == (np.int32, np.float32, np.float32)
    b.execute()
    assert_close(b.read(plus), xa + np.int32(3))
    assert_close(b.read(half), xa.astype(np.float32) * np.float32(0.5))
    probe.check()


@pytest.mark.parametrize("op", ["mean", "softmax"])
def test_float_only_reductions_refuse_int32(dev: bg.Device, rng: np.random.Generator, op: str) -> None:
    b, probe = new_batch(dev, rng)
    xi = b.upload(random_array(rng, (4, 5), np.int32), name="ints")
    with fails(b, bg.DTypeError, op, "ints", "int32", "float32"):
        getattr(b, op)(xi)
    probe.check()


@pytest.mark.parametrize("op", ["exp", "log", "sqrt", "sin", "erf"])
def test_float_only_elementwise_ops_compute_int32_as_float32(dev: bg.Device, op: str) -> None:
    """numpy and torch compute exp(int) etc. in floats: so does batchgpu, in float32."""
    b = bg.GpuCommandBatch(dev)
    data = np.arange(1, 10, dtype=np.int32)
    out = getattr(b, op)(b.upload(data))
    b.execute()
    assert out.dtype == np.float32
    reference = np.vectorize(math.erf) if op == "erf" else getattr(np, op)
    want = reference(data.astype(np.float64))
    np.testing.assert_allclose(b.read(out), want, rtol=2e-6)


def test_neg_of_uint32(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    xu = b.upload(random_array(rng, (8,), np.uint32), name="unsigned")
    with fails(b, bg.DTypeError, "neg", "unsigned", "uint32", "int32"):
        b.neg(xu)
    with fails(b, bg.DTypeError, "neg", "unsigned"):
        _ = -xu
    probe.check()


def test_unsupported_dtypes(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    x = b.upload(random_array(rng, (3,), np.float32), name="x")
    with fails(b, bg.DTypeError, "cast", "float64"):
        b.cast(x, np.float64)
    with fails(b, bg.DTypeError, "empty", "int8"):
        b.empty((3,), np.int8)
    with fails(b, bg.DTypeError, "upload", "object"):
        b.upload([1.0, None])
    probe.check()


# operands from elsewhere -----------------------------------------------------------------------


def test_tensor_of_another_batch(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    other = bg.GpuCommandBatch(dev, name="elsewhere")
    stranger = other.upload(random_array(rng, (5, 7), np.float32), name="stranger")
    with fails(b, bg.DeviceMismatchError, "add", "stranger", "elsewhere", b.name):
        b.add(probe.x, stranger)
    with fails(b, bg.DeviceMismatchError, "matmul", "stranger", "elsewhere"):
        b.matmul(stranger, probe.x, transpose_b=True)
    with fails(b, bg.DeviceMismatchError, "read", "stranger", "elsewhere"):
        b.read(stranger)
    probe.check()


def test_resident_tensor_of_another_device(dev: bg.Device, other_device: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    foreign = other_device.tensor(random_array(rng, (5, 7), np.float32), name="foreign")
    with fails(b, bg.DeviceMismatchError, "add", "foreign", "create the batch on the tensor's device"):
        b.add(probe.x, foreign)
    with fails(b, bg.DeviceMismatchError, "Device.read", "foreign", "another device"):
        dev.read(foreign)
    # a resident tensor of the batch's own device is fine
    wa = random_array(rng, (5, 7), np.float32)
    weights = dev.tensor(wa, name="weights")
    scaled = b.mul(probe.x, weights)
    b.execute()
    assert_close(b.read(scaled), probe.xa * wa)
    probe.check()


# reading ---------------------------------------------------------------------------------------


def test_read_before_execute(dev: bg.Device, rng: np.random.Generator) -> None:
    b = bg.GpuCommandBatch(dev, name="fresh")
    xa = random_array(rng, (6,), np.float32)
    x = b.upload(xa, name="x")
    e = b.exp(x)
    with fails(b, bg.NotExecutedError, "read", e.name, "fresh", "execute"):
        b.read(e)
    with fails(b, bg.NotExecutedError, "read", "x"):
        b.read(x)
    b.execute()
    assert_close(b.read(e), np.exp(xa))


def test_read_of_tensor_recorded_after_the_last_execute(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    late = b.sub(probe.x, probe.y)
    with fails(b, bg.NotExecutedError, "read", late.name, "after the last execute"):
        b.read(late)
    assert_close(b.read(probe.s), probe.xa + probe.ya)  # the executed result stays readable
    b.execute()
    assert_close(b.read(late), probe.xa - probe.ya)
    probe.check()


@pytest.mark.asyncio
async def test_async_read_before_execute(gpu: bg.Device, rng: np.random.Generator) -> None:
    b = bg.GpuCommandBatch(gpu)
    xa = random_array(rng, (6,), np.float32)
    t = b.relu(b.upload(xa))
    with pytest.raises(bg.NotExecutedError, match="never executed"):
        await b.read_async(t)
    await b.execute_async()
    assert_close(await b.read_async(t), np.maximum(xa, 0))


# axes, reshape, slices -------------------------------------------------------------------------


BAD_AXES = [
    ("sum", dict(axis=2), "axis 2"),
    ("sum", dict(axis=-3), "axis -3"),
    ("sum", dict(axis=(0, 0)), "repeated axis"),
    ("sum", dict(axis=1.5), "axis 1.5"),
    ("max", dict(axis=(1, 5)), "axis 5"),
    ("mean", dict(axis=7), "axis 7"),
    ("softmax", dict(axis=2), "axis 2"),
    ("softmax", dict(axis=-3), "axis -3"),
    ("softmax", dict(axis=None), "axis None"),
]


@pytest.mark.parametrize(("op", "kwargs", "fragment"), BAD_AXES, ids=[f"{o}-{k}" for o, k, _ in BAD_AXES])
def test_bad_axis(dev: bg.Device, rng: np.random.Generator, op: str, kwargs: dict, fragment: str) -> None:
    b, probe = new_batch(dev, rng)
    x = b.upload(random_array(rng, (3, 4), np.float32), name="matrix")
    with fails(b, bg.ShapeError, op, fragment, "matrix", "(3, 4)"):
        getattr(b, op)(x, **kwargs)
    probe.check()


def test_bad_concat(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    first = b.upload(random_array(rng, (3, 4), np.float32), name="first")
    second = b.upload(random_array(rng, (3, 5), np.float32), name="second")
    with fails(b, bg.ShapeError, "concat", "axis 2", "first", "ndim 2"):
        b.concat([first, first], axis=2)
    with fails(b, bg.ShapeError, "concat", "second", "first", "(3, 5)", "(3, 4)", "axis 0"):
        b.concat([first, second], axis=0)
    with fails(b, bg.ShapeError, "concat", "at least one"):
        b.concat([])
    joined = b.concat([first, second], axis=1)
    assert joined.shape == (3, 9)
    probe.check()


BAD_RESHAPES = [
    ((5, 3), ("12 elements", "(5, 3)", "15 elements")),
    ((-1, -1), ("invalid", "(-1, -1)")),
    ((5, -1), ("cannot reshape", "12 elements", "(5, -1)")),
    ((-2, -6), ("invalid", "(-2, -6)")),
    ((2.5, 4), ("2.5",)),
]


@pytest.mark.parametrize(("shape", "fragments"), BAD_RESHAPES, ids=[str(s) for s, _ in BAD_RESHAPES])
def test_bad_reshape(dev: bg.Device, rng: np.random.Generator, shape: tuple, fragments: tuple[str, ...]) -> None:
    b, probe = new_batch(dev, rng)
    xa = random_array(rng, (3, 4), np.float32)
    x = b.upload(xa, name="grid")
    with fails(b, bg.ShapeError, "reshape", "grid", *fragments):
        b.reshape(x, shape)
    flat = b.reshape(x, -1, 6)
    b.execute()
    assert_close(b.read(flat), xa.reshape(-1, 6))
    probe.check()


BAD_KEYS = [
    ((3,), "index 3", "axis 0"),
    ((slice(None), -5), "index -5", "axis 1"),
    ((0, 0, 0), "3 indices", "2 dims"),
    ((slice(1, 1),), "no elements", "slice(1, 1"),
    ((slice(None, None, 0),), "step", "0"),
    ((True,), "True", "unsupported"),
    ((None, 7), "index 7", "axis 0"),  # a new axis is fine, the index after it is not
    (([0, 1],), "[0, 1]", "unsupported"),
    ((Ellipsis, Ellipsis), "Ellipsis", "one"),
]


@pytest.mark.parametrize(("key", "fragment", "detail"), BAD_KEYS, ids=[repr(k) for k, _, _ in BAD_KEYS])
def test_bad_slice(dev: bg.Device, rng: np.random.Generator, key: tuple, fragment: str, detail: str) -> None:
    b, probe = new_batch(dev, rng)
    xa = random_array(rng, (3, 4), np.float32)
    x = b.upload(xa, name="table")
    with fails(b, bg.ShapeError, "slice", "table", fragment, detail):
        _ = x[key if len(key) > 1 else key[0]]
    row = x[-1, 1::2]
    b.execute()
    assert_close(b.read(row), xa[-1, 1::2])
    probe.check()


# feeds -----------------------------------------------------------------------------------------


def test_bad_feeds(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    with fails(b, bg.ShapeError, "execute", "probe_x", "(7, 5)", "(5, 7)"):
        b.execute({probe.x: random_array(rng, (7, 5), np.float32)})
    with fails(b, bg.DTypeError, "execute", "probe_x", "int32", "float32"):
        b.execute({probe.x: random_array(rng, (5, 7), np.int32)})
    with fails(b, bg.DTypeError, "execute", "probe_x", "float64"):
        b.execute({probe.x: rng.standard_normal((5, 7))})
    with fails(b, bg.ArgumentError, "execute", probe.s.name, "not an input"):
        b.execute({probe.s: random_array(rng, (5, 7), np.float32)})
    resident = dev.tensor(random_array(rng, (5, 7), np.float32), name="resident_w")
    with fails(b, bg.ArgumentError, "execute", "resident_w", "not an input"):
        b.execute({resident: random_array(rng, (5, 7), np.float32)})
    other = bg.GpuCommandBatch(dev)
    foreign = other.upload(random_array(rng, (5, 7), np.float32), name="foreign_in")
    with fails(b, bg.ArgumentError, "execute", "foreign_in", b.name):
        b.execute({foreign: random_array(rng, (5, 7), np.float32)})
    with fails(b, bg.ArgumentError, "execute", "'probe_z'", "names no input", "'probe_x'"):
        b.execute({"probe_z": random_array(rng, (5, 7), np.float32)})
    with fails(b, bg.ArgumentError, "execute", "feeds", "mapping", "int"):
        b.execute(3)
    # a rejected feed uploads nothing: a good execute still sees the old inputs
    b.execute()
    assert_close(b.read(probe.s), probe.xa + probe.ya)
    new_x = random_array(rng, (5, 7), np.float32)
    b.execute({probe.x: new_x})
    assert_close(b.read(probe.s), new_x + probe.ya)
    probe.xa = new_x
    probe.check()


# sizes -----------------------------------------------------------------------------------------


def test_tensor_over_storage_binding_limit(gpu: bg.Device, rng: np.random.Generator) -> None:
    limit = gpu.limits.max_storage_buffer_binding_size
    b, probe = new_batch(gpu, rng)
    count = limit // 4 + 1
    big = np.zeros(count, np.float32)  # lazily allocated pages: never touched
    nbytes = str(count * 4)
    with fails(b, bg.LimitError, "upload big", "max_storage_buffer_binding_size", nbytes, str(limit)):
        b.upload(big, name="big")
    with fails(b, bg.LimitError, "Device.tensor", "max_storage_buffer_binding_size", nbytes, str(limit)):
        gpu.tensor(big)
    with fails(b, bg.LimitError, "empty", "max_storage_buffer_binding_size", nbytes, str(limit)):
        b.empty((count,), np.float32)
    side = math.isqrt(limit // 4) + 1  # tiny inputs, an output over the limit
    column = b.upload(random_array(rng, (side, 1), np.float32), name="column")
    row = b.upload(random_array(rng, (1, side), np.float32), name="row")
    with fails(b, bg.LimitError, "matmul", f"({side}, {side})", str(side * side * 4), str(limit)):
        b.matmul(column, row)
    probe.check()


def test_matmul_batch_over_workgroups_per_dimension(gpu: bg.Device, rng: np.random.Generator) -> None:
    per_dim = gpu.limits.max_compute_workgroups_per_dimension
    b, probe = new_batch(gpu, rng)
    stack = b.upload(random_array(rng, (per_dim + 1, 1, 1), np.float32), name="stack")
    with fails(b, bg.LimitError, "matmul", "max_compute_workgroups_per_dimension", f"{per_dim + 1} > {per_dim}"):
        b.matmul(stack, stack)
    probe.check()


def test_zero_size_shapes(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    with fails(b, bg.ShapeError, "upload", "(0, 3)"):
        b.upload(np.zeros((0, 3), np.float32))
    with fails(b, bg.ShapeError, "upload", "(0,)"):
        b.upload([], dtype=np.float32)
    with fails(b, bg.ShapeError, "empty", "(4, 0)"):
        b.empty((4, 0))
    with fails(b, bg.ShapeError, "empty", "(-2,)"):
        b.empty(-2)
    with fails(b, bg.ShapeError, "Device.tensor", "(2, 0)"):
        dev.tensor(np.zeros((2, 0), np.int32))
    # 0-d data is not empty: it keeps its shape and broadcasts like numpy
    scalar = np.float32(rng.uniform(1, 2))
    s = b.upload(scalar, name="scalar")
    assert s.shape == ()
    shifted = b.add(probe.x, s)
    b.execute()
    assert_close(b.read(s), np.asarray(scalar))
    assert_close(b.read(shifted), probe.xa + scalar)
    probe.check()


# misuse ----------------------------------------------------------------------------------------


def test_operands_that_are_not_tensors(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    with fails(b, bg.ArgumentError, "add", "at least one operand must be a Tensor"):
        b.add(1.0, 2.0)
    with fails(b, bg.ArgumentError, "mul", "b", "list", "upload it"):
        b.mul(probe.x, [1.0, 2.0])
    with fails(b, bg.ArgumentError, "add", "b", "bool"):
        b.add(probe.x, True)
    with fails(b, bg.ArgumentError, "sub", "a", "ndarray", "(7,)", "upload it"):
        b.sub(np.ones(7, np.float32), probe.x)
    probe.check()


def test_released_batch(dev: bg.Device, rng: np.random.Generator) -> None:
    b, probe = new_batch(dev, rng)
    b2 = bg.GpuCommandBatch(dev, name="doomed")
    xa = random_array(rng, (4,), np.float32)
    x = b2.upload(xa)
    y = b2.sqrt(b2.abs(x))
    b2.execute()
    b2.release()
    for action, op in [
        (lambda: b2.add(x, x), "add"),
        (lambda: b2.upload(xa), "upload"),
        (lambda: b2.empty(3), "empty"),
        (lambda: b2.execute(), "execute"),
        (lambda: b2.read(y), "read"),
    ]:
        with fails(b2, bg.BatchError, op, "'doomed'", "released"):
            action()
    # its tensors cannot leak into a live batch, and the device keeps working
    with fails(b, bg.DeviceMismatchError, "add", "doomed"):
        b.add(probe.x, y)
    probe.check()


def test_devices_are_told_apart(rng: np.random.Generator) -> None:
    """Two devices of one kind have different reprs; a batch made without a device says it is on the default
    device and how to pass the tensor's."""
    first, second = bg.Device("reference"), bg.Device("reference")
    assert repr(first) != repr(second) and "#" in repr(first)
    batch = bg.GpuCommandBatch()
    foreign = first.tensor(random_array(rng, (3,), np.float32), name="foreign")
    if batch.device is first:
        pytest.skip("the default device is this one")
    with fails(
        batch, bg.DeviceMismatchError, repr(first), repr(batch.device), "the default device", "GpuCommandBatch(dev)"
    ):
        batch.add(batch.upload(random_array(rng, (3,), np.float32)), foreign)
