"""The numpy / torch surface of a tensor: operators, methods, new-axis indexing, constants, mixed-dtype
promotion and the new elementwise ops (pow, sin, cos, floor, ceil, round, erf, comparisons as uint32
masks), each against numpy on random data (never zeros) on every executor (the wgpu device here, the CUDA
sources on the CPU harness through DEVICE_SUITES, the reference in ``ref``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.ops.elementwise import EXPRESSIONS

from .conftest import assert_close, random_array


def run(device: bg.Device, arrays: list[np.ndarray], build) -> list[np.ndarray]:
    batch = bg.GpuCommandBatch(device)
    tensors = [batch.upload(a) for a in arrays]
    outputs = build(batch, *tensors)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    batch.execute()
    return [batch.read(t) for t in outputs]


def check(gpu, ref, arrays, build, expected, dtype=np.float32, scale=1.0) -> None:
    """Device and reference executor both equal numpy's ``expected`` (per-dtype tolerance)."""
    for device in (gpu, ref):
        for got, want in zip(run(device, arrays, build), expected):
            assert_close(got, np.asarray(want), dtype, scale)


FLOATS = [np.float32, np.float16]


@pytest.mark.parametrize("dtype", FLOATS)
def test_operators_match_numpy(gpu, ref, dtype):
    rng = np.random.default_rng(5)
    x, y = random_array(rng, (3, 7), dtype), random_array(rng, (7,), dtype)
    arithmetic = [x**2, np.abs(x), -x, x * y - dtype(1.5), dtype(2) / (np.abs(y) + dtype(1))]
    arithmetic.append((np.abs(x) + dtype(0.5)) ** y)
    check(
        gpu,
        ref,
        [x, y],
        lambda b, t, u: [t**2, abs(t), -t, t * u - 1.5, 2.0 / (abs(u) + 1), (abs(t) + 0.5) ** u],
        arithmetic,
        dtype,
        scale=2,
    )
    masks = [x > y, x >= 0, x < y, x <= dtype(0.25), np.ones(x.shape, bool), x != y]
    check(
        gpu,
        ref,
        [x, y],
        lambda b, t, u: [t > u, t >= 0, t < u, t <= 0.25, b.equal(t, t), b.not_equal(t, u)],
        [m.astype(np.uint32) for m in masks],
        np.uint32,
    )


def test_methods_match_numpy(gpu, ref):
    rng = np.random.default_rng(6)
    x = random_array(rng, (4, 6), np.float32)
    shifted = np.exp(x - x.max(-1, keepdims=True))
    expected = [x.T, x.sum(), x.sum(axis=0), x.mean(axis=1, keepdims=True), x.max(), x.reshape(3, -1), x.T]
    expected += [
        np.clip(x, -0.5, 0.25),
        np.exp(x),
        np.tanh(x),
        np.maximum(x, 0),
        shifted / shifted.sum(-1, keepdims=True),
    ]

    def methods(b: bg.GpuCommandBatch, t: bg.Tensor) -> list[bg.Tensor]:
        reductions = [t.T, t.sum(), t.sum(axis=0), t.mean(axis=1, keepdims=True), t.max(), t.reshape(3, -1)]
        return [*reductions, t.transpose(1, 0), t.clip(-0.5, 0.25), t.exp(), t.tanh(), t.relu(), t.softmax()]

    check(gpu, ref, [x], methods, expected, scale=4)
    for device in (gpu, ref):
        first, rows, ints = run(device, [x], lambda b, t: [t.argmax(), t.argmax(axis=1), t.astype(np.int32)])
        assert int(first) == x.argmax() and (rows == x.argmax(axis=1)).all()
        np.testing.assert_array_equal(ints, x.astype(np.int32))


@pytest.mark.parametrize(
    "key",
    [(slice(None), None), (None,), (None, slice(1, None), None, slice(None, None, 2)), (Ellipsis, None), (1, None)],
    ids=["[:, None]", "[None]", "[None, 1:, None, ::2]", "[..., None]", "[1, None]"],
)
def test_new_axes_index_like_numpy(gpu, ref, key):
    x = random_array(np.random.default_rng(7), (3, 5), np.float32)
    check(gpu, ref, [x], lambda b, t: t[key], [x[key]])


def test_constants(gpu, ref):
    x = random_array(np.random.default_rng(8), (2, 3), np.float32)
    check(
        gpu,
        ref,
        [x],
        lambda b, t: [t + b.ones((2, 3)), t * b.full(3, 2.5), b.zeros(3) - t, b.arange(1.0, 2.0, 0.25) * 2],
        [x + 1, x * np.float32(2.5), -x, np.arange(1.0, 2.0, 0.25, dtype=np.float32) * 2],
    )
    for device in (gpu, ref):
        (ints,) = run(device, [x], lambda b, t: b.arange(7) * 3)
        np.testing.assert_array_equal(ints, np.arange(7, dtype=np.int32) * 3)
        assert ints.dtype == np.int32


PROMOTIONS = [
    (np.float32, np.int32, np.float32),
    (np.int32, np.float16, np.float16),
    (np.float16, np.float32, np.float32),
    (np.uint32, np.float32, np.float32),
]


@pytest.mark.parametrize(("a_dtype", "b_dtype", "result"), PROMOTIONS, ids=lambda d: np.dtype(d).name)
def test_mixed_dtypes_promote(gpu, ref, a_dtype, b_dtype, result):
    rng = np.random.default_rng(9)
    a, b = random_array(rng, (4, 5), a_dtype), random_array(rng, (5,), b_dtype)
    wide = [a.astype(result), b.astype(result)]
    check(
        gpu,
        ref,
        [a, b],
        lambda batch, x, y: [x + y, batch.maximum(x, y), x * y, x > y],
        [wide[0] + wide[1], np.maximum(*wide), wide[0] * wide[1], (wide[0] > wide[1]).astype(np.uint32)],
        result,
    )


def test_truthiness_and_equality_of_handles(ref):
    batch = bg.GpuCommandBatch(ref)
    x = batch.upload(np.ones(3, np.float32))
    with pytest.raises(bg.ArgumentError, match=r"bool\(.*\): a tensor is a handle"):
        bool(x > 0)
    assert x == x and x != batch.upload(np.ones(3, np.float32))  # identity: tensors are feed keys
    assert {x: 1}[x] == 1


# the new elementwise ops beyond random data: their hard inputs --------------------------------------


def test_pow_special_cases_match_numpy(gpu, ref):
    """Negative bases with integer exponents, zeros, infinities, NaN, ``x ** 0`` and ``1 ** y``."""
    bases = np.array([-2.0, -2.0, -0.5, -3.0, 0.0, -0.0, -0.0, 0.0, np.inf, -np.inf, -np.inf, 1.0, np.nan, 4.0, -8.0])
    exps = np.array([3.0, 2.0, -3.0, 0.5, -1.0, -1.0, 3.0, 0.0, -2.0, 3.0, 0.5, np.nan, 0.0, 0.5, 1 / 3])
    with np.errstate(all="ignore"):
        expected = np.power(bases.astype(np.float32), exps.astype(np.float32))
    for device in (gpu, ref):
        (got,) = run(device, [bases.astype(np.float32), exps.astype(np.float32)], lambda b, x, y: x**y)
        np.testing.assert_allclose(got, expected, rtol=2e-6)
        np.testing.assert_array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(expected[~np.isnan(expected)]))


def test_sin_cos_far_arguments_and_erf_everywhere(gpu, ref):
    """sin / cos reduce by whole turns (accurate to |x| ~ 1e4 in float32); erf near 0 keeps its relative
    precision (a series, not 1 - erfc) and saturates in the tails."""
    far = np.concatenate([np.linspace(-1e4, 1e4, 101), [np.inf, -np.inf, np.nan]]).astype(np.float32)
    small = np.concatenate([np.geomspace(1e-8, 0.49, 40), -np.geomspace(1e-8, 0.49, 40)])
    wide = np.concatenate([small, np.linspace(-12, 12, 97), [np.inf, -np.inf, np.nan]]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        sin, cos = np.sin(far.astype(np.float64)), np.cos(far.astype(np.float64))
    erf = np.array([math.erf(v) if not np.isnan(v) else np.nan for v in wide.astype(np.float64)])
    for device in (gpu, ref):
        got_sin, got_cos = run(device, [far], lambda b, t: [t.sin(), t.cos()])
        np.testing.assert_allclose(got_sin, sin, atol=2e-3)  # float32's own rounding of x is ~5e-4 at 1e4
        np.testing.assert_allclose(got_cos, cos, atol=2e-3)
        (got_erf,) = run(device, [wide], lambda b, t: t.erf())
        np.testing.assert_allclose(got_erf, erf, rtol=3e-7, atol=1e-30)


def test_rounding_halves_to_even(gpu, ref):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.49, -3.51, 7.0, -0.0, np.inf, np.nan], np.float32)
    for device in (gpu, ref):
        rounded, floor, ceil = run(device, [x], lambda b, t: [t.round(), t.floor(), t.ceil()])
        np.testing.assert_array_equal(rounded, np.round(x))
        np.testing.assert_array_equal(floor, np.floor(x))
        np.testing.assert_array_equal(ceil, np.ceil(x))


def test_comparisons_with_nan_match_numpy(gpu, ref):
    x = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0], np.float32)
    y = np.array([np.nan, np.nan, 1.0, -np.inf, 2.0], np.float32)
    ops = ["greater", "greater_equal", "less", "less_equal", "equal", "not_equal"]
    for device in (gpu, ref):
        got = run(device, [x, y], lambda b, s, t: [getattr(b, op)(s, t) for op in ops])
        for op, values in zip(ops, got):
            np.testing.assert_array_equal(values, getattr(np, op)(x, y).astype(np.uint32), err_msg=op)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_where_matches_numpy(gpu, ref, dtype):
    """A float condition is true as numpy's ``bool``: NaN, inf and subnormals count, both zeros do not. The
    kernels test its bits (WGSL may flush a subnormal to zero and assume no NaN or inf in a comparison)."""
    rng = np.random.default_rng(10)
    x, y = random_array(rng, (3, 1, 5), dtype), random_array(rng, (4, 5), dtype)
    flags = rng.integers(-1, 2, (4, 1)).astype(np.int32)
    classes = [np.nan, -np.nan, 0.0, -0.0, 2.5, np.inf, -np.inf, 1e-40, -1e-40, 1e-45, -0.0, 0.0]
    nan_flags = np.array(classes + [0.0, 1.0] * 4, np.float32).reshape(4, 5)
    check(
        gpu,
        ref,
        [x, y, flags, nan_flags],
        lambda b, s, t, f, g: [b.where(s > t, s, t), b.where(f, s, 7), b.where(g, t, s), b.where(s < 0, 0, s)],
        [
            np.where(x > y, x, y),
            np.where(flags != 0, x, dtype(7)),
            np.where(nan_flags != 0, y, x),
            np.where(x < 0, 0, x),
        ],
        dtype,
    )


def test_where_refusals_leave_nothing_recorded(ref):
    batch = bg.GpuCommandBatch(ref)
    x = batch.upload(np.ones((2, 3), np.float16))
    ops = len(batch)
    with pytest.raises(bg.ShapeError, match=r"where: cannot broadcast cond"):
        batch.where(batch.upload(np.ones(4, np.int32)), x, 1.5)
    with pytest.raises(bg.DTypeError, match=r"where: int32 and uint32"):
        batch.where(x, batch.upload(np.ones(3, np.int32)), batch.upload(np.ones(3, np.uint32)))
    with pytest.raises(bg.ArgumentError, match=r"where: a or b must be a Tensor"):
        batch.where(x, 1, 2)
    assert len(batch) == ops


# numpy scalars and 0-d arrays are constants, with the rule of the Python number they hold ---------------

BINARY_OPS = sorted(op for op, expression in EXPRESSIONS.items() if expression.arity == 2)  # new rows join
NUMPY_SCALAR_TYPES = [np.float64, np.float32, np.float16, np.int64, np.int32, np.uint32]
TENSOR_DTYPES = [np.float32, np.float16, np.int32, np.uint32]


def numpy_scalars(rng: np.random.Generator) -> list:
    """A random value of each numpy scalar type (floats of either sign, positive ints so that uint32
    tensors take them), as a numpy scalar and as a 0-d array."""
    values = []
    for kind in NUMPY_SCALAR_TYPES:
        if np.dtype(kind).kind == "f":
            value = kind(rng.uniform(0.5, 3.0) * rng.choice([-1, 1]))
        else:
            value = kind(rng.integers(1, 50))
        values += [value, np.asarray(value)]
    return values


def python_number(value) -> int | float:
    """The Python number a numpy scalar or 0-d array holds."""
    return value.item()


def compute_dtype(op: str, tensor_dtype, value) -> np.dtype:
    """The documented rule for a tensor with a scalar (docs/ops.md, mixed dtypes): a float tensor keeps its
    dtype; an integer tensor keeps its own with an integer scalar, and computes in float32 with a float
    scalar or in an op defined on floats only."""
    tensor_dtype = np.dtype(tensor_dtype)
    if tensor_dtype.kind == "f":
        return tensor_dtype
    floats_only = EXPRESSIONS[op].dtypes == "float"
    return np.dtype(np.float32) if floats_only or np.asarray(value).dtype.kind == "f" else tensor_dtype


def scalar_on_either_side(batch: bg.GpuCommandBatch, op: str, t: bg.Tensor, scalars: list) -> list[bg.Tensor]:
    """``op`` of ``t`` with each scalar on the right, then on the left; then the same with their Python
    numbers."""
    record = getattr(batch, op)

    def both_sides(values: list) -> list[bg.Tensor]:
        return [record(t, v) for v in values] + [record(v, t) for v in values]

    return both_sides(scalars) + both_sides([python_number(v) for v in scalars])


@pytest.mark.parametrize("op", BINARY_OPS)
def test_numpy_scalars_are_constants_in_every_binary_op(gpu, ref, op):
    """Each binary op of the table with every numpy scalar type and 0-d arrays on either side: the
    result (values and dtype) equals the op with the Python number, and numpy's at the promoted dtype."""
    rng = np.random.default_rng(sum(map(ord, op)))
    for dtype in TENSOR_DTYPES:
        data = random_array(rng, (3, 5), dtype, "positive" if op == "pow" else "any")
        scalars = [abs(v) if op == "pow" else v for v in numpy_scalars(rng)]  # no NaN of negative bases
        for device in (gpu, ref):
            results = run(device, [data], lambda batch, t, s=scalars: scalar_on_either_side(batch, op, t, s))
            half = len(results) // 2
            for index, (got, same) in enumerate(zip(results[:half], results[half:])):
                value = scalars[index % len(scalars)]
                compute = compute_dtype(op, dtype, value)
                operands = [data.astype(compute), np.asarray(value, compute)]
                with np.errstate(all="ignore"):
                    want = EXPRESSIONS[op].reference(*(operands if index < len(scalars) else operands[::-1]))
                assert got.dtype == same.dtype, (op, dtype, value)
                np.testing.assert_array_equal(got, same, err_msg=f"{op} {np.dtype(dtype)} {value!r}")
                assert_close(got, want.astype(got.dtype), compute if compute.kind == "f" else got.dtype, scale=2)


@pytest.mark.parametrize("dtype", TENSOR_DTYPES)
def test_numpy_scalars_in_operators_where_and_clip(gpu, ref, dtype):
    """Operators on either side of a numpy scalar (numpy's scalars and arrays defer to the tensor's
    reflected ones), where and clip: the same tensors as with the Python numbers."""
    rng = np.random.default_rng(11)
    data = random_array(rng, (4, 3), dtype)
    scalars = numpy_scalars(rng)

    def expressions(b, t, s):
        lo, hi = sorted([s, s * 2], key=float) if np.asarray(s).dtype.kind != "u" else (s, s * 2)
        arithmetic = [t + s, s + t, t - s, s - t, t * s, s * t, t / s, s / t, t < s, s < t, t <= s, s <= t]
        arithmetic += [t > s, s > t, t >= s, s >= t, b.where(t > s, t, s), b.where(t < s, s, t), t.clip(lo, hi)]
        if np.dtype(dtype).kind == "f":
            arithmetic += [abs(t) ** s, s ** (t * 0.25)]
        return arithmetic

    for device in (gpu, ref):
        for value, number in ((v, python_number(v)) for v in scalars):
            got = run(device, [data], lambda b, t, s=value: expressions(b, t, s))
            want = run(device, [data], lambda b, t, s=number: expressions(b, t, s))
            for index, (a, b) in enumerate(zip(got, want)):
                assert a.dtype == b.dtype, (index, value)
                np.testing.assert_array_equal(a, b, err_msg=f"expression {index} with {value!r}")


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (np.int32, np.int64(2**40)),
        (np.int32, np.uint32(2**32 - 1)),
        (np.uint32, np.int32(-1)),
        (np.uint32, np.int64(-(2**40))),
        (np.float32, np.float64(1e300)),
        (np.float16, np.float32(1e6)),
        (np.float32, np.float64(1e-300)),
        (np.int32, np.float64(2.5)),
        (np.int32, np.float64(np.nan)),
        (np.uint32, np.float32(-np.inf)),
        (np.float16, np.float64(-0.0)),
    ],
    ids=repr,
)
def test_numpy_scalars_out_of_range_follow_the_python_number(ref, dtype, value):
    """What a Python number does in an op of a tensor (refused out of an integer dtype's range, rounded to
    the float dtype, float scalars promoting integer tensors), its numpy scalar and 0-d array do too."""
    data = random_array(np.random.default_rng(12), (6,), dtype)
    for given in (value, np.asarray(value)):
        outcomes = []
        for scalar in (given, python_number(given)):
            batch = bg.GpuCommandBatch(ref)
            t = batch.upload(data)
            try:
                with np.errstate(over="ignore"):
                    out = batch.mul(t, scalar)
                batch.execute()
                outcomes.append(batch.read(out))
            except bg.BatchError as exc:
                outcomes.append((type(exc), str(exc)))
        if isinstance(outcomes[1], np.ndarray):
            assert isinstance(outcomes[0], np.ndarray) and outcomes[0].dtype == outcomes[1].dtype, outcomes[0]
            np.testing.assert_array_equal(outcomes[0], outcomes[1])
            np.testing.assert_array_equal(np.signbit(outcomes[0]), np.signbit(outcomes[1]))
        else:
            assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize(
    "bad",
    [np.bool_(True), np.asarray(False), True, np.complex64(1 + 2j), 1j, np.timedelta64(3), np.str_("2"), "2"],
    ids=repr,
)
def test_scalars_that_are_not_numbers_are_refused(ref, bad):
    """bools (Python's and numpy's), complex numbers, timedeltas and strings: ArgumentError naming the
    operand, in ops and where, nothing recorded, the batch still works."""
    batch = bg.GpuCommandBatch(ref)
    x = random_array(np.random.default_rng(13), (5,), np.float32)
    t = batch.upload(x)
    mask = t > 0
    ops = len(batch)
    for record in (lambda: batch.add(t, bad), lambda: bad * t, lambda: batch.where(mask, t, bad)):
        with pytest.raises(bg.ArgumentError, match=r"(b|a) must be a Tensor or a number"):
            record()
        assert len(batch) == ops
    out = t * np.float32(2)
    batch.execute()
    np.testing.assert_array_equal(batch.read(out), x * 2)


def test_arrays_with_dimensions_are_still_refused_and_numpy_inputs_unchanged(ref):
    """1-d and (1,)-shaped arrays stay refused (upload them); numpy ints still give shapes, numpy scalars
    still feed 0-d inputs and per-execute scalars, a 0-d float array makes a float32 constant."""
    batch = bg.GpuCommandBatch(ref)
    t = batch.upload(np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    for bad in (np.ones(3, np.float32), np.ones(1, np.float32), [1.0]):
        with pytest.raises(bg.ArgumentError, match=r"not a Tensor; upload it first"):
            t * bad
    half = batch.upload(np.float32(0.5))
    pos = batch.scalar("pos", "i32")
    shaped = batch.reshape(t * half, (np.int64(3), np.int32(2)))
    filled = batch.full(np.int64(2), np.asarray(2.5))
    assert filled.dtype == np.float32  # was int32 holding 2
    batch.execute({half: np.float32(0.25)}, scalars={"pos": np.int64(4)})
    np.testing.assert_array_equal(batch.read(shaped), np.arange(1, 7, dtype=np.float32).reshape(3, 2) * 0.25)
    np.testing.assert_array_equal(batch.read(filled), [2.5, 2.5])
    assert pos.name == "pos"


def test_per_execute_scalars_take_the_numbers_ops_take(ref):
    """``execute(scalars=...)`` values: numpy scalars and 0-d arrays as their Python number; bools,
    timedeltas, numeric strings and arrays with dimensions refused with DTypeError, the batch unharmed."""
    batch = bg.GpuCommandBatch(ref)
    batch.scalar("pos", "i32")
    batch.scalar("temperature", "f32")
    t = batch.upload(random_array(np.random.default_rng(14), (3,), np.float32))
    out = t * 2.0
    accepted = [
        ({"pos": np.int64(3), "temperature": np.float32(0.5)}, (3, 0.5)),
        ({"pos": np.asarray(4), "temperature": np.asarray(0.25)}, (4, 0.25)),  # pos was refused
        ({"pos": np.uint32(5), "temperature": np.int32(2)}, (5, 2.0)),
    ]
    for scalars, values in accepted:
        batch.execute(scalars=scalars)
        assert tuple(batch.view().scalar_values.values()) == values
    refused = [np.True_, np.timedelta64(3), np.str_("3"), np.ones(1, np.float32), np.complex64(1)]
    for bad in refused:  # f32 took all but the complex, the (1,) array with a TypeError
        for name in ("pos", "temperature"):
            with pytest.raises(bg.DTypeError, match=rf"execute: scalar {name!r}"):
                batch.execute(scalars={name: bad})
    with pytest.raises(bg.DTypeError, match=r"scalar 'pos' = 1358\d+ is out of range for i32"):
        batch.execute(scalars={"pos": 2**1100})  # was OverflowError: int too large to convert to float
    batch.execute()
    assert tuple(batch.view().scalar_values.values()) == (5, 2.0)
    np.testing.assert_array_equal(batch.read(out), batch.read(t) * 2)


def test_number_parameters_take_numpy_scalars_and_0d_arrays(ref):
    """eps, theta, scale: a numpy scalar or 0-d array is the number it holds; bools, timedeltas and ints
    too large for a float are refused with ArgumentError."""
    rng = np.random.default_rng(15)
    x, w = random_array(rng, (3, 8), np.float32), random_array(rng, (8,), np.float32)
    results = []
    for eps in (1e-2, np.float64(1e-2), np.asarray(1e-2), np.asarray([1e-2])[0]):
        results += run(ref, [x, w], lambda b, t, u, e=eps: b.rms_norm(t, u, e))
    for got in results[1:]:
        np.testing.assert_array_equal(got, results[0])
    batch = bg.GpuCommandBatch(ref)
    t, u = batch.upload(x), batch.upload(w)
    for bad in (np.True_, np.timedelta64(1), np.ones(1), 2**1100):  # the timedelta was 1.0, 2**1100 OverflowError
        with pytest.raises(bg.ArgumentError, match=r"rms_norm: eps"):
            batch.rms_norm(t, u, bad)
    assert len(batch) == 0
