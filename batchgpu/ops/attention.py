"""Decoder attention: rope (rotate-half, Llama convention), kv_write into a cache at a position, and
grouped-query attention over the cache with a causal mask offset by the cache position. Positions are
per-execute scalars (``batch.scalar("pos")``) or fixed ints."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import BatchError, LimitError, ShapeError
from ..kernels import Binding, Launch, pack_struct, wgsl_aliases
from ..scalars import SCALAR_BYTES, Scalar, operand
from ..tensor import Tensor
from .common import groups_for, reads, uniform, writes
from .spec import Node, OpSpec, check_dtype, same_dtype

ATTENTION_WORKGROUP = 64


def _position(op: str, pos: Any) -> None:
    if isinstance(pos, Scalar):
        if pos.dtype != "u32":
            raise BatchError(f"{op}: position scalar {pos.name!r} must be u32, got {pos.dtype}")
        return
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0:
        raise BatchError(f"{op}: pos must be a u32 Scalar (batch.scalar) or an int >= 0, got {pos!r}")


def _heads_layout(op: str, tensor: Tensor, argument: str) -> None:
    if tensor.ndim != 3:
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must be 3-D (tokens or cache rows, heads, head_dim)")


def _params(
    tokens: int, heads: int, kv_heads: int, head_dim: int, cache_len: int, pos: Any, causal: bool, scale: float
) -> bytes:
    slot, literal = operand(pos)
    return pack_struct(
        "IIIIIIIIfIII", tokens, heads, kv_heads, head_dim, cache_len, slot, literal, int(causal), scale, 0, 0, 0
    )


def _launch(node: Node, entry: str, groups: int, bindings: list[Binding], params: bytes, **extra: Any) -> Launch:
    dtype = node.inputs[0].dtype
    extra.setdefault("workgroup_size", (ATTENTION_WORKGROUP, 1, 1))
    return Launch(
        label=node.spec.name,
        family="attention",
        entry=entry,
        types=wgsl_aliases(A=dtype),
        groups=groups,
        bindings=(*bindings, uniform(5, params), Binding(6, "scalars", None, SCALAR_BYTES)),
        params=params,
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
    bindings = [reads(0, x), Binding(1, "read", table, table.nbytes), writes(4, node.output.storage)]
    return [_launch(node, "rope", groups_for(x.size // 2, ATTENTION_WORKGROUP), bindings, params)]


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
    bindings = [reads(0, new), writes(4, cache.storage)]
    return [_launch(node, "kv_write", groups_for(new.size, ATTENTION_WORKGROUP), bindings, params)]


KV_WRITE = OpSpec(
    name="kv_write",
    infer=_kv_write_infer,
    reference=_kv_write_reference,
    lower=_kv_write_lower,
    inplace=(0,),
    doc="cache[pos : pos + T] = new, in place (cache: rows, kv_heads, head_dim)",
)


# attention -------------------------------------------------------------------------------------


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
    _position("attention", params["pos"])
    return q.shape, dtype


def _attention_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    q, k_cache, v_cache = arrays
    tokens, heads, head_dim = q.shape
    pos = int(params["pos"])
    length = min(pos + tokens, k_cache.shape[0])
    group = heads // k_cache.shape[1]
    k = np.repeat(k_cache[:length], group, axis=1)
    v = np.repeat(v_cache[:length], group, axis=1)
    scale = params.get("scale") or 1.0 / math.sqrt(head_dim)
    scores = np.einsum("thd,shd->hts", q, k) * np.float32(scale)
    if params.get("causal", True):
        allowed = np.arange(length)[None, :] <= (pos + np.arange(tokens))[:, None]
        scores = np.where(allowed[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", weights, v)


def _attention_lower(node: Node) -> list[Launch]:
    q, k, v = node.inputs
    tokens, heads, head_dim = q.shape
    cache_len, kv_heads, _ = k.shape
    _bound_position(node.params["pos"], tokens, k, "attention")
    scale = node.params.get("scale") or 1.0 / math.sqrt(head_dim)
    params = _params(tokens, heads, kv_heads, head_dim, cache_len, node.params["pos"], node.params["causal"], scale)
    bindings = [reads(0, q), reads(2, k), reads(3, v), writes(4, node.output.storage)]
    return [
        _launch(
            node,
            "attention",
            tokens * heads,
            bindings,
            params,
            constants=(("SMAX", cache_len), ("HEAD_DIM", head_dim)),
            workgroup_bytes=4 * (cache_len + head_dim + ATTENTION_WORKGROUP),
        )
    ]


ATTENTION = OpSpec(
    name="attention",
    infer=_attention_infer,
    reference=_attention_reference,
    lower=_attention_lower,
    dtypes="float",
    doc="softmax(q k^T / sqrt(d) + causal mask at pos) v over cache rows [0, pos + T); grouped-query heads",
)

SPECS: list[OpSpec] = [ROPE, KV_WRITE, ATTENTION]
