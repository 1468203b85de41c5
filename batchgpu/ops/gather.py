"""Row gathers: embedding lookup by int32 ids, and argmax (greedy sampling)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import INT32
from ..errors import DTypeError, ShapeError
from ..kernels import Launch, wgsl_aliases
from ..quant import kernel_entry
from ..tensor import QuantTensor, Storage, Tensor
from . import bounds
from .common import groups_for
from .interface import GATHER
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
    if isinstance(table, QuantTensor):
        (entry, snippets), table_binding = kernel_entry("embedding", table.qtype), "qtable"
    else:
        (entry, snippets), table_binding = ("embedding", ()), "table"
    return [
        GATHER.launch(
            label="embedding",
            entry=entry,
            snippets=snippets,
            types=wgsl_aliases(A=table.dtype, O=out.dtype),
            groups=groups_for(out.size),
            params=dict(count=ids.size, width=table.shape[1], rows=table.shape[0], chunk=0),
            buffers={"ids": ids, table_binding: table, "out": out},
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
    out = node.output.storage
    chunk = bounds.ROW_CHUNK
    if width <= chunk:
        return [*launches, _argmax_launch("argmax_rows", source, rows, width, width, rows, indices=out)]
    # Long rows: the best index of each piece into scratch, then one workgroup per row picks among them.
    chunks = math.ceil(width / chunk)
    candidates = node.new_scratch(rows * chunks * INT32.itemsize, INT32)
    return [
        *launches,
        _argmax_launch("argmax_rows", source, rows, width, chunk, rows * chunks, indices=candidates),
        _argmax_launch("argmax_candidates", source, rows, width, chunk, rows, indices=out, ids=candidates),
    ]


def _argmax_launch(entry: str, x: Tensor, rows: int, width: int, chunk: int, groups: int, **buffers: Storage) -> Launch:
    """A launch of an argmax entry over (rows, width) ``x`` taken in pieces of ``chunk`` elements."""
    return GATHER.launch(
        label="argmax",
        entry=entry,
        types=wgsl_aliases(A=x.dtype, O=x.dtype),
        constants=(("IS_FLOAT", x.dtype.kind == "f"),),
        groups=groups,
        params=dict(count=rows, width=width, rows=0, chunk=chunk),
        buffers=dict(table=x, **buffers),
        workgroup_bytes=GATHER.value("WG") * 8,  # a (value, index) pair per invocation
    )


ARGMAX = OpSpec(
    name="argmax",
    infer=_argmax_infer,
    reference=lambda arrays, params: np.argmax(arrays[0], axis=params.get("axis", -1)).astype(np.int32),
    lower=_argmax_lower,
    doc="int32 index of the first maximum along axis (default -1)",
)

SPECS: list[OpSpec] = [EMBEDDING, ARGMAX]
