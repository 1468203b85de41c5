"""The numpy / torch surface of a tensor: operators, methods, new-axis indexing, constants, mixed-dtype
promotion and the new elementwise ops (pow, sin, cos, floor, ceil, round, erf, comparisons as uint32
masks), each against numpy on random data (never zeros) on every executor (the wgpu device here, the CUDA
sources on the CPU harness through DEVICE_SUITES, the reference in ``ref``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import batchgpu as bg

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
