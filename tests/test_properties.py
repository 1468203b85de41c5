"""Property tests (issue 7): hypothesis draws random op graphs (chains and diamonds of 1 to 30 ops
over random shapes, broadcasting, Python scalars, float32 and int32), records each one on the wgpu
device and on the numpy reference device, and compares every output.

Profiles: the default (CI) runs ``DEFAULT_EXAMPLES`` graphs; ``BATCHGPU_HYPOTHESIS_PROFILE=long`` runs
``LONG_EXAMPLES``. Shrunk failures are kept as regular tests at the end of this file.

Value domains are kept by the graph itself: ``log``/``sqrt``/``rsqrt``/``div`` take ``abs(x) + 0.5``
built from recorded ops, and every float tensor carries a bound on its magnitude; an op whose result
could exceed ``BOUND`` is followed by a recorded ``tanh``, so nothing overflows and the comparison
stays meaningful. Float ops are all continuous (float-to-int casts, whose truncation turns a 1-ulp
difference into a whole unit, are not drawn; int32 graphs are exact, wrapping like numpy).

Tolerance (floats): each op may add a few ulps of the largest magnitude in its inputs' ancestry
(WGSL allows exp/log/tanh errors of several ulps, and sums reassociate), so an output built by ``n``
ops whose ancestry reached magnitude ``M`` must agree within ``ULPS_PER_OP * eps32 * n * max(M, 1)``,
absolute. Relative-to-magnitude, not per element: cancellation (``a - b`` of close values) makes
per-element relative error meaningless in long chains. int32 must match exactly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchgpu as bg

DEFAULT_EXAMPLES, LONG_EXAMPLES = 150, 5000
settings.register_profile(
    "default", max_examples=DEFAULT_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long", max_examples=LONG_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
PROFILE = os.environ.get("BATCHGPU_HYPOTHESIS_PROFILE", "default")

BOUND = 50.0
EPS32 = float(np.finfo(np.float32).eps)
ULPS_PER_OP = 32
F32, I32 = np.dtype(np.float32), np.dtype(np.int32)


@dataclass
class Value:
    """A tensor of the graph being drawn: shape, dtype, a bound on |value|, its op count and the
    largest bound in its ancestry."""

    shape: tuple[int, ...]
    dtype: np.dtype
    bound: float
    ops: int = 0
    scale: float = 1.0


@dataclass
class Program:
    inputs: list[np.ndarray] = field(default_factory=list)
    steps: list[tuple] = field(default_factory=list)  # (op, argument indices or literals, params)
    values: list[Value] = field(default_factory=list)

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        shapes = [(a.shape, a.dtype.name) for a in self.inputs]
        return f"Program(inputs={shapes}, steps={self.steps})"


def _shapes(draw) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))


def _broadcast_partner(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts against ``shape``: some dims set to 1, maybe leading dims dropped."""
    if not shape:
        return ()
    drop = draw(st.integers(0, len(shape) - 1))
    kept = shape[drop:]
    return tuple(1 if draw(st.booleans()) else extent for extent in kept)


class Builder:
    def __init__(self, draw) -> None:
        self.draw = draw
        self.p = Program()

    def add_input(self, shape: tuple[int, ...], dtype: np.dtype, scale: float = 2.0) -> int:
        seed = self.draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        if dtype == F32:
            data = (rng.standard_normal(shape) * scale).astype(F32)
            bound = float(np.abs(data).max())
        else:
            data = rng.integers(-50, 50, shape).astype(I32)
            bound = 50.0
        self.p.inputs.append(data)
        self.p.steps.append(("input", (len(self.p.inputs) - 1,), {}))
        self.p.values.append(Value(shape, dtype, bound, 0, max(bound, 1.0)))
        return len(self.p.values) - 1

    def step(self, op: str, args: tuple, params: dict, shape, dtype, bound: float) -> int:
        parents = [self.p.values[a] for a in args if isinstance(a, int) and not isinstance(a, bool)]
        ops = 1 + sum(v.ops for v in parents)
        scale = max([bound, 1.0] + [v.scale for v in parents])
        self.p.steps.append((op, args, params))
        self.p.values.append(Value(tuple(shape), np.dtype(dtype), bound, ops, scale))
        index = len(self.p.values) - 1
        if np.dtype(dtype) == F32 and bound > BOUND:
            index = self.step("tanh", (index,), {}, shape, dtype, 1.0)
        return index

    def positive(self, i: int) -> int:
        """abs(x) + 0.5, recorded: a safe log/sqrt/div operand."""
        v = self.p.values[i]
        a = self.step("abs", (i,), {}, v.shape, v.dtype, v.bound)
        return self.step("add", (a, ("scalar", 0.5)), {}, v.shape, v.dtype, v.bound + 0.5)

    def pick(self, dtype: np.dtype | None = None) -> int:
        candidates = [
            i
            for i, v in enumerate(self.p.values)
            if (dtype is None or v.dtype == dtype) and not (v.dtype == F32 and v.bound > BOUND)  # pre-tanh values
        ]
        # favor recent values (chains) but allow any earlier one (diamonds)
        return self.draw(st.sampled_from(candidates[::-1]))

    def grow(self) -> None:
        draw = self.draw
        i = self.pick()
        v = self.p.values[i]
        floaty = v.dtype == F32
        kinds = ["unary", "binary", "binary", "cast"] + (["reduce", "layout"] if v.shape else [])
        if floaty:
            kinds += ["float_unary", "float_unary", "domain"] + (["softmax"] if v.shape else [])
        if len(v.shape) == 2:
            kinds += ["matmul"]
        kind = draw(st.sampled_from(kinds))
        n = math.prod(v.shape)
        if kind == "unary":
            op = draw(st.sampled_from(["neg", "abs", "relu", "copy"]))
            self.step(op, (i,), {}, v.shape, v.dtype, v.bound)
        elif kind == "float_unary":
            op = draw(st.sampled_from(["exp", "tanh", "sigmoid", "gelu", "silu"]))
            bound = {"exp": math.exp(min(v.bound, 80.0)), "tanh": 1.0, "sigmoid": 1.0}.get(op, v.bound + 1.0)
            self.step(op, (i,), {}, v.shape, v.dtype, bound)
        elif kind == "domain":
            op = draw(st.sampled_from(["log", "sqrt", "rsqrt", "div"]))
            pos = self.positive(i)
            pv = self.p.values[pos]
            if op == "div":
                j = self.pick(F32)
                w = self.p.values[j]
                try:
                    fits = np.broadcast_shapes(w.shape, pv.shape) == pv.shape
                except ValueError:
                    fits = False
                if fits:
                    self.step("div", (j, pos), {}, pv.shape, F32, 2 * w.bound)
                else:
                    self.step("div", (("scalar", 1.5), pos), {}, pv.shape, F32, 3.0)
            else:
                bound = {"log": math.log(pv.bound) + 1, "sqrt": math.sqrt(pv.bound), "rsqrt": 1.5}[op]
                self.step(op, (pos,), {}, pv.shape, F32, bound)
        elif kind == "binary":
            op = draw(st.sampled_from(["add", "sub", "mul", "maximum", "minimum"]))
            partner = draw(st.sampled_from(["scalar", "pool", "fresh"]))
            if partner == "scalar":
                literal = draw(st.sampled_from([-1.5, 0.25, 2.0, 3.0])) if floaty else draw(st.integers(-3, 3))
                other_bound = abs(literal)
                args = (i, ("scalar", literal)) if draw(st.booleans()) else (("scalar", literal), i)
                shape = v.shape
            else:
                if partner == "pool":
                    j = self.pick(v.dtype)
                    w = self.p.values[j]
                    try:
                        shape = np.broadcast_shapes(v.shape, w.shape)
                    except ValueError:
                        j = None
                if partner == "fresh" or j is None:
                    j = self.add_input(_broadcast_partner(draw, v.shape), v.dtype)
                    shape = v.shape
                w = self.p.values[j]
                other_bound = w.bound
                args = (i, j) if draw(st.booleans()) else (j, i)
            bound = {"add": v.bound + other_bound, "sub": v.bound + other_bound, "mul": v.bound * other_bound}.get(
                op, max(v.bound, other_bound)
            )
            if not floaty:
                bound = 2.0**31
            self.step(op, args, {}, shape, v.dtype, bound)
        elif kind == "reduce":
            op = draw(st.sampled_from(["sum", "max", "mean"] if floaty else ["sum", "max"]))
            axis = draw(st.sampled_from([None, *range(len(v.shape)), -1]))
            keepdims = draw(st.booleans())
            expected = np.zeros(v.shape)
            shape = np.sum(expected, axis=axis, keepdims=keepdims).shape
            count = n if axis is None else v.shape[axis]
            bound = v.bound * count if op == "sum" else v.bound
            self.step(op, (i,), {"axis": axis, "keepdims": keepdims}, shape, v.dtype, bound)
        elif kind == "softmax":
            axis = draw(st.integers(-len(v.shape), len(v.shape) - 1))
            self.step("softmax", (i,), {"axis": axis}, v.shape, F32, 1.0)
        elif kind == "layout":
            if not v.shape:
                return self.step("copy", (i,), {}, v.shape, v.dtype, v.bound)
            op = draw(st.sampled_from(["reshape", "transpose", "slice", "concat"]))
            if op == "reshape":
                shape = draw(st.sampled_from([(n,), (1, n), v.shape[::-1] if len(v.shape) > 1 else (n, 1)]))
                if math.prod(shape) != n:
                    shape = (n,)
                self.step("reshape", (i,), {"shape": tuple(shape)}, shape, v.dtype, v.bound)
            elif op == "transpose":
                axes = tuple(draw(st.permutations(range(len(v.shape)))))
                shape = tuple(v.shape[a] for a in axes)
                self.step("transpose", (i,), {"axes": axes}, shape, v.dtype, v.bound)
            elif op == "slice":
                axis = draw(st.integers(0, len(v.shape) - 1))
                start = draw(st.integers(0, v.shape[axis] - 1))
                step = draw(st.integers(1, 2))
                key = tuple([slice(None)] * axis + [slice(start, None, step)])
                shape = np.zeros(v.shape)[key].shape
                self.step("slice", (i,), {"key": key}, shape, v.dtype, v.bound)
            else:
                axis = draw(st.integers(0, len(v.shape) - 1))
                others = [
                    j
                    for j, w in enumerate(self.p.values)
                    if w.dtype == v.dtype
                    and len(w.shape) == len(v.shape)
                    and not (w.dtype == F32 and w.bound > BOUND)
                    and all(a == b for k, (a, b) in enumerate(zip(w.shape, v.shape)) if k != axis)
                ]
                j = draw(st.sampled_from(others))
                shape = list(v.shape)
                shape[axis] += self.p.values[j].shape[axis]
                self.step(
                    "concat", ((i, j),), {"axis": axis}, tuple(shape), v.dtype, max(v.bound, self.p.values[j].bound)
                )
        elif kind == "cast":
            if floaty:  # float -> int truncation is discontinuous: go through int32 and back exactly
                j = self.add_input(v.shape, I32)
                c = self.step("cast", (j,), {"dtype": "float32"}, v.shape, F32, 50.0)
                self.step("add", (i, c), {}, v.shape, F32, v.bound + 50.0)
            else:
                self.step("cast", (i,), {"dtype": "float32"}, v.shape, F32, min(v.bound, 2.0**31))
        elif kind == "matmul":
            m, k = v.shape
            cols = draw(st.integers(1, 6))
            transpose_b = draw(st.booleans())
            j = self.add_input((cols, k) if transpose_b else (k, cols), v.dtype, scale=1 / math.sqrt(k))
            w = self.p.values[j]
            bound = v.bound * w.bound * k if floaty else 2.0**31
            self.step("matmul", (i, j), {"transpose_b": transpose_b}, (m, cols), v.dtype, bound)


@st.composite
def programs(draw) -> Program:
    builder = Builder(draw)
    builder.add_input(_shapes(draw), draw(st.sampled_from([F32, F32, I32])))
    if draw(st.booleans()):
        builder.add_input(_shapes(draw), F32)
    target = draw(st.integers(1, 30))
    while sum(1 for s in builder.p.steps if s[0] != "input") < target:
        builder.grow()
    return builder.p


def record(program: Program, dev: bg.Device) -> tuple[bg.GpuCommandBatch, list[bg.Tensor]]:
    batch = bg.GpuCommandBatch(dev)
    inputs = iter(program.inputs)
    tensors: list[bg.Tensor] = []

    def arg(a):
        if isinstance(a, tuple) and a and a[0] == "scalar":
            return a[1]
        if isinstance(a, tuple):
            return [tensors[j] for j in a]
        return tensors[a]

    for op, args, params in program.steps:
        if op == "input":
            tensors.append(batch.upload(next(inputs)))
        elif op == "reshape":
            tensors.append(batch.reshape(tensors[args[0]], params["shape"]))
        else:
            tensors.append(getattr(batch, op)(*(arg(a) for a in args), **params))
    return batch, tensors


def check(program: Program, gpu: bg.Device, ref: bg.Device, *, shared: bool = False) -> None:
    """Compare every value, or with ``shared`` declare every third value and the last as the batch's
    outputs on the GPU (the other intermediates then share buffers) and compare those."""
    results = []
    for dev in (gpu, ref):
        batch, tensors = record(program, dev)
        chosen = sorted({*range(0, len(tensors), 3), len(tensors) - 1}) if shared else range(len(tensors))
        if shared and dev is gpu:
            batch.outputs(*(tensors[i] for i in chosen))
        batch.execute()
        results.append([batch.read(tensors[i]) for i in chosen])
        batch.release()
    for index, got, want in zip(chosen, *results):
        value = program.values[index]
        assert got.shape == want.shape == value.shape, (index, got.shape, want.shape, value.shape)
        assert got.dtype == want.dtype == value.dtype, (index, got.dtype, want.dtype)
        if value.dtype == I32:
            np.testing.assert_array_equal(got, want, err_msg=f"value {index} ({program.steps[index][0]})")
            continue
        assert np.isfinite(want).all(), (index, "reference overflowed: the strategy's bounds are wrong")
        tolerance = ULPS_PER_OP * EPS32 * max(value.ops, 1) * value.scale
        error = float(np.abs(got.astype(np.float64) - want).max())
        assert error <= tolerance, (
            f"value {index} ({program.steps[index][0]}, {value.ops} ops, scale {value.scale:.3g}): "
            f"max |gpu - ref| = {error:.3g} > {tolerance:.3g}"
        )


@settings(settings.get_profile(PROFILE))
@given(program=programs())
def test_random_graphs_match_the_reference(gpu: bg.Device, ref: bg.Device, program: Program) -> None:
    check(program, gpu, ref)


@settings(settings.get_profile(PROFILE), max_examples=max(settings.get_profile(PROFILE).max_examples // 3, 1))
@given(program=programs())
def test_random_graphs_with_shared_buffers_match_the_reference(gpu: bg.Device, ref: bg.Device, program: Program):
    """The same graphs with declared outputs: intermediates share buffers on the GPU (batchgpu.memory)."""
    check(program, gpu, ref, shared=True)


# shrunk failures, kept as regular tests -------------------------------------------------------
# None so far: the only failures hypothesis shrank were bugs of this strategy (a broadcast partner of a
# 0-d tensor; diamonds reusing a value from before its bounding tanh, which overflowed in numpy too).
