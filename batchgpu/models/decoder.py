"""The decoder layers of a Llama-family model, recorded once for every caller: the single-sequence
:class:`~batchgpu.models.llama.Llama` and the engine's batched step (batchgpu/llm/step.py).

:func:`record_decoder` embeds token ids and records every layer (RMS norm, attention, residual, MLP),
returning the final-normed hidden states; the caller picks the rows it needs and :func:`record_logits`
projects them onto the vocabulary. Where keys and values live is the caller's :class:`KVLayout`:
:class:`ContiguousKV` (one sequence's caches, written at a position scalar) or :class:`PagedKV` (pools of
blocks written at per-row pool rows and read through block tables). An architecture is a row of
:data:`ARCHITECTURES`, its differences from Llama's layer; the joined projections (q/k/v one GEMV, gate/up
one GEMV with the swiglu epilogue) are used where the uploaded weights hold them
(:data:`~batchgpu.models.llama.FUSED_PROJECTIONS`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..batch import GpuCommandBatch
from ..errors import ModelFileError
from ..scalars import Scalar
from ..tensor import Tensor
from .config import LlamaConfig
from .row_pieces import Weight, embed, project


class Presence(Enum):
    """Whether a model of an architecture holds an optional part of the layer."""

    NEVER = "never"
    OPTIONAL = "where the file has it"
    ALWAYS = "always"


@dataclass(frozen=True)
class Architecture:
    """How one architecture's decoder layer differs from Llama's (pre-norm RMS, SwiGLU MLP, rotate-half
    RoPE): a row of :data:`ARCHITECTURES`."""

    qkv_biases: Presence = Presence.NEVER
    """q/k/v projections add biases (Qwen2 always; Llama where the file has them, as llama.cpp reads it)."""
    qk_norms: Presence = Presence.NEVER
    """q and k heads are RMS-normed before RoPE (Qwen3, Gemma 3); q/k/v then stay three projections."""
    post_norms: Presence = Presence.NEVER
    """The attention's and the MLP's outputs are RMS-normed before their residual adds (Gemma 3)."""
    activation: str = "silu"
    """The MLP gate's activation, an elementwise op: ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU, Gemma 3)."""
    embedding_scale: bool = False
    """Token embeddings are multiplied by sqrt(hidden) (Gemma; llama.cpp scales in f32)."""

    def has(self, part: str, names: Collection[str], block: str) -> bool:
        """Whether the layer ``block`` (``blk.<i>.``) of a model whose tensors are ``names`` has ``part``
        (a field of this class)."""
        presence: Presence = getattr(self, part)
        if presence is Presence.OPTIONAL:
            return block + PART_TENSORS[part][0] in names
        return presence is Presence.ALWAYS


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(qkv_biases=Presence.OPTIONAL),  # Llama 1-3, SmolLM2, Mistral
    "qwen2": Architecture(qkv_biases=Presence.ALWAYS),  # Qwen2, Qwen2.5
    "qwen3": Architecture(qk_norms=Presence.ALWAYS),
    "gemma3": Architecture(
        qk_norms=Presence.ALWAYS, post_norms=Presence.ALWAYS, activation="gelu_tanh", embedding_scale=True
    ),
}
"""Each of :data:`~batchgpu.models.config.ARCHITECTURES` (``LlamaConfig.architecture``) -> its layer's
differences."""

PART_TENSORS = {
    "qkv_biases": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qk_norms": ("attn_q_norm.weight", "attn_k_norm.weight"),
    "post_norms": ("post_attention_norm.weight", "post_ffw_norm.weight"),
}
"""An :class:`Architecture` field -> the per-layer tensors (after ``blk.<i>.``) that hold that part."""


def architecture(config: LlamaConfig) -> Architecture:
    """The row of :data:`ARCHITECTURES` for ``config``."""
    return ARCHITECTURES[config.architecture]


def check_parts(config: LlamaConfig, names: Collection[str], source: Path | str) -> None:
    """ModelFileError where a layer's tensors ``names`` (the file's, GGUF-named) hold a part the
    architecture has none of (it would compute what the architecture's own implementations do not) or
    lack one it always has; ``source`` names the file."""
    row = architecture(config)
    for part, tensors in PART_TENSORS.items():
        presence: Presence = getattr(row, part)
        for layer in range(config.layers):
            for name in (f"blk.{layer}.{tensor}" for tensor in tensors):
                if presence is Presence.NEVER and name in names:
                    raise ModelFileError(
                        f"{source}: tensor {name!r} is not part of a {config.architecture} layer (no "
                        f"{part.replace('_', ' ')}); refusing rather than computing a different model"
                    )
                if presence is Presence.ALWAYS and name not in names:
                    raise ModelFileError(
                        f"{source}: tensor {name!r} is missing (every {config.architecture} layer has "
                        f"{part.replace('_', ' ')})"
                    )


# where keys and values live --------------------------------------------------------------------------


class KVLayout(Protocol):
    """Where each layer's keys and values are written and what its queries attend over."""

    @property
    def positions(self) -> Scalar | Tensor:
        """The rows' positions for RoPE: a scalar (row t at ``pos + t``) or an int32 tensor (rows,)."""
        ...

    def rope_write(self, batch: GpuCommandBatch, layer: int, qkv: Tensor, rope: dict[str, Any]) -> Tensor:
        """RoPE of a joined q/k/v projection (rows, heads + 2 * kv_heads, head_dim) with k and v written,
        in one kernel; returns rope(q)."""
        ...

    def write_kv(self, batch: GpuCommandBatch, layer: int, k: Tensor, v: Tensor) -> None:
        """Write the layer's (already rotated) keys and its values."""
        ...

    def attend(self, batch: GpuCommandBatch, layer: int, q: Tensor, **attention: Any) -> Tensor:
        """Attention of the rotated queries (rows, heads, head_dim) over what the layer holds, with the
        ``window`` and ``scale`` keywords of the attention ops (:func:`attention_settings`)."""
        ...


@dataclass(frozen=True)
class ContiguousKV:
    """One sequence's caches, per layer a (keys, values) pair of (max_context, kv_heads, head_dim), float32 or
    float16: the rows are tokens at positions ``pos``, ``pos + 1``, ... and attend causally over rows
    ``[0, pos + t]``."""

    caches: Sequence[tuple[Tensor, Tensor]]
    pos: Scalar

    @property
    def positions(self) -> Scalar:
        return self.pos

    def rope_write(self, batch: GpuCommandBatch, layer: int, qkv: Tensor, rope: dict[str, Any]) -> Tensor:
        keys, values = self.caches[layer]
        return batch.rope_kv_write(qkv, keys, values, self.pos, **rope)

    def write_kv(self, batch: GpuCommandBatch, layer: int, k: Tensor, v: Tensor) -> None:
        keys, values = self.caches[layer]
        if keys.dtype != k.dtype:  # a float16 cache
            k, v = batch.cast(k, keys.dtype), batch.cast(v, values.dtype)
        batch.kv_write(keys, k, self.pos)
        batch.kv_write(values, v, self.pos)

    def attend(self, batch: GpuCommandBatch, layer: int, q: Tensor, **attention: Any) -> Tensor:
        keys, values = self.caches[layer]
        return batch.attention(q, keys, values, self.pos, **attention)


@dataclass(frozen=True)
class PagedKV:
    """Per layer a key and a value pool of ``block_size``-row blocks (float32 or float16): row t has
    position ``positions[t]``, is written to pool row ``rows[t]`` (-1: not written) and attends over the
    first ``lengths[t]`` positions of sequence ``seq[t]``, whose blocks ``block_tables[seq[t]]`` lists."""

    keys: Sequence[Tensor]
    values: Sequence[Tensor]
    positions: Tensor
    rows: Tensor
    block_tables: Tensor
    seq: Tensor
    lengths: Tensor
    block_size: int

    def rope_write(self, batch: GpuCommandBatch, layer: int, qkv: Tensor, rope: dict[str, Any]) -> Tensor:
        return batch.rope_kv_write(qkv, self.keys[layer], self.values[layer], self.positions, rows=self.rows, **rope)

    def write_kv(self, batch: GpuCommandBatch, layer: int, k: Tensor, v: Tensor) -> None:
        keys, values = self.keys[layer], self.values[layer]
        if keys.dtype != k.dtype:
            k, v = batch.cast(k, keys.dtype), batch.cast(v, values.dtype)
        batch.scatter_rows(keys, self.rows, k)
        batch.scatter_rows(values, self.rows, v)

    def attend(self, batch: GpuCommandBatch, layer: int, q: Tensor, **attention: Any) -> Tensor:
        return batch.paged_attention(
            q,
            self.keys[layer],
            self.values[layer],
            self.block_tables,
            self.seq,
            self.lengths,
            block_size=self.block_size,
            **attention,
        )


# the layers ------------------------------------------------------------------------------------------


def record_decoder(
    batch: GpuCommandBatch, config: LlamaConfig, weights: dict[str, Weight], ids: Tensor, kv: KVLayout
) -> Tensor:
    """Record the decoder over the token ``ids`` (rows,): embedding, every layer (keys and values written
    through ``kv``), the final norm. Returns the normed hidden states (rows, hidden). Each residual add is
    fused into the norm after it (``add_rms_norm``). Weight matrices held as row pieces (over a storage
    binding, :mod:`batchgpu.models.row_pieces`) are gathered from and projected onto piece by piece."""
    w, row = weights, architecture(config)
    h = embed(batch, ids, w["token_embd.weight"])
    if row.embedding_scale:
        h = batch.mul(h, float(np.float32(config.hidden**0.5)))
    normed = batch.rms_norm(h, w["blk.0.attn_norm.weight"], config.eps)
    for layer in range(config.layers):
        block = f"blk.{layer}."
        attended = record_attention(batch, config, w, layer, normed, kv)
        attended = post_norm(batch, config, w, block, "post_attention_norm.weight", attended)
        normed, h = batch.add_rms_norm(attended, h, w[block + "ffn_norm.weight"], config.eps)
        ffn = post_norm(batch, config, w, block, "post_ffw_norm.weight", feed_forward(batch, config, normed, w, block))
        after = f"blk.{layer + 1}.attn_norm.weight" if layer + 1 < config.layers else "output_norm.weight"
        normed, h = batch.add_rms_norm(ffn, h, w[after], config.eps)
    return normed


def post_norm(
    batch: GpuCommandBatch, config: LlamaConfig, w: dict[str, Weight], block: str, name: str, x: Tensor
) -> Tensor:
    """``x`` RMS-normed by ``w[block + name]`` where the layer ``block`` norms its sublayers' outputs
    (:attr:`Architecture.post_norms`), else ``x``."""
    if not architecture(config).has("post_norms", w, block):
        return x
    return batch.rms_norm(x, w[block + name], config.eps)


def record_logits(batch: GpuCommandBatch, weights: dict[str, Weight], x: Tensor) -> Tensor:
    """Logits (rows, vocab) of final hidden states ``x``: the untied output head where the file has one,
    else the token embedding."""
    return project(batch, x, weights.get("output.weight", weights["token_embd.weight"]))


def record_attention(
    batch: GpuCommandBatch, config: LlamaConfig, weights: dict[str, Weight], layer: int, x: Tensor, kv: KVLayout
) -> Tensor:
    """The layer's attention over the normed ``x`` (rows, hidden), through its output projection: q/k/v
    one GEMV and RoPE with both KV writes one kernel where the weights are joined, else the separate ops."""
    w, block, rows = weights, f"blk.{layer}.", x.shape[0]
    rope = config.rope(layer)
    if block + "attn_qkv.weight" in w:
        width = (rows, config.heads + 2 * config.kv_heads, config.head_dim)
        q = kv.rope_write(batch, layer, batch.reshape(linear(batch, x, w, block + "attn_qkv.weight"), width), rope)
    else:
        q, k, v = project_heads(batch, x, w, block, config, rows)
        q = batch.rope(q, kv.positions, **rope)
        kv.write_kv(batch, layer, batch.rope(k, kv.positions, **rope), v)
    attended = batch.reshape(
        kv.attend(batch, layer, q, **attention_settings(config, layer)), (rows, config.heads * config.head_dim)
    )
    return project(batch, attended, w[block + "attn_output.weight"])


def linear(batch: GpuCommandBatch, x: Tensor, w: dict[str, Weight], name: str) -> Tensor:
    """``x @ w[name].T``, plus the matching ``.bias`` where the model has one (:attr:`Architecture.qkv_biases`:
    :func:`check_parts` holds the file to its architecture's row)."""
    return project(batch, x, w[name], bias=w.get(name.removesuffix("weight") + "bias"))


def attention_settings(config: LlamaConfig, layer: int) -> dict[str, Any]:
    """The ``window`` and ``scale`` keywords of ``attention`` / ``paged_attention`` for ``layer``."""
    return {"window": config.window(layer), "scale": config.query_scale or None}


def project_heads(
    batch: GpuCommandBatch, x: Tensor, w: dict[str, Weight], block: str, config: LlamaConfig, rows: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's q, k and v heads (rows, heads, head_dim) from separate projections, q and k RMS-normed
    per head before RoPE where the architecture norms them (:attr:`Architecture.qk_norms`)."""

    def project(name: str, heads: int) -> Tensor:
        return batch.reshape(linear(batch, x, w, block + name), (rows, heads, config.head_dim))

    q, k = project("attn_q.weight", config.heads), project("attn_k.weight", config.kv_heads)
    if architecture(config).has("qk_norms", w, block):
        q = batch.rms_norm(q, w[block + "attn_q_norm.weight"], config.eps)
        k = batch.rms_norm(k, w[block + "attn_k_norm.weight"], config.eps)
    return q, k, project("attn_v.weight", config.kv_heads)


def feed_forward(batch: GpuCommandBatch, config: LlamaConfig, x: Tensor, w: dict[str, Weight], block: str) -> Tensor:
    """The layer's MLP, (act(x @ gate.T) * (x @ up.T)) @ down.T (:attr:`Architecture.activation`): gate and
    up one GEMV with the swiglu epilogue where the weights are joined (interleaved rows; SwiGLU only), else
    two GEMVs and ``silu_mul`` (or the activation, then ``mul``)."""
    activation = architecture(config).activation
    if block + "ffn_gate_up.weight" in w:
        hidden = project(batch, x, w[block + "ffn_gate_up.weight"], epilogue="swiglu")
    else:
        gate, up = project(batch, x, w[block + "ffn_gate.weight"]), project(batch, x, w[block + "ffn_up.weight"])
        silu = activation == "silu"
        hidden = batch.silu_mul(gate, up) if silu else batch.mul(getattr(batch, activation)(gate), up)
    return project(batch, hidden, w[block + "ffn_down.weight"])
