"""The paged KV cache (vLLM's PagedAttention): ``scatter_rows`` writes rows into a table in place (new keys
and values into the pool rows a step chose), ``paged_attention`` attends over each query row's positions
through its sequence's block table. Both run kernels of the attention family; paged attention splits the
positions over blocks of rows like ``attention`` (flash-decoding: partials, merge, combine)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import INT32
from ..errors import ArgumentError, BatchError, DTypeError, LimitError, ShapeError
from ..kernels import Launch
from ..tensor import Tensor
from .attention import (
    ATTENTION_WORKGROUP,
    Buffers,
    attention_scale,
    check_heads,
    check_scale,
    check_window,
    family_launch,
    family_params,
    index_vector,
    over_blocks,
    rows_launch,
    split_rows,
)
from .common import groups_for
from .spec import Node, OpSpec, check_dtype, same_dtype

I32_MAX = 2**31 - 1

# scatter_rows ------------------------------------------------------------------------------------


def _scatter_rows_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[None, None]:
    table, rows, values = inputs
    if table.storage is values.storage or table.storage is rows.storage:
        raise BatchError(f"scatter_rows: table {table.describe()} shares its buffer with values or rows")
    if rows.dtype != INT32:
        raise DTypeError(f"scatter_rows: rows {rows.describe()} must be int32 (target rows), got {rows.dtype.name}")
    if rows.ndim != 1:
        raise ShapeError(f"scatter_rows: rows {rows.describe()} must be 1-D: one target row per row of values")
    if table.ndim < 1:
        raise ShapeError(f"scatter_rows: table {table.describe()} must have at least one dim (its rows)")
    if values.shape != (rows.shape[0], *table.shape[1:]):
        raise ShapeError(
            f"scatter_rows: values {values.describe()} must have shape {(rows.shape[0], *table.shape[1:])}: one row "
            f"of table {table.describe()} per entry of rows {rows.describe()}"
        )
    same_dtype("scatter_rows", (table, values), ("table", "values"))
    if table.shape[0] > I32_MAX:
        raise LimitError(f"scatter_rows: table {table.describe()} has more than 2**31 - 1 rows")
    return None, None


def _scatter_rows_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> None:
    table, rows, values = arrays
    keep = (rows >= 0) & (rows < table.shape[0])
    table[rows[keep]] = values[keep]  # duplicate targets: one of them (numpy: the last)


def _scatter_rows_lower(node: Node) -> list[Launch]:
    table, rows, values = node.inputs
    width = math.prod(table.shape[1:])
    params = family_params(rows.shape[0], 0, 1, width, table.shape[0], 0, False, 0.0)
    buffers: Buffers = dict(src=values, dst=table, indices=rows)
    groups = groups_for(values.size, ATTENTION_WORKGROUP)
    return [family_launch(node, "scatter_rows", groups, buffers, params, position=False)]


SCATTER_ROWS = OpSpec(
    name="scatter_rows",
    infer=_scatter_rows_infer,
    reference=_scatter_rows_reference,
    lower=_scatter_rows_lower,
    inplace=(0,),
    literal_operands=False,
    doc="table[rows[i]] = values[i] in place for rows[i] in [0, len(table)); other rows[i] (-1: idle) skipped",
)


# paged_attention ---------------------------------------------------------------------------------
#
# Query row n (item = n * heads + head) of sequence s = seq[n] attends over positions [0, lengths[n]),
# position p being pool row block_tables[s, p // block_size] * block_size + p % block_size. One pass (one
# workgroup per item) when a sequence's max_blocks * block_size positions fit split_rows(head_dim), else
# paged_attention_partial over blocks of split_rows positions (a static count: blocks past a row's length
# contribute nothing) folded by attention's merge and combine passes. An invocation of either runs the loops
# of attention_partial over as many rows (the block-table lookup per position is no loop), so
# attention._rows_loops(split_rows(head_dim), head_dim) <= bounds.LOOP_BUDGET holds for them too: at
# head_dim 64, blocks of 2,048 positions (8,192 positions: 4 partials per (row, head), no merge pass).


def _paged_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    q, k, v, tables, seq, lengths = inputs
    op = "paged_attention"
    check_dtype(op, "float", q, "q")
    check_dtype(op, "float", k, "k_pool")
    same_dtype(op, (k, v), ("k_pool", "v_pool"))
    check_heads(op, q, k, v, ("q", "k_pool", "v_pool"))
    check_scale(op, params)
    check_window(op, params)
    if tables.dtype != INT32:
        raise DTypeError(f"{op}: block_tables {tables.describe()} must be int32, got {tables.dtype.name}")
    if tables.ndim != 2:
        raise ShapeError(f"{op}: block_tables {tables.describe()} must be 2-D (sequences, max_blocks)")
    rows = q.shape[0]
    index_vector(op, seq, "seq", rows, "the block-table row of each row of q")
    index_vector(op, lengths, "lengths", rows, "the positions each row of q attends over")
    block_size = params["block_size"]
    if isinstance(block_size, (bool, np.bool_)) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ArgumentError(f"{op}: block_size must be an int >= 1, got {block_size!r}")
    if tables.shape[1] * block_size > I32_MAX:
        raise LimitError(
            f"{op}: block_tables {tables.describe()} of {tables.shape[1]} blocks of {block_size} rows give "
            f"{tables.shape[1] * block_size} positions per sequence; at most 2**31 - 1 (int32 lengths)"
        )
    return q.shape, q.dtype


def pool_rows(table: np.ndarray, length: int, block_size: int, pool: int, window: int = 0) -> np.ndarray:
    """The pool rows of a sequence's positions [0, length) (clamped to its block table; with a ``window``,
    the last ``window`` of them) whose block is in a pool of ``pool`` rows, in position order: the rows a
    query of that length attends over."""
    count = min(max(int(length), 0), table.shape[0] * block_size)
    positions = np.arange(max(count - window, 0) if window else 0, count, dtype=np.int64)
    rows = table[positions // block_size].astype(np.int64) * block_size + positions % block_size
    return rows[(table[positions // block_size] >= 0) & (rows < pool)]


def _paged_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    """float64 per query row over its valid positions; a row with none (idle, sequence out of the table, all
    blocks out of the pool) gives zeros. Rows go together, their positions padded to the longest and masked
    (in groups that bound the padded keys' memory)."""
    q, k_pool, v_pool, tables, seq, lengths = arrays
    tokens, heads, head_dim = q.shape
    pool, kv_heads, _ = k_pool.shape
    scale = float(np.float32(attention_scale(params, head_dim)))  # the kernels scale in f32
    valid = (seq >= 0) & (seq < tables.shape[0])
    rows = [
        pool_rows(tables[seq[n]], lengths[n], params["block_size"], pool, params.get("window", 0))
        if valid[n]
        else _NO_ROWS
        for n in range(tokens)
    ]
    out = np.zeros(q.shape, np.float64)
    group = max(1, _PADDED_POSITIONS // max(1, max(r.size for r in rows)))
    for start in range(0, tokens, group):
        chunk = range(start, min(start + group, tokens))
        width = max(rows[n].size for n in chunk)
        if width == 0:
            continue
        gathered = np.zeros((len(chunk), width), np.int64)
        mask = np.zeros((len(chunk), width), bool)
        for i, n in enumerate(chunk):
            gathered[i, : rows[n].size], mask[i, : rows[n].size] = rows[n], True
        # (rows, kv_heads, group, head_dim) x (rows, kv_heads, head_dim, positions)
        queries = (
            q[chunk.start : chunk.stop].astype(np.float64).reshape(len(chunk), kv_heads, heads // kv_heads, head_dim)
        )
        keys = k_pool[gathered].astype(np.float64).transpose(0, 2, 3, 1)
        values = v_pool[gathered].astype(np.float64).transpose(0, 2, 1, 3)
        scores = np.where(mask[:, None, None, :], (queries @ keys) * scale, -np.inf)
        top = scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
        total = weights.sum(axis=-1, keepdims=True)
        attended = (weights / np.where(total > 0, total, 1.0)) @ values  # (rows, kv_heads, group, head_dim)
        out[chunk.start : chunk.stop] = attended.reshape(len(chunk), heads, head_dim)
    return out


_NO_ROWS = np.zeros(0, np.int64)
_PADDED_POSITIONS = 1 << 16  # rows x padded positions gathered at once by the reference


def _paged_lower(node: Node) -> list[Launch]:
    q, k, v, tables, seq, lengths = node.inputs
    tokens, heads, head_dim = q.shape
    positions = tables.shape[1] * node.params["block_size"]
    buffers: Buffers = dict(src=q, keys=k, values=v, indices=seq, lengths=lengths, block_tables=tables)
    rows = split_rows(head_dim)
    if positions > rows:
        return over_blocks(
            node,
            "paged_attention_partial",
            rows,
            positions,
            buffers,
            lambda **split: _paged_params(node, **split),
            position=False,
            native_shared=True,
        )
    params = _paged_params(node, split_rows=positions)
    buffers["dst"] = node.output
    launch = rows_launch(
        node, "paged_attention", tokens * heads, buffers, params, positions, position=False, native_shared=True
    )
    return [launch]


def _paged_params(node: Node, **split: int) -> dict[str, Any]:
    q, k, _, tables, _, _ = node.inputs
    tokens, heads, head_dim = q.shape
    pool, kv_heads, _ = k.shape
    sequences, max_blocks = tables.shape
    scale = attention_scale(node.params, head_dim)
    return family_params(
        tokens,
        heads,
        kv_heads,
        head_dim,
        pool,
        0,
        False,
        scale,
        block_size=node.params["block_size"],
        max_blocks=max_blocks,
        sequences=sequences,
        window=node.params.get("window", 0),
        **split,
    )


PAGED_ATTENTION = OpSpec(
    name="paged_attention",
    infer=_paged_infer,
    reference=_paged_reference,
    lower=_paged_lower,
    dtypes="float",
    literal_operands=False,
    doc="grouped-query attention of each row n of q over positions [0, lengths[n]) of sequence seq[n], stored in "
    "pool rows through its block table; with a window, over its last window of them",
)

SPECS: list[OpSpec] = [SCATTER_ROWS, PAGED_ATTENTION]
