"""Decoder attention: rope (rotate-half, Llama convention), kv_write into a cache at a position, and
grouped-query attention over the cache with a causal mask offset by the cache position. Positions are
per-execute scalars (``batch.scalar("pos")``) or fixed ints."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import FLOAT32
from ..errors import BatchError, LimitError, ShapeError
from ..kernels import Launch, wgsl_aliases
from ..scalars import Scalar, operand
from ..tensor import Storage, Tensor
from . import bounds, interface
from .common import groups_for
from .spec import Node, OpSpec, check_dtype, same_dtype

FAMILY = interface.ATTENTION
ATTENTION_WORKGROUP = FAMILY.value("WG")
F32_MAX = float(np.finfo(np.float32).max)
U32_MAX = 2**32 - 1


def _position(op: str, pos: Any) -> None:
    if isinstance(pos, Scalar):
        if pos.dtype != "u32":
            raise BatchError(f"{op}: position scalar {pos.name!r} must be u32, got {pos.dtype}")
        return
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= U32_MAX:
        raise BatchError(f"{op}: pos must be a u32 Scalar (batch.scalar) or an int in [0, 2**32), got {pos!r}")


def _heads_layout(op: str, tensor: Tensor, argument: str) -> None:
    if tensor.ndim != 3:
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must be 3-D (tokens or cache rows, heads, head_dim)")


def _params(
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cache_len: int,
    pos: Any,
    causal: bool,
    scale: float,
    *,
    split_rows: int = 0,
    splits: int = 0,
    fan_in: int = 0,
) -> dict[str, Any]:
    pos_slot, pos_literal = operand(pos)
    return dict(
        tokens=tokens,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        cache_len=cache_len,
        pos_slot=pos_slot,
        pos_literal=pos_literal,
        causal=int(causal),
        scale=scale,
        split_rows=split_rows,
        splits=splits,
        fan_in=fan_in,
    )


Buffers = dict[str, Tensor | Storage]


def _launch(
    node: Node,
    entry: str,
    groups: int,
    buffers: Buffers,
    params: dict[str, Any],
    *,
    position: bool = True,
    **extra: Any,
) -> Launch:
    """A launch of ``entry`` with the Params uniform, and the per-execute scalars where it reads the position."""
    return FAMILY.launch(
        label=node.spec.name,
        entry=entry,
        types=wgsl_aliases(A=node.inputs[0].dtype),
        groups=groups,
        params=params,
        buffers=dict(buffers, scalars=position),
        **extra,
    )


# rope ------------------------------------------------------------------------------------------


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """theta ** (-2i / head_dim) for i < head_dim / 2, computed like transformers (float32)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def _rope_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    (x,) = inputs
    check_dtype("rope", "float", x)
    _heads_layout("rope", x, "x")
    if x.shape[-1] % 2:
        raise ShapeError(f"rope: head_dim of x {x.describe()} must be even")
    _position("rope", params["pos"])
    if not float(params["theta"]) > 0:
        raise ShapeError(f"rope: theta must be > 0, got {params['theta']!r}")
    return x.shape, x.dtype


def _rope_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    (x,) = arrays
    tokens, _, head_dim = x.shape
    inv = inverse_frequencies(head_dim, params["theta"])
    angles = (np.arange(tokens, dtype=np.float32) + np.float32(params["pos"]))[:, None] * inv[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_lower(node: Node) -> list[Launch]:
    (x,) = node.inputs
    tokens, heads, head_dim = x.shape
    table = node.new_constant(inverse_frequencies(head_dim, node.params["theta"]))
    params = _params(tokens, heads, heads, head_dim, 0, node.params["pos"], False, 0.0)
    buffers: Buffers = dict(src=x, table=table, dst=node.output)
    return [_launch(node, "rope", groups_for(x.size // 2, ATTENTION_WORKGROUP), buffers, params)]


ROPE = OpSpec(
    name="rope",
    infer=_rope_infer,
    reference=_rope_reference,
    lower=_rope_lower,
    dtypes="float",
    doc="rotary embedding (rotate-half) of x (tokens, heads, head_dim) at positions pos + t",
)


# kv_write --------------------------------------------------------------------------------------


def _kv_write_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[None, None]:
    cache, new = inputs
    same_dtype("kv_write", inputs, ("cache", "new"))
    _heads_layout("kv_write", cache, "cache")
    _heads_layout("kv_write", new, "new")
    if new.shape[1:] != cache.shape[1:]:
        raise ShapeError(f"kv_write: new {new.describe()} rows must match cache {cache.describe()} rows")
    pos = params["pos"]
    _position("kv_write", pos)
    limit = cache.shape[0] - new.shape[0]
    if limit < 0 or (not isinstance(pos, Scalar) and pos > limit):
        raise LimitError(f"kv_write: pos {pos!r} + {new.shape[0]} tokens exceeds cache {cache.describe()}")
    return None, None


def _kv_write_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> None:
    cache, new = arrays
    pos = int(params["pos"])
    cache[pos : pos + new.shape[0]] = new


def _bound_position(pos: Any, tokens: int, cache: Tensor, op: str) -> None:
    if isinstance(pos, Scalar):
        pos.require_at_most(cache.shape[0] - tokens, f"{op} of {tokens} token(s) into {cache.describe()}")


def _kv_write_lower(node: Node) -> list[Launch]:
    cache, new = node.inputs
    _bound_position(node.params["pos"], new.shape[0], cache, "kv_write")
    params = _params(new.shape[0], 0, cache.shape[1], cache.shape[2], cache.shape[0], node.params["pos"], False, 0)
    buffers: Buffers = dict(src=new, dst=cache)
    return [_launch(node, "kv_write", groups_for(new.size, ATTENTION_WORKGROUP), buffers, params)]


KV_WRITE = OpSpec(
    name="kv_write",
    infer=_kv_write_infer,
    reference=_kv_write_reference,
    lower=_kv_write_lower,
    inplace=(0,),
    doc="cache[pos : pos + T] = new, in place (cache: rows, kv_heads, head_dim)",
)


# attention -------------------------------------------------------------------------------------
#
# Caches of at most split_rows(head_dim) rows: one pass, one workgroup per (token, head) with its scores
# in workgroup memory. Longer caches, flash-decoding style: attention_partial, one workgroup per
# (token, head, block of split_rows rows), writes each block's partial (max score, sum of exp, exp-weighted
# sum of value rows) to f32 scratch; attention_merge folds fan_in partials into one while more remain than
# one invocation may loop over; attention_combine folds each (token, head)'s partials into its output.

PARTIAL_HEADER = FAMILY.value("PARTIAL_HEADER")
"""f32s in front of a partial's head_dim weighted sums: the block's max score and its sum of exp."""


def _log2(n: int) -> int:
    return n.bit_length() - 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _loops(*counts: int) -> int:
    """Loop iterations llvmpipe counts for loops of ``counts`` iterations: each exit test counts too."""
    return sum(count + 1 for count in counts)


def _rows_loops(rows: int, head_dim: int) -> int:
    """Loop iterations of one attention / attention_partial invocation over ``rows`` cache rows: the query
    row, scores (a head_dim dot product per row), two tree reductions, exp, and the weighted value sums."""
    lanes, dims = _ceil_div(rows, ATTENTION_WORKGROUP), _ceil_div(head_dim, ATTENTION_WORKGROUP)
    tree = _log2(ATTENTION_WORKGROUP)
    return (
        _loops(dims, lanes, tree, lanes, tree, dims)
        + lanes * _loops(head_dim)  # dot products
        + dims * _loops(rows)  # weighted sums of value rows
    )


def _rows_workgroup_bytes(rows: int, head_dim: int) -> int:
    """Workgroup memory of attention / attention_partial: scores, the scaled query row, tree partials."""
    return 4 * (rows + head_dim + ATTENTION_WORKGROUP)


def split_rows(head_dim: int) -> int:
    """Cache rows one attention workgroup takes: the largest power of two, at least the workgroup, whose
    loops fit ``bounds.LOOP_BUDGET`` and whose workgroup memory fits ``bounds.WORKGROUP_BYTES``."""
    rows = ATTENTION_WORKGROUP
    while (
        _rows_loops(2 * rows, head_dim) <= bounds.LOOP_BUDGET
        and _rows_workgroup_bytes(2 * rows, head_dim) <= bounds.WORKGROUP_BYTES
    ):
        rows *= 2
    return rows


def fold_fan_in(head_dim: int) -> int:
    """Partials one attention_merge / attention_combine invocation folds within ``bounds.LOOP_BUDGET``
    (loops over them for the max, the sum, and per output dimension), at least 2."""
    dims = _ceil_div(head_dim, ATTENTION_WORKGROUP)
    fixed = _loops(0, 0, dims) + dims  # exit tests, independent of the fan-in
    return max(2, (bounds.LOOP_BUDGET - fixed) // (2 + dims))


def largest_head_dim() -> int:
    """The largest head_dim whose query row, tree partials and one workgroup of scores fit
    ``bounds.WORKGROUP_BYTES``."""
    return bounds.WORKGROUP_BYTES // 4 - 2 * ATTENTION_WORKGROUP


def _attention_scale(params: dict[str, Any], head_dim: int) -> float:
    scale = params.get("scale")
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _attention_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    q, k, v = inputs
    dtype = same_dtype("attention", inputs, ("q", "k_cache", "v_cache"))
    check_dtype("attention", "float", q, "q")
    for tensor, name in ((q, "q"), (k, "k_cache"), (v, "v_cache")):
        _heads_layout("attention", tensor, name)
    if k.shape != v.shape:
        raise ShapeError(f"attention: k_cache {k.describe()} and v_cache {v.describe()} must have one shape")
    if q.shape[2] != k.shape[2]:
        raise ShapeError(f"attention: head_dim of q {q.describe()} differs from the cache's {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ShapeError(
            f"attention: {q.shape[1]} query heads of q {q.describe()} are not a multiple of {k.shape[1]} kv heads"
        )
    if q.shape[2] > largest_head_dim():
        raise LimitError(
            f"attention: head_dim {q.shape[2]} of q {q.describe()} exceeds {largest_head_dim()}: the query row and "
            f"a workgroup of scores must fit {bounds.WORKGROUP_BYTES} bytes of workgroup memory"
        )
    scale = params.get("scale")
    if scale is not None and not abs(float(scale)) <= F32_MAX:
        raise BatchError(f"attention: scale must be a finite f32, got {scale!r}")
    pos = params["pos"]
    _position("attention", pos)
    tokens, rows = q.shape[0], k.shape[0]
    if tokens > rows or (not isinstance(pos, Scalar) and pos + tokens > rows):
        raise LimitError(
            f"attention: pos {pos!r} + {tokens} tokens of q {q.describe()} exceeds the {rows} rows of k_cache "
            f"{k.describe()}"
        )
    return q.shape, dtype


def _attention_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    q, k_cache, v_cache = arrays
    tokens, heads, head_dim = q.shape
    pos = int(params["pos"])
    length = min(pos + tokens, k_cache.shape[0])
    group = heads // k_cache.shape[1]
    k = np.repeat(k_cache[:length], group, axis=1)
    v = np.repeat(v_cache[:length], group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * np.float32(_attention_scale(params, head_dim))
    if params.get("causal", True):
        allowed = np.arange(length)[None, :] <= (pos + np.arange(tokens))[:, None]
        scores = np.where(allowed[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, v)


def _attention_lower(node: Node) -> list[Launch]:
    q, k, v = node.inputs
    tokens, heads, head_dim = q.shape
    cache_len = k.shape[0]
    _bound_position(node.params["pos"], tokens, k, "attention")
    rows = split_rows(head_dim)
    if cache_len > rows:
        return _attention_over_blocks(node, rows)
    buffers: Buffers = dict(src=q, keys=k, values=v, dst=node.output)
    params = _attention_params(node, split_rows=cache_len)
    return [_rows_launch(node, "attention", tokens * heads, buffers, params, cache_len)]


def _attention_over_blocks(node: Node, rows: int) -> list[Launch]:
    """attention_partial over blocks of ``rows`` cache rows, attention_merge passes while an item has more
    partials than fold_fan_in, then attention_combine."""
    q, k, v = node.inputs
    tokens, heads, head_dim = q.shape
    items = tokens * heads

    def scratch(splits: int) -> Storage:
        return node.new_scratch(items * splits * (head_dim + PARTIAL_HEADER) * FLOAT32.itemsize, FLOAT32)

    splits = _ceil_div(k.shape[0], rows)
    partials = scratch(splits)
    buffers: Buffers = dict(src=q, keys=k, values=v, partials_out=partials)
    params = _attention_params(node, split_rows=rows, splits=splits)
    launches = [_rows_launch(node, "attention_partial", items * splits, buffers, params, rows)]
    fan_in = fold_fan_in(head_dim)
    while splits > fan_in:
        folded = _ceil_div(splits, fan_in)
        merged = scratch(folded)
        params = _attention_params(node, split_rows=rows, splits=splits, fan_in=fan_in)
        buffers = dict(partials_in=partials, partials_out=merged)
        launches.append(_launch(node, "attention_merge", items * folded, buffers, params, position=False))
        partials, splits = merged, folded
    params = _attention_params(node, split_rows=rows, splits=splits, fan_in=splits)
    buffers = dict(partials_in=partials, dst=node.output)
    launches.append(_launch(node, "attention_combine", items, buffers, params, position=False))
    return launches


def _attention_params(node: Node, **split: int) -> dict[str, Any]:
    q, k, _ = node.inputs
    tokens, heads, head_dim = q.shape
    cache_len, kv_heads, _ = k.shape
    pos, causal, scale = node.params["pos"], node.params["causal"], _attention_scale(node.params, head_dim)
    return _params(tokens, heads, kv_heads, head_dim, cache_len, pos, causal, scale, **split)


def _rows_launch(node: Node, entry: str, groups: int, buffers: Buffers, params: dict[str, Any], rows: int) -> Launch:
    """attention or attention_partial over blocks of at most ``rows`` cache rows (SMAX)."""
    head_dim = node.inputs[0].shape[2]
    return _launch(
        node,
        entry,
        groups,
        buffers,
        params,
        constants=(("SMAX", rows), ("HEAD_DIM", head_dim)),
        workgroup_bytes=_rows_workgroup_bytes(rows, head_dim),
    )


ATTENTION = OpSpec(
    name="attention",
    infer=_attention_infer,
    reference=_attention_reference,
    lower=_attention_lower,
    dtypes="float",
    doc="softmax(q k^T / sqrt(d) + causal mask at pos) v over cache rows [0, pos + T); grouped-query heads",
)

SPECS: list[OpSpec] = [ROPE, KV_WRITE, ATTENTION]
