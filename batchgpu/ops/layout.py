"""Layout ops: reshape (a free view), permute/transpose, slice and concat (strided copies)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ShapeError
from ..kernels import Launch, wgsl_aliases
from ..tensor import Storage, Tensor, contiguous_strides
from .common import check_rank, collapse, groups_for
from .interface import COPY
from .spec import Node, OpSpec, normalize_axis, same_dtype


def strided_copy(
    label: str,
    src: Tensor,
    dst: Storage,
    dst_dtype: np.dtype,
    shape: tuple[int, ...],
    src_base: int,
    src_strides: tuple[int, ...],
    dst_base: int,
    dst_strides: tuple[int, ...],
) -> Launch:
    """A launch copying the ``shape`` region of ``src`` into ``dst`` through element strides."""
    shape, (src_strides, dst_strides) = collapse(shape, src_strides, dst_strides)
    count = math.prod(shape)
    return COPY.launch(
        label=label,
        entry="strided_copy",
        types=wgsl_aliases(A=src.dtype, O=dst_dtype),
        groups=groups_for(count),
        params=dict(
            n=count,
            ndim=len(shape),
            src_base=src_base,
            dst_base=dst_base,
            shape=shape,
            src_strides=src_strides,
            dst_strides=dst_strides,
        ),
        buffers=dict(src=src, dst=dst),
    )


# reshape ---------------------------------------------------------------------------------------


def _reshape_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    if not all(isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in params["shape"]):
        raise ShapeError(f"reshape: target shape {tuple(params['shape'])!r} for {x.describe()} must be ints")
    shape = tuple(int(s) for s in params["shape"])
    unknown = [i for i, s in enumerate(shape) if s == -1]
    if len(unknown) > 1 or any(s < -1 for s in shape):
        raise ShapeError(f"reshape: invalid target shape {shape} for {x.describe()}")
    if unknown:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or x.size % known:
            raise ShapeError(f"reshape: cannot reshape {x.describe()} ({x.size} elements) to {shape}")
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if math.prod(shape) != x.size:
        raise ShapeError(
            f"reshape: cannot reshape {x.describe()} ({x.size} elements) to {shape} ({math.prod(shape)} elements)"
        )
    return shape, x.dtype


RESHAPE = OpSpec(
    name="reshape",
    infer=_reshape_infer,
    reference=lambda arrays, params: None,
    view=True,
    doc="same data, new shape (a free view: no copy, no launch)",
)


# permute / transpose ---------------------------------------------------------------------------


def _axes(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[int, ...]:
    (x,) = inputs
    axes = params.get("axes")
    if axes is None:
        return tuple(reversed(range(x.ndim)))
    normalized = tuple(normalize_axis("permute", a, x.ndim, x) for a in axes)
    if sorted(normalized) != list(range(x.ndim)):
        raise ShapeError(f"permute: axes {tuple(axes)} are not a permutation of {x.ndim} dims of {x.describe()}")
    return normalized


def _permute_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    check_rank("permute", x)
    return tuple(x.shape[a] for a in _axes(inputs, params)), x.dtype


def _permute_lower(node: Node) -> list[Launch]:
    (x,), out = node.inputs, node.output
    axes = _axes(node.inputs, node.params)
    strides = contiguous_strides(x.shape)
    src_strides = tuple(strides[a] for a in axes)
    return [
        strided_copy("permute", x, out.storage, out.dtype, out.shape, 0, src_strides, 0, contiguous_strides(out.shape))
    ]


PERMUTE = OpSpec(
    name="permute",
    infer=_permute_infer,
    reference=lambda arrays, params: np.ascontiguousarray(np.transpose(arrays[0], params.get("axes"))),
    lower=_permute_lower,
    doc="reorder axes (numpy.transpose); transpose(x) reverses them",
)


# slice -----------------------------------------------------------------------------------------


def slice_plan(x: Tensor, key: Any) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """Output shape, base offset and element strides of ``x[key]`` (ints, slices, one Ellipsis)."""
    key = key if isinstance(key, tuple) else (key,)
    for k in key:
        if not (
            k is Ellipsis or isinstance(k, slice) or (isinstance(k, (int, np.integer)) and not isinstance(k, bool))
        ):
            raise ShapeError(f"slice: unsupported index {k!r:.60} (ints, slices and ... only) for {x.describe()}")
    if sum(k is Ellipsis for k in key) > 1:
        raise ShapeError(f"slice: at most one Ellipsis is allowed, got {key!r} for {x.describe()}")
    if any(k is Ellipsis for k in key):
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        fill = x.ndim - (len(key) - 1)
        key = key[:at] + (slice(None),) * fill + key[at + 1 :]
    if len(key) > x.ndim:
        raise ShapeError(f"slice: {len(key)} indices for {x.describe()} with {x.ndim} dims")
    key = key + (slice(None),) * (x.ndim - len(key))
    strides = contiguous_strides(x.shape)
    shape: list[int] = []
    out_strides: list[int] = []
    base = 0
    for axis, (k, extent, stride) in enumerate(zip(key, x.shape, strides)):
        if isinstance(k, slice):
            if k.step == 0:
                raise ShapeError(f"slice: step 0 in {k!r} for axis {axis} of {x.describe()}; steps must be non-zero")
            start, stop, step = k.indices(extent)
            shape.append(len(range(start, stop, step)))
            out_strides.append(stride * step)
            base += start * stride if shape[-1] else 0
        elif isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_)):
            if not -extent <= k < extent:
                raise ShapeError(f"slice: index {k} is out of range for axis {axis} of {x.describe()}")
            base += (int(k) % extent) * stride
        else:
            raise ShapeError(f"slice: unsupported index {k!r} (ints, slices and ... only) for {x.describe()}")
    return tuple(shape), base, tuple(out_strides)


def _slice_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    check_rank("slice", x)
    shape, _, _ = slice_plan(x, params["key"])
    if math.prod(shape) == 0:
        raise ShapeError(f"slice: {params['key']!r} selects no elements of {x.describe()}")
    return shape, x.dtype


def _slice_lower(node: Node) -> list[Launch]:
    (x,), out = node.inputs, node.output
    shape, base, strides = slice_plan(x, node.params["key"])
    return [strided_copy("slice", x, out.storage, out.dtype, shape, base, strides, 0, contiguous_strides(shape))]


SLICE = OpSpec(
    name="slice",
    infer=_slice_infer,
    reference=lambda arrays, params: np.ascontiguousarray(arrays[0][params["key"]]),
    lower=_slice_lower,
    doc="x[key] with ints, slices (any step) and Ellipsis, as a new tensor",
)


# concat ----------------------------------------------------------------------------------------


def _concat_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    if not inputs:
        raise ShapeError("concat: needs at least one tensor")
    first = inputs[0]
    dtype = same_dtype("concat", inputs, [f"tensors[{i}]" for i in range(len(inputs))])
    axis = normalize_axis("concat", params["axis"], first.ndim, first)
    check_rank("concat", first)
    for i, t in enumerate(inputs[1:], start=1):
        if t.ndim != first.ndim or any(a != b for d, (a, b) in enumerate(zip(t.shape, first.shape)) if d != axis):
            raise ShapeError(
                f"concat: tensors[{i}] {t.describe()} does not match tensors[0] {first.describe()} outside axis {axis}"
            )
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in inputs)
    return tuple(shape), dtype


def _concat_lower(node: Node) -> list[Launch]:
    out = node.output
    axis = normalize_axis("concat", node.params["axis"], out.ndim, out)
    out_strides = contiguous_strides(out.shape)
    launches = []
    offset = 0
    for x in node.inputs:
        launches.append(
            strided_copy(
                "concat",
                x,
                out.storage,
                out.dtype,
                x.shape,
                0,
                contiguous_strides(x.shape),
                offset * out_strides[axis],
                out_strides,
            )
        )
        offset += x.shape[axis]
    return launches


CONCAT = OpSpec(
    name="concat",
    infer=_concat_infer,
    reference=lambda arrays, params: np.concatenate(arrays, axis=params["axis"]),
    lower=_concat_lower,
    doc="join tensors along an existing axis (numpy.concatenate)",
)

SPECS: list[OpSpec] = [RESHAPE, PERMUTE, SLICE, CONCAT]
