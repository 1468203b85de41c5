"""Reductions (sum, mean, max over axes) and softmax. A reduction over one contiguous run of axes is
seen as (outer, r, inner): rows (inner == 1) reduce with one workgroup per row in workgroup memory (rows
longer than ``bounds.ROW_CHUNK`` in pieces, whose partial results another pass combines), columns with one
thread per output. Other axis sets, and columns longer than ``bounds.COLUMN_LIMIT``, are first permuted
into a scratch buffer."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import FLOAT32, compute_dtype
from ..kernels import Launch, wgsl_aliases
from ..tensor import Storage, Tensor, contiguous_strides
from . import bounds, interface
from .common import check_rank, groups_for
from .interface import FAMILIES, OP_MAX, OP_SUM
from .layout import strided_copy
from .spec import Node, OpSpec, check_dtype, normalize_axis

REDUCE_OPS = {"sum": OP_SUM, "max": OP_MAX, "mean": OP_SUM}


def reduce_axes(op: str, x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    """Sorted, normalized, unique axes; None means all."""
    if axis is None:
        return tuple(range(x.ndim))
    axes = tuple(axis) if np.iterable(axis) else (axis,)  # a float axis is refused below, not iterated
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
    if not axes:
        return [_reduce_launch(name, x, out.storage, out.dtype, x.size, 1, 1, 1.0)]
    outer, r, inner = three_way(x.shape, axes[0], axes[-1])
    launches: list[Launch] = []
    source = x
    contiguous_run = axes == tuple(range(axes[0], axes[-1] + 1))
    if not contiguous_run or (inner > 1 and r > bounds.COLUMN_LIMIT):
        source, launch = move_axes_last(node, x, axes)
        launches.append(launch)
        r = math.prod(x.shape[a] for a in axes)
        outer, inner = x.size // r, 1
    if inner > 1:
        return [*launches, _reduce_launch(name, source, out.storage, out.dtype, outer, r, inner, 1.0 / r)]
    return launches + _row_passes(node, name, source, outer, r)


def _row_passes(node: Node, name: str, source: Tensor, outer: int, r: int) -> list[Launch]:
    """Reduce (outer, r) rows, through partial sums of ROW_CHUNK elements while rows are long."""
    out = node.output
    scale = 1.0 / r
    launches = []
    while r > bounds.ROW_CHUNK:
        chunks = math.ceil(r / bounds.ROW_CHUNK)
        partial_dtype = compute_dtype(source.dtype)
        storage = node.new_scratch(outer * chunks * partial_dtype.itemsize, partial_dtype)
        op = "sum" if name == "mean" else name
        launches.append(_reduce_launch(op, source, storage, partial_dtype, outer, r, 1, 1.0, chunk=bounds.ROW_CHUNK))
        source = Tensor(
            (outer, chunks), partial_dtype, storage, device=source.device, batch=source.batch, name=f"{name}.partials"
        )
        r = chunks
    launches.append(_reduce_launch(name, source, out.storage, out.dtype, outer, r, 1, scale))
    return launches


def _reduce_launch(
    name: str,
    x: Tensor,
    out: Storage,
    out_dtype: np.dtype,
    outer: int,
    r: int,
    inner: int,
    scale: float,
    chunk: int = 0,
) -> Launch:
    return row_or_column_launch(
        name,
        "reduce",
        x,
        out,
        out_dtype,
        outer,
        r,
        inner,
        scale=scale,
        chunk=chunk or r,
        constants=(("OP", REDUCE_OPS[name]), ("MEAN", name == "mean"), ("IS_FLOAT", x.dtype.kind == "f")),
    )


def move_axes_last(node: Node, x: Tensor, axes: tuple[int, ...]) -> tuple[Tensor, Launch]:
    """Copy ``x`` into a scratch tensor whose last dims are ``axes``."""
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
    *,
    scale: float = 1.0,
    chunk: int = 0,
    constants: tuple[tuple[str, float], ...] = (),
) -> Launch:
    """A launch of ``family``'s ``*_rows`` entry (one workgroup per row chunk) or ``*_cols`` entry
    (one thread per output column). Rows of length ``r`` are cut into chunks of ``chunk``."""
    chunk = chunk or r
    chunks = math.ceil(r / chunk)
    rows = inner == 1
    declared = FAMILIES[family]
    return declared.launch(
        label=label,
        entry=f"{family}_rows" if rows else f"{family}_cols",
        types=wgsl_aliases(A=x.dtype, O=out_dtype),
        constants=constants,
        groups=outer * chunks if rows else groups_for(outer * inner),
        params=dict(outer=outer, r=r, inner=inner, scale=scale, chunk=chunk, chunks=chunks),
        buffers=dict(a=x, out=out),
        workgroup_bytes=declared.value("WG") * 4 if rows else 0,
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
    if inner == 1:
        return _softmax_rows(node, x, out.storage, outer, r)
    if r <= bounds.COLUMN_LIMIT:
        return [row_or_column_launch("softmax", "softmax", x, out.storage, out.dtype, outer, r, inner)]
    # Long columns: permute the axis last, softmax rows in scratch, permute back into the output.
    rows, to_rows = move_axes_last(node, x, (axis,))
    result = node.new_scratch(x.nbytes, x.dtype)
    back = _inverse_order(x.ndim, axis)
    strides = contiguous_strides(rows.shape)
    return [
        to_rows,
        *_softmax_rows(node, rows, result, x.size // r, r),
        strided_copy(
            "softmax",
            Tensor(rows.shape, x.dtype, result, device=x.device, batch=x.batch),
            out.storage,
            out.dtype,
            out.shape,
            0,
            tuple(strides[d] for d in back),
            0,
            contiguous_strides(out.shape),
        ),
    ]


def _softmax_rows(node: Node, x: Tensor, out: Storage, outer: int, r: int) -> list[Launch]:
    """Softmax of (outer, r) rows: one launch, or for rows longer than ROW_CHUNK two passes over pieces of
    it: per-piece (max, sum of exp(x - max)) partials, then each piece written from its row's partials."""
    if r <= bounds.ROW_CHUNK:
        return [row_or_column_launch("softmax", "softmax", x, out, x.dtype, outer, r, 1)]
    chunk = bounds.ROW_CHUNK
    chunks = math.ceil(r / chunk)
    partials = node.new_scratch(outer * chunks * 2 * FLOAT32.itemsize, FLOAT32)

    def launch(entry: str, **buffers: Storage) -> Launch:
        return interface.SOFTMAX.launch(
            label="softmax",
            entry=entry,
            types=wgsl_aliases(A=x.dtype, O=x.dtype),
            groups=outer * chunks,
            params=dict(outer=outer, r=r, inner=1, scale=1.0, chunk=chunk, chunks=chunks),
            buffers=dict(a=x, partials=partials, **buffers),
            workgroup_bytes=interface.SOFTMAX.value("WG") * 4,
        )

    return [launch("softmax_partials"), launch("softmax_chunks", out=out)]


def _inverse_order(ndim: int, axis: int) -> tuple[int, ...]:
    """For each output dim, the dim of the axis-last layout it comes from."""
    order = [d for d in range(ndim) if d != axis] + [axis]
    return tuple(order.index(d) for d in range(ndim))


SOFTMAX = OpSpec(
    name="softmax",
    infer=_softmax_infer,
    reference=_softmax_reference,
    lower=_softmax_lower,
    dtypes="float",
    doc="numerically stable softmax along axis (default -1)",
)

SPECS: list[OpSpec] = [_reduce_spec(n) for n in REDUCE_OPS] + [SOFTMAX]
