"""Helpers the op families share: broadcast strides, group counts, rank checks."""

from __future__ import annotations

import math

from ..errors import ShapeError
from ..kernels import DEFAULT_WORKGROUP, MAX_DIMS
from ..tensor import Tensor, contiguous_strides


def groups_for(threads: int, workgroup: int = DEFAULT_WORKGROUP) -> int:
    return max(1, math.ceil(threads / workgroup))


def broadcast_strides(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous ``shape`` broadcast to ``out_shape`` (0 on broadcast dims)."""
    padded = (1,) * (len(out_shape) - len(shape)) + shape
    strides = contiguous_strides(padded)
    return tuple(0 if extent == 1 else stride for extent, stride in zip(padded, strides))


def check_rank(op: str, tensor: Tensor) -> None:
    if tensor.ndim > MAX_DIMS:
        raise ShapeError(f"{op}: {tensor.describe()} has {tensor.ndim} dims; at most {MAX_DIMS} are supported")


def collapse(shape: tuple[int, ...], *stride_sets: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Merge adjacent dims that are contiguous in every stride set, so index math loops less."""
    dims = [(extent, [s[i] for s in stride_sets]) for i, extent in enumerate(shape) if extent != 1]
    if not dims:
        return (1,), [(0,) for _ in stride_sets]
    merged = [dims[0]]
    for extent, strides in dims[1:]:
        prev_extent, prev_strides = merged[-1]
        if all(ps == s * extent for ps, s in zip(prev_strides, strides)):
            merged[-1] = (prev_extent * extent, strides)
        else:
            merged.append((extent, strides))
    out_shape = tuple(extent for extent, _ in merged)
    out_strides = [tuple(strides[k] for _, strides in merged) for k in range(len(stride_sets))]
    return out_shape, out_strides
