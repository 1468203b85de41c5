"""Row gathers: embedding lookup by int32 ids, and argmax (greedy sampling)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import INT32
from ..errors import DTypeError, ShapeError
from ..kernels import DEFAULT_WORKGROUP, Binding, Launch, pack_struct, wgsl_aliases
from ..tensor import QuantTensor, Tensor
from .common import groups_for, reads, uniform, writes
from .reduce import move_axes_last
from .spec import Node, OpSpec, normalize_axis


def _embedding_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    ids, table = inputs
    if ids.dtype != INT32:
        raise DTypeError(f"embedding: ids {ids.describe()} must be int32, got {ids.dtype.name}")
    if table.ndim != 2:
        raise ShapeError(f"embedding: table {table.describe()} must be 2-D (rows, width)")
    return (*ids.shape, table.shape[1]), table.dtype


def _embedding_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    ids, table = arrays
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = table[np.where(valid, ids, 0)]
    return np.where(valid[..., None], rows, 0).astype(table.dtype)


def _embedding_lower(node: Node) -> list[Launch]:
    ids, table = node.inputs
    out = node.output
    params = pack_struct("IIII", ids.size, table.shape[1], table.shape[0], 0)
    if isinstance(table, QuantTensor):
        entry, table_binding = f"embedding_{table.qtype}", reads(5, table)
    else:
        entry, table_binding = "embedding", reads(1, table)
    return [
        Launch(
            label="embedding",
            family="gather",
            entry=entry,
            types=wgsl_aliases(A=table.dtype, O=out.dtype),
            groups=groups_for(out.size),
            bindings=(reads(0, ids), table_binding, writes(2, out.storage), uniform(3, params)),
            params=params,
        )
    ]


EMBEDDING = OpSpec(
    name="embedding",
    infer=_embedding_infer,
    reference=_embedding_reference,
    lower=_embedding_lower,
    doc="table[ids] for int32 ids of any shape (ids outside the table give zero rows)",
    quantized=(1,),  # the table may be quantized weights (QuantTensor)
)


def _argmax_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    axis = normalize_axis("argmax", params.get("axis", -1), x.ndim, x)
    return tuple(e for d, e in enumerate(x.shape) if d != axis), INT32


def _argmax_lower(node: Node) -> list[Launch]:
    (x,) = node.inputs
    axis = normalize_axis("argmax", node.params.get("axis", -1), x.ndim, x)
    launches = []
    source = x
    if axis != x.ndim - 1:
        source, launch = move_axes_last(node, x, (axis,))
        launches.append(launch)
    width = x.shape[axis]
    rows = x.size // width
    params = pack_struct("IIII", rows, width, 0, 0)
    out = node.output.storage
    launches.append(
        Launch(
            label="argmax",
            family="gather",
            entry="argmax_rows",
            types=wgsl_aliases(A=x.dtype, O=x.dtype),
            groups=rows,
            bindings=(reads(1, source), uniform(3, params), Binding(4, "write", out, out.nbytes)),
            params=params,
            workgroup_bytes=DEFAULT_WORKGROUP * 8,
        )
    )
    return launches


ARGMAX = OpSpec(
    name="argmax",
    infer=_argmax_infer,
    reference=lambda arrays, params: np.argmax(arrays[0], axis=params.get("axis", -1)).astype(np.int32),
    lower=_argmax_lower,
    doc="int32 index of the first maximum along axis (default -1)",
)

SPECS: list[OpSpec] = [EMBEDDING, ARGMAX]
