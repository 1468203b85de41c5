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


def attended_rows(
    tables: np.ndarray, seq: np.ndarray, lengths: np.ndarray, block_size: int, pool: int, window: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """For query rows of sequences ``seq`` (their block-table rows; out of the table: none) attending over
    positions ``[0, lengths)`` (with a ``window``, the last ``window`` of them, clamped to the table), the
    pool rows of those positions in order, padded to the longest: ``(pool rows, valid)``, both (rows,
    positions); a position whose block is out of the pool (or negative) is not valid."""
    known = (seq >= 0) & (seq < tables.shape[0])
    counts = np.where(known, np.clip(lengths, 0, tables.shape[1] * block_size), 0).astype(np.int64)
    firsts = np.maximum(counts - window, 0) if window else np.zeros_like(counts)
    width = int((counts - firsts).max(initial=0))
    offsets = np.arange(width, dtype=np.int64)
    positions = firsts[:, None] + offsets[None, :]
    inside = offsets[None, :] < (counts - firsts)[:, None]
    blocks = tables[np.where(known, seq, 0)[:, None], np.minimum(positions // block_size, tables.shape[1] - 1)]
    rows = blocks.astype(np.int64) * block_size + positions % block_size
    valid = inside & (blocks >= 0) & (rows < pool)
    return np.where(valid, rows, 0), valid


def _paged_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    """float64 per query row over its valid positions; a row with none (idle, sequence out of the table, all
    blocks out of the pool) gives zeros. The rows of a sequence with several (a prompt piece) share its
    keys, gathered once; the other rows go together with rows attending over about as many positions (the
    same power of two), padded to the longest of their group and masked (groups bound the padded keys'
    memory)."""
    q, k_pool, v_pool, tables, seq, lengths = arrays
    scale = float(np.float32(attention_scale(params, q.shape[2])))  # the kernels scale in f32
    block_size, window = params["block_size"], params.get("window", 0)
    known = (seq >= 0) & (seq < tables.shape[0])
    counts = np.where(known, np.clip(lengths, 0, tables.shape[1] * block_size), 0).astype(np.int64)
    firsts = np.maximum(counts - window, 0) if window else np.zeros_like(counts)
    attending = counts > firsts  # the others stay zero
    values, repeats = np.unique(seq[attending], return_counts=True)
    shared = attending & np.isin(seq, values[repeats > 1])
    out = np.zeros(q.shape, np.float64)
    for sequence in values[repeats > 1]:
        rows = np.flatnonzero(shared & (seq == sequence))
        out[rows] = _attend_shared(q[rows], k_pool, v_pool, tables[sequence], firsts[rows], counts[rows], params)
    widths = np.where(attending & ~shared, counts - firsts, 0)
    levels = np.where(widths > 0, np.ceil(np.log2(np.maximum(widths, 1))), -1)
    for level in np.unique(levels[levels >= 0]):
        alike = np.flatnonzero(levels == level)
        size = max(1, _PADDED_POSITIONS // int(widths[alike].max()))
        for group in (alike[start : start + size] for start in range(0, alike.size, size)):
            rows, mask = attended_rows(tables, seq[group], lengths[group], block_size, k_pool.shape[0], window)
            queries = _grouped(q[group], k_pool.shape[1])  # (rows, kv_heads, group, head_dim)
            attended = np.empty(queries.shape)
            for head in range(k_pool.shape[1]):  # one kv head's keys at a time: contiguous (rows, positions, dim)
                keys = k_pool[:, head][rows].astype(np.float64)
                weights = _masked_softmax((queries[:, head] @ keys.transpose(0, 2, 1)) * scale, mask[:, None, :])
                attended[:, head] = weights @ v_pool[:, head][rows].astype(np.float64)
            out[group] = attended.reshape(q[group].shape)
    return out


def _attend_shared(
    q: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    table: np.ndarray,
    firsts: np.ndarray,
    counts: np.ndarray,
    params: dict[str, Any],
) -> np.ndarray:
    """The reference's attention of one sequence's query rows ``q`` (rows, heads, head_dim), row ``i`` over
    positions ``[firsts[i], counts[i])`` through its block-table row ``table``: its keys and values gathered
    once, each kv head's queries in one product (in slices of rows that bound the scores' memory)."""
    block_size, pool, kv_heads = params["block_size"], k_pool.shape[0], k_pool.shape[1]
    scale = float(np.float32(attention_scale(params, q.shape[2])))
    positions = np.arange(firsts.min(), counts.max(), dtype=np.int64)
    blocks = table[positions // block_size].astype(np.int64)
    rows = blocks * block_size + positions % block_size
    present = (blocks >= 0) & (rows < pool)
    keys = k_pool[np.where(present, rows, 0)].astype(np.float64).transpose(1, 2, 0)  # (kv_heads, dim, positions)
    values = v_pool[np.where(present, rows, 0)].astype(np.float64).transpose(1, 0, 2)  # (kv_heads, positions, dim)
    out = np.zeros(q.shape, np.float64)
    size = max(1, _SHARED_SCORES // (positions.size * q.shape[1]))
    for start in range(0, q.shape[0], size):
        part = slice(start, start + size)
        queries = _grouped(q[part], kv_heads)  # (rows, kv_heads, group, dim)
        n, _, group, dim = queries.shape
        scores = queries.transpose(1, 0, 2, 3).reshape(kv_heads, n * group, dim) @ keys * scale
        mask = present & (positions >= firsts[part, None]) & (positions < counts[part, None])  # (rows, positions)
        weights = _masked_softmax(scores.reshape(kv_heads, n, group, -1), mask[None, :, None, :])
        attended = weights.reshape(kv_heads, n * group, -1) @ values  # (kv_heads, rows * group, dim)
        out[part] = attended.reshape(kv_heads, n, group, dim).transpose(1, 0, 2, 3).reshape(q[part].shape)
    return out


def _grouped(q: np.ndarray, kv_heads: int) -> np.ndarray:
    """Query rows (rows, heads, dim) as float64 (rows, kv_heads, heads per kv head, dim)."""
    rows, heads, dim = q.shape
    return q.astype(np.float64).reshape(rows, kv_heads, heads // kv_heads, dim)


def _masked_softmax(scores: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of ``scores`` where ``mask`` (broadcast) holds; all zeros where it holds
    nowhere."""
    scores = np.where(mask, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    return weights / np.where(total > 0, total, 1.0)


_PADDED_POSITIONS = 1 << 16  # rows x padded positions gathered at once by the reference
_SHARED_SCORES = 1 << 21  # rows x heads x positions of one sequence's scores at once (16 MiB of float64)


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
