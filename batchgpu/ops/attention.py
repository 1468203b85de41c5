"""Decoder attention: rope (rotate-half, Llama convention), kv_write into a cache at a position, and
grouped-query attention over the cache with a causal mask offset by the cache position. Positions are
per-execute scalars (``batch.scalar("pos")``) or fixed ints; rope also takes an int32 tensor of one position
per token. The paged KV cache ops (``batchgpu/ops/paged.py``) reuse this module's launches and its split
over blocks of rows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..dtypes import FLOAT32, INT32
from ..errors import ArgumentError, BatchError, DTypeError, LimitError, ShapeError
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
I32_MAX = 2**31 - 1


def _position(op: str, pos: Any) -> None:
    if isinstance(pos, Scalar):
        if pos.dtype != "u32":
            raise BatchError(f"{op}: position scalar {pos.name!r} must be u32, got {pos.dtype}")
        return
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or not 0 <= pos <= U32_MAX:
        extra = ", or an int32 Tensor of one position per token" if op == "rope" else ""
        raise BatchError(f"{op}: pos must be a u32 Scalar (batch.scalar) or an int in [0, 2**32){extra}, got {pos!r}")


def heads_layout(op: str, tensor: Tensor, argument: str) -> None:
    """ShapeError unless ``tensor`` is 3-D (tokens or cache rows, heads, head_dim)."""
    if tensor.ndim != 3:
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must be 3-D (tokens or cache rows, heads, head_dim)")


def index_vector(op: str, tensor: Tensor, argument: str, length: int, meaning: str) -> None:
    """DTypeError / ShapeError unless ``tensor`` is an int32 vector of ``length`` entries (``meaning``: one
    what per what)."""
    if tensor.dtype != INT32:
        raise DTypeError(f"{op}: {argument} {tensor.describe()} must be int32 ({meaning}), got {tensor.dtype.name}")
    if tensor.shape != (length,):
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must have shape ({length},): {meaning}")


def family_params(
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
    block_size: int = 0,
    max_blocks: int = 0,
    sequences: int = 0,
    window: int = 0,
) -> dict[str, Any]:
    """The attention family's ``Params`` by name (``pos``: a Scalar or an int)."""
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
        block_size=block_size,
        max_blocks=max_blocks,
        sequences=sequences,
        window=window,
    )


Buffers = dict[str, Tensor | Storage]


def family_launch(
    node: Node,
    entry: str,
    groups: int,
    buffers: Buffers,
    params: dict[str, Any],
    *,
    position: bool = True,
    **extra: Any,
) -> Launch:
    """A launch of ``entry`` with the Params uniform, and the per-execute scalars where it reads the position.
    Alias A is the dtype of the node's first input (x, q, a cache written), B that of the ``keys`` bound (the
    cache read) or of ``keys_out`` (the cache rope_kv_write writes), else A."""
    dtype = node.inputs[0].dtype
    keys = buffers.get("keys", buffers.get("keys_out"))
    return FAMILY.launch(
        label=node.spec.name,
        entry=entry,
        types=wgsl_aliases(A=dtype, B=keys.dtype if keys is not None else dtype),
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


def rope_table(head_dim: int, params: dict[str, Any]) -> np.ndarray:
    """The inverse frequency of each rotation pair: :func:`inverse_frequencies`, each divided by its
    ``factors`` entry where given (Llama 3's and linear RoPE scaling; llama.cpp's ``rope_freqs``)."""
    table = inverse_frequencies(head_dim, params["theta"])
    if params.get("factors") is not None:
        table = (table / np.asarray(params["factors"], np.float32)).astype(np.float32)
    return table


def _check_rope_params(op: str, head_dim: int, params: dict[str, Any]) -> None:
    if not float(params["theta"]) > 0:
        raise ShapeError(f"{op}: theta must be > 0, got {params['theta']!r}")
    factors = params.get("factors")
    if factors is not None and len(factors) != head_dim // 2:
        raise ShapeError(f"{op}: factors has {len(factors)} entries, expected head_dim / 2 = {head_dim // 2}")


def _rope_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    x = inputs[0]
    check_dtype("rope", "float", x)
    heads_layout("rope", x, "x")
    if x.shape[-1] % 2:
        raise ShapeError(f"rope: head_dim of x {x.describe()} must be even")
    if len(inputs) == 2:  # a positions tensor
        index_vector("rope", inputs[1], "pos", x.shape[0], "one position per token of x")
    else:
        _position("rope", params["pos"])
    _check_rope_params("rope", x.shape[-1], params)
    return x.shape, x.dtype


def _rope_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    x = arrays[0]
    tokens, _, head_dim = x.shape
    inv = rope_table(head_dim, params)
    if len(arrays) == 2:  # token t at positions[t] (float32 of the int32, as the kernels convert it)
        at = arrays[1].astype(np.float32)
    else:
        at = np.arange(tokens, dtype=np.float32) + np.float32(params["pos"])
    angles = at[:, None] * inv[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    half = head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_lower(node: Node) -> list[Launch]:
    x = node.inputs[0]
    tokens, heads, head_dim = x.shape
    table = node.new_constant(rope_table(head_dim, node.params))
    buffers: Buffers = dict(src=x, table=table, dst=node.output)
    groups = groups_for(x.size // 2, ATTENTION_WORKGROUP)
    if len(node.inputs) == 2:  # positions from a tensor
        params = family_params(tokens, heads, heads, head_dim, 0, 0, False, 0.0)
        buffers["indices"] = node.inputs[1]
        return [family_launch(node, "rope_positions", groups, buffers, params, position=False)]
    params = family_params(tokens, heads, heads, head_dim, 0, node.params["pos"], False, 0.0)
    return [family_launch(node, "rope", groups, buffers, params)]


ROPE = OpSpec(
    name="rope",
    infer=_rope_infer,
    reference=_rope_reference,
    lower=_rope_lower,
    dtypes="float",
    doc="rotary embedding (rotate-half) of x (tokens, heads, head_dim) at positions pos + t, or pos[t] for an "
    "int32 tensor pos; pair i turns at theta ** (-2i / head_dim) / factors[i]",
)


# kv_write --------------------------------------------------------------------------------------


def _kv_write_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[None, None]:
    cache, new = inputs
    same_dtype("kv_write", inputs, ("cache", "new"))
    heads_layout("kv_write", cache, "cache")
    heads_layout("kv_write", new, "new")
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
    params = family_params(
        new.shape[0], 0, cache.shape[1], cache.shape[2], cache.shape[0], node.params["pos"], False, 0
    )
    buffers: Buffers = dict(src=new, dst=cache)
    return [family_launch(node, "kv_write", groups_for(new.size, ATTENTION_WORKGROUP), buffers, params)]


KV_WRITE = OpSpec(
    name="kv_write",
    infer=_kv_write_infer,
    reference=_kv_write_reference,
    lower=_kv_write_lower,
    inplace=(0,),
    doc="cache[pos : pos + T] = new, in place (cache: rows, kv_heads, head_dim)",
)


# rope_kv_write: rope + kv_write of a fused q/k/v projection -----------------------------------------


def _rope_kv_split(qkv: Tensor, k_cache: Tensor) -> tuple[int, int, int]:
    """(tokens, q heads, kv heads) of a fused projection whose kv heads are the cache's."""
    tokens, width, _ = qkv.shape
    kv_heads = k_cache.shape[1]
    return tokens, width - 2 * kv_heads, kv_heads


def _rope_kv_write_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    qkv, k_cache, v_cache = inputs[:3]
    check_dtype("rope_kv_write", "float", qkv, "qkv")
    check_dtype("rope_kv_write", "float", k_cache, "k_cache")
    same_dtype("rope_kv_write", (k_cache, v_cache), ("k_cache", "v_cache"))
    for tensor, argument in zip(inputs, ("qkv", "k_cache", "v_cache")):
        heads_layout("rope_kv_write", tensor, argument)
    if k_cache.shape != v_cache.shape:
        raise ShapeError(f"rope_kv_write: v_cache {v_cache.describe()} must match k_cache {k_cache.describe()}")
    tokens, heads, kv_heads = _rope_kv_split(qkv, k_cache)
    head_dim = qkv.shape[2]
    if k_cache.shape[2] != head_dim or head_dim % 2:
        raise ShapeError(
            f"rope_kv_write: qkv {qkv.describe()} and the caches {k_cache.describe()} need one even head_dim"
        )
    if heads < 1 or heads % kv_heads:
        raise ShapeError(
            f"rope_kv_write: qkv {qkv.describe()} must hold q heads (a multiple of the caches' {kv_heads} kv "
            f"heads), then {kv_heads} k and {kv_heads} v heads"
        )
    if len(inputs) == 5:  # positions and cache rows from tensors
        index_vector("rope_kv_write", inputs[3], "pos", tokens, "one position per token of qkv")
        index_vector("rope_kv_write", inputs[4], "rows", tokens, "one cache row per token of qkv")
    else:
        pos = params["pos"]
        _position("rope_kv_write", pos)
        if not isinstance(pos, Scalar) and pos > k_cache.shape[0] - tokens:
            raise LimitError(f"rope_kv_write: pos {pos!r} + {tokens} tokens exceeds cache {k_cache.describe()}")
    _check_rope_params("rope_kv_write", head_dim, params)
    return (tokens, heads, head_dim), qkv.dtype


def _rope_kv_write_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    qkv, k_cache, v_cache = arrays[:3]
    kv_heads, tokens = k_cache.shape[1], qkv.shape[0]
    heads = qkv.shape[1] - 2 * kv_heads
    if len(arrays) == 5:
        rotated = _rope_reference([qkv[:, : heads + kv_heads], arrays[3]], params)
        rows = arrays[4]
        keep = (rows >= 0) & (rows < k_cache.shape[0])
    else:
        rotated = _rope_reference([qkv[:, : heads + kv_heads]], params)
        rows, keep = np.arange(tokens) + int(params["pos"]), np.ones(tokens, bool)
    k_cache[rows[keep]] = rotated[keep, heads:]
    v_cache[rows[keep]] = qkv[keep, heads + kv_heads :]
    return rotated[:, :heads]


def _rope_kv_write_lower(node: Node) -> list[Launch]:
    qkv, k_cache, v_cache = node.inputs[:3]
    tokens, heads, kv_heads = _rope_kv_split(qkv, k_cache)
    head_dim, cache_len = qkv.shape[2], k_cache.shape[0]
    table = node.new_constant(rope_table(head_dim, node.params))
    buffers: Buffers = dict(src=qkv, table=table, dst=node.output, keys_out=k_cache, values_out=v_cache)
    groups = groups_for(qkv.size // 2, ATTENTION_WORKGROUP)
    if len(node.inputs) == 5:
        buffers.update(indices=node.inputs[3], rows=node.inputs[4])
        params = family_params(tokens, heads, kv_heads, head_dim, cache_len, 0, False, 0.0)
        return [family_launch(node, "rope_kv_scatter", groups, buffers, params, position=False)]
    _bound_position(node.params["pos"], tokens, k_cache, "rope_kv_write")
    params = family_params(tokens, heads, kv_heads, head_dim, cache_len, node.params["pos"], False, 0.0)
    return [family_launch(node, "rope_kv_write", groups, buffers, params)]


ROPE_KV_WRITE = OpSpec(
    name="rope_kv_write",
    infer=_rope_kv_write_infer,
    reference=_rope_kv_write_reference,
    lower=_rope_kv_write_lower,
    dtypes="float",
    inplace=(1, 2),
    literal_operands=False,  # the caches are written in place
    doc="q of rope(qkv[:, :H]) at pos + t (or pos[t]); rope(k heads) and the v heads of (T, H + 2 KV, D) qkv "
    "written into the caches' rows pos + t (or rows[t], negative skipped), in place",
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


def attention_scale(params: dict[str, Any], head_dim: int) -> float:
    """The ``scale`` param, 1/sqrt(head_dim) when None (0.0 stays 0.0)."""
    scale = params.get("scale")
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_heads(op: str, q: Tensor, k: Tensor, v: Tensor, names: tuple[str, str, str]) -> None:
    """The checks attention and paged_attention share: 3-D q and caches (pools) of one shape, one head_dim,
    query heads a multiple of the kv heads, a head_dim whose query row fits the workgroup memory."""
    for tensor, name in zip((q, k, v), names):
        heads_layout(op, tensor, name)
    if k.shape != v.shape:
        raise ShapeError(f"{op}: {names[1]} {k.describe()} and {names[2]} {v.describe()} must have one shape")
    if q.shape[2] != k.shape[2]:
        raise ShapeError(f"{op}: head_dim of q {q.describe()} differs from {names[1]}'s {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ShapeError(
            f"{op}: {q.shape[1]} query heads of q {q.describe()} are not a multiple of {k.shape[1]} kv heads"
        )
    if q.shape[2] > largest_head_dim():
        raise LimitError(
            f"{op}: head_dim {q.shape[2]} of q {q.describe()} exceeds {largest_head_dim()}: the query row and "
            f"a workgroup of scores must fit {bounds.WORKGROUP_BYTES} bytes of workgroup memory"
        )


def check_window(op: str, params: dict[str, Any]) -> None:
    """ArgumentError unless the ``window`` param is an int in [0, 2**31) (0: no window)."""
    window = params.get("window", 0)
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or not 0 <= window <= I32_MAX:
        raise ArgumentError(f"{op}: window must be an int in [0, 2**31) (0: no window), got {window!r}")


def check_scale(op: str, params: dict[str, Any]) -> None:
    """BatchError unless the ``scale`` param is None or a finite f32."""
    scale = params.get("scale")
    if scale is not None and not abs(float(scale)) <= F32_MAX:
        raise BatchError(f"{op}: scale must be a finite f32, got {scale!r}")


def _attention_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    q, k, v = inputs
    check_dtype("attention", "float", q, "q")
    check_dtype("attention", "float", k, "k_cache")
    same_dtype("attention", (k, v), ("k_cache", "v_cache"))  # a half cache under float32 queries: the caches' own
    check_heads("attention", q, k, v, ("q", "k_cache", "v_cache"))
    check_scale("attention", params)
    check_window("attention", params)
    if params.get("window") and not params.get("causal", True):
        raise ArgumentError(
            f"attention: a window ({params['window']}) needs causal=True (it counts back from each query)"
        )
    pos = params["pos"]
    _position("attention", pos)
    tokens, rows = q.shape[0], k.shape[0]
    if tokens > rows or (not isinstance(pos, Scalar) and pos + tokens > rows):
        raise LimitError(
            f"attention: pos {pos!r} + {tokens} tokens of q {q.describe()} exceeds the {rows} rows of k_cache "
            f"{k.describe()}"
        )
    return q.shape, q.dtype


def _attention_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    q, k_cache, v_cache = arrays
    tokens, heads, head_dim = q.shape
    pos = int(params["pos"])
    length = min(pos + tokens, k_cache.shape[0])
    group = heads // k_cache.shape[1]
    k = np.repeat(k_cache[:length], group, axis=1)
    v = np.repeat(v_cache[:length], group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * np.float32(attention_scale(params, head_dim))
    if params.get("causal", True):
        query = (pos + np.arange(tokens))[:, None]
        allowed = np.arange(length)[None, :] <= query
        if params.get("window"):
            allowed &= np.arange(length)[None, :] > query - params["window"]
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
    buffers: Buffers = dict(src=q, keys=k, values=v)
    if cache_len > rows:
        return over_blocks(
            node, "attention_partial", rows, cache_len, buffers, lambda **split: _attention_params(node, **split)
        )
    params = _attention_params(node, split_rows=cache_len)
    return [rows_launch(node, "attention", tokens * heads, dict(buffers, dst=node.output), params, cache_len)]


def over_blocks(
    node: Node,
    entry: str,
    rows: int,
    positions: int,
    buffers: Buffers,
    params_for: Callable[..., dict[str, Any]],
    *,
    position: bool = True,
    native_shared: bool = False,
) -> list[Launch]:
    """Flash-decoding over ``positions`` rows of keys and values per query item (token or row, head) of the
    node's first input: ``entry`` (attention_partial or paged_attention_partial, reading ``buffers``) over
    blocks of ``rows``, attention_merge passes while an item has more partials than fold_fan_in, then
    attention_combine into the node's output. ``params_for(**split)`` gives the Params of each pass."""
    q = node.inputs[0]
    tokens, heads, head_dim = q.shape
    items = tokens * heads

    def scratch(splits: int) -> Storage:
        return node.new_scratch(items * splits * (head_dim + PARTIAL_HEADER) * FLOAT32.itemsize, FLOAT32)

    splits = _ceil_div(positions, rows)
    partials = scratch(splits)
    params = params_for(split_rows=rows, splits=splits)
    launches = [
        rows_launch(
            node,
            entry,
            items * splits,
            dict(buffers, partials_out=partials),
            params,
            rows,
            position=position,
            native_shared=native_shared,
        )
    ]
    fan_in = fold_fan_in(head_dim)
    while splits > fan_in:
        folded = _ceil_div(splits, fan_in)
        merged = scratch(folded)
        params = params_for(split_rows=rows, splits=splits, fan_in=fan_in)
        fold: Buffers = dict(partials_in=partials, partials_out=merged)
        launches.append(family_launch(node, "attention_merge", items * folded, fold, params, position=False))
        partials, splits = merged, folded
    params = params_for(split_rows=rows, splits=splits, fan_in=splits)
    combine: Buffers = dict(partials_in=partials, dst=node.output)
    launches.append(family_launch(node, "attention_combine", items, combine, params, position=False))
    return launches


def _attention_params(node: Node, **split: int) -> dict[str, Any]:
    q, k, _ = node.inputs
    tokens, heads, head_dim = q.shape
    cache_len, kv_heads, _ = k.shape
    pos, causal, scale = node.params["pos"], node.params["causal"], attention_scale(node.params, head_dim)
    window = node.params.get("window", 0)
    return family_params(tokens, heads, kv_heads, head_dim, cache_len, pos, causal, scale, window=window, **split)


ROWS_SHARED = FAMILY.value("ROWS_SHARED")
"""Floats of the static shared memory the CUDA paged kernels hold their scores and query row in."""


def rows_launch(
    node: Node,
    entry: str,
    groups: int,
    buffers: Buffers,
    params: dict[str, Any],
    rows: int,
    *,
    position: bool = True,
    native_shared: bool = False,
) -> Launch:
    """attention, attention_partial or their paged twins over blocks of at most ``rows`` cache rows (SMAX).
    ``native_shared``: the CUDA kernel keeps scores and query row in a static array of ROWS_SHARED floats
    (the paged ones), declared by its native form's workgroup bytes."""
    head_dim = node.inputs[0].shape[2]
    launch = family_launch(
        node,
        entry,
        groups,
        buffers,
        params,
        position=position,
        constants=(("SMAX", rows), ("HEAD_DIM", head_dim)),
        workgroup_bytes=_rows_workgroup_bytes(rows, head_dim),
    )
    if native_shared:
        if rows + head_dim > ROWS_SHARED:  # split_rows keeps them within bounds.WORKGROUP_BYTES, which sized it
            raise LimitError(
                f"{node.spec.name}: {rows} scores and a {head_dim}-long query row exceed the {ROWS_SHARED} floats "
                f"of the CUDA kernel's static shared memory (bounds.WORKGROUP_BYTES grew after import?)"
            )
        launch.native = dataclasses.replace(launch, workgroup_bytes=4 * (ROWS_SHARED + ATTENTION_WORKGROUP))
    return launch


ATTENTION = OpSpec(
    name="attention",
    infer=_attention_infer,
    reference=_attention_reference,
    lower=_attention_lower,
    dtypes="float",
    doc="softmax(q k^T / sqrt(d) + causal mask at pos) v over cache rows [0, pos + T); grouped-query heads; "
    "with a window, query t sees rows (pos + t - window, pos + t]",
)

SPECS: list[OpSpec] = [ROPE, KV_WRITE, ROPE_KV_WRITE, ATTENTION]
