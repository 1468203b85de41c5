"""Reductions (sum, mean, max over axes) and softmax. A reduction over one contiguous run of axes is
seen as (outer, r, inner): rows (inner == 1) reduce with one workgroup per row in workgroup memory,
columns with one thread per output. Other axis sets are first permuted into a scratch buffer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import compute_dtype
from ..kernels import DEFAULT_WORKGROUP, Launch, pack_params, wgsl_aliases
from ..tensor import Storage, Tensor, contiguous_strides
from .common import check_rank, groups_for, reads, uniform, writes
from .layout import strided_copy
from .spec import Node, OpSpec, check_dtype, normalize_axis

REDUCE_OPS = {"sum": 0, "max": 1, "mean": 0}


def reduce_axes(op: str, x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    """Sorted, normalized, unique axes; None means all."""
    if axis is None:
        return tuple(range(x.ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    normalized = sorted({normalize_axis(op, a, x.ndim, x) for a in axes})
    if len(normalized) != len(axes):
        from ..errors import ShapeError

        raise ShapeError(f"{op}: repeated axis in {axis!r} for {x.describe()}")
    return tuple(normalized)


def three_way(shape: tuple[int, ...], first: int, last: int) -> tuple[int, int, int]:
    """(outer, r, inner) extents when axes first..last (inclusive) are reduced."""
    return math.prod(shape[:first]), math.prod(shape[first : last + 1]), math.prod(shape[last + 1 :])


def _reduce_spec(name: str) -> OpSpec:
    def infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
        (x,) = inputs
        check_dtype(name, "float" if name == "mean" else "all", x)
        check_rank(name, x)
        axes = reduce_axes(name, x, params.get("axis"))
        keep = params.get("keepdims", False)
        shape = tuple(1 if d in axes else e for d, e in enumerate(x.shape) if keep or d not in axes)
        return shape, x.dtype

    def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
        x = arrays[0]
        axes = reduce_axes(name, _Meta(x.shape), params.get("axis"))
        keep = params.get("keepdims", False)
        if name == "max":
            return np.max(x, axis=axes, keepdims=keep)
        total = np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)
        return total / math.prod(x.shape[a] for a in axes) if name == "mean" else total

    return OpSpec(
        name=name,
        infer=infer,
        reference=reference,
        lower=lambda node: _reduce_lower(node, name),
        dtypes="float" if name == "mean" else "all",
        doc=f"{name} over axis (int, tuple or None), keepdims",
    )


class _Meta:
    """Just enough of a tensor for axis normalization in the reference."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.ndim = len(shape)

    def describe(self) -> str:
        return f"array of shape {self.shape}"


def _reduce_lower(node: Node, name: str) -> list[Launch]:
    (x,), out = node.inputs, node.output
    axes = reduce_axes(name, x, node.params.get("axis"))
    launches: list[Launch] = []
    source: Tensor = x
    if axes and axes != tuple(range(axes[0], axes[-1] + 1)):
        source, launch = _move_axes_last(node, x, axes)
        launches.append(launch)
        axes = tuple(range(x.ndim - len(axes), x.ndim))
    if not axes:
        outer, r, inner = x.size, 1, 1
    else:
        outer, r, inner = three_way(source.shape, axes[0], axes[-1])
    launches.append(
        row_or_column_launch(
            name, "reduce", source, out.storage, out.dtype, outer, r, inner,
            constants=(("OP", REDUCE_OPS[name]), ("MEAN", name == "mean")),
        )
    )
    return launches


def _move_axes_last(node: Node, x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Launch]:
    order = tuple(d for d in range(x.ndim) if d not in axes) + axes
    shape = tuple(x.shape[d] for d in order)
    storage = node.new_scratch(x.nbytes, x.dtype)
    scratch = Tensor(shape, x.dtype, storage, device=x.device, batch=x.batch, name=f"{node.spec.name}.permuted")
    strides = contiguous_strides(x.shape)
    launch = strided_copy(
        node.spec.name, x, storage, x.dtype, shape, 0, tuple(strides[d] for d in order), 0, contiguous_strides(shape)
    )
    return scratch, launch


def row_or_column_launch(
    label: str,
    family: str,
    x: Tensor,
    out: Storage,
    out_dtype: np.dtype,
    outer: int,
    r: int,
    inner: int,
    constants: tuple[tuple[str, float], ...] = (),
) -> Launch:
    """A launch of ``family``'s ``*_rows`` entry (one workgroup per row) or ``*_cols`` entry."""
    params = pack_params((outer, r, inner, 1.0 / r), "IIIf")
    rows = inner == 1
    accumulator_bytes = compute_dtype(x.dtype).itemsize
    return Launch(
        label=label,
        family=family,
        entry=f"{family}_rows" if rows else f"{family}_cols",
        types=wgsl_aliases(A=x.dtype, O=out_dtype),
        constants=constants,
        groups=outer if rows else groups_for(outer * inner),
        bindings=(reads(0, x), writes(1, out), uniform(2, params)),
        params=params,
        workgroup_bytes=DEFAULT_WORKGROUP * accumulator_bytes if rows else 0,
    )


# softmax ---------------------------------------------------------------------------------------


def _softmax_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    check_dtype("softmax", "float", x)
    normalize_axis("softmax", params.get("axis", -1), x.ndim, x)
    return x.shape, x.dtype


def _softmax_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    x = arrays[0]
    axis = params.get("axis", -1)
    shifted = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return shifted / np.sum(shifted, axis=axis, keepdims=True)


def _softmax_lower(node: Node) -> list[Launch]:
    (x,), out = node.inputs, node.output
    axis = normalize_axis("softmax", node.params.get("axis", -1), x.ndim, x)
    outer, r, inner = three_way(x.shape, axis, axis)
    return [row_or_column_launch("softmax", "softmax", x, out.storage, out.dtype, outer, r, inner)]


SOFTMAX = OpSpec(
    name="softmax",
    infer=_softmax_infer,
    reference=_softmax_reference,
    lower=_softmax_lower,
    dtypes="float",
    doc="numerically stable softmax along axis (default -1)",
)

SPECS: list[OpSpec] = [_reduce_spec(n) for n in REDUCE_OPS] + [SOFTMAX]
