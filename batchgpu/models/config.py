"""The shape of a Llama-family decoder (Llama 1-3, SmolLM2, Mistral, Qwen2 / 2.5 / 3) as one dataclass, read
from a GGUF file's metadata or a Hugging Face ``config.json``, and the RoPE frequency scalings they use.
Anything the decoder cannot compute (YaRN, partial rotary, a window shorter than the context asked for) is
refused by name rather than run with wrong numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BatchError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
"""GGUF ``general.architecture`` values this decoder runs: Llama (and the Llama-layout SmolLM2 and
Mistral), Qwen2 / Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMS norms, an explicit head size)."""

HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""Hugging Face ``model_type`` -> the architecture whose tensor names and conventions it shares."""

PERMUTED_ARCHITECTURES = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter permutes for interleaved RoPE (undone when a GGUF is
read: the kernels rotate halves, as transformers does); Qwen's are stored as they are, and Hugging Face
checkpoints never are."""


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    eps: float
    theta: float
    context: int = 0  # the trained context length (0: not in the file)
    architecture: str = "llama"  # the GGUF's general.architecture: its metadata keys' prefix
    head_size: int = 0  # the attention head size where the file gives one (0: hidden // heads)
    rope_factors: tuple[float, ...] | None = None  # per rotation pair, its frequency is divided by this
    sliding_window: int = 0  # attention sees at most this many positions back (0: all)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def permuted(self) -> bool:
        """Whether llama.cpp's converter permuted this architecture's q/k rows (for interleaved RoPE)."""
        return self.architecture in PERMUTED_ARCHITECTURES

    def check_context(self, max_context: int, what: str) -> None:
        """BatchError when a sliding window would hide positions a ``max_context`` sequence attends to
        (the decoder attends to every position; a window of at least ``max_context`` changes nothing)."""
        if self.sliding_window and self.sliding_window < max_context:
            raise BatchError(
                f"{what}: sliding-window attention ({self.sliding_window} positions) is not supported; "
                f"max_context {max_context} must be at most the window"
            )

    @classmethod
    def from_gguf(cls, reader: Any) -> LlamaConfig:
        """The config from a ``gguf.GGUFReader``'s metadata (and its ``rope_freqs`` tensor, Llama 3)."""
        fields = reader.fields
        architecture = fields["general.architecture"].contents() if "general.architecture" in fields else "llama"
        if architecture not in ARCHITECTURES:
            raise BatchError(
                f"GGUF architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )

        def field(name: str, default: Any = None) -> Any:
            key = f"{architecture}.{name}"
            if key in fields:
                return fields[key].contents()
            if default is None:
                raise BatchError(f"GGUF metadata {key!r} is missing")
            return default

        tensors = {t.name: t for t in reader.tensors}
        if f"{architecture}.vocab_size" in fields:
            vocab = int(field("vocab_size"))
        elif "token_embd.weight" in tensors:
            vocab = int(tensors["token_embd.weight"].shape[-1])
        else:
            raise BatchError(f"GGUF: neither {architecture}.vocab_size nor token_embd.weight is in the file")
        hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
        head_size = int(field("attention.key_length", hidden // heads))
        for key in ("attention.value_length", "rope.dimension_count"):
            if int(field(key, head_size)) != head_size:
                raise BatchError(
                    f"GGUF {architecture} model: {architecture}.{key} other than the key length "
                    f"{head_size} (partial rotary or unequal head sizes) is not supported"
                )
        scaling = field("rope.scaling.type", "none")
        if "rope_freqs.weight" in tensors:
            factors = tuple(float(f) for f in np.asarray(tensors["rope_freqs.weight"].data, np.float32).ravel())
        elif scaling == "linear":
            factors = (float(field("rope.scaling.factor")),) * (head_size // 2)
        elif scaling == "none":
            factors = None
        else:
            raise BatchError(
                f"GGUF {architecture} model: RoPE scaling {scaling!r} is not supported; "
                "supported: none, linear, Llama 3 (rope_freqs)"
            )
        return cls(
            layers=int(field("block_count")),
            hidden=hidden,
            heads=heads,
            kv_heads=int(field("attention.head_count_kv", heads)),
            ffn=int(field("feed_forward_length")),
            vocab=vocab,
            eps=float(field("attention.layer_norm_rms_epsilon")),
            theta=float(field("rope.freq_base", 10000.0)),
            context=int(field("context_length", 0)),
            architecture=architecture,
            head_size=head_size,
            rope_factors=factors,
            sliding_window=int(field("attention.sliding_window", 0)),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """The config from a Hugging Face ``config.json`` (transformers 4's ``rope_theta`` /
        ``rope_scaling`` or 5's ``rope_parameters``)."""
        model_type = config.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise BatchError(
                f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise BatchError(f"{model_type} model: hidden_act {config['hidden_act']!r} is not supported (silu only)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_size = int(config.get("head_dim") or hidden // heads)
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        window = config.get("sliding_window") or 0
        if not config.get("use_sliding_window", True) and "sliding_attention" not in config.get("layer_types", ()):
            window = 0  # Qwen2/3 carry a window they do not use
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            ffn=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            eps=float(config.get("rms_norm_eps", 1e-6)),
            theta=theta,
            context=int(config.get("max_position_embeddings", 0)),
            architecture=HF_MODEL_TYPES[model_type],
            head_size=head_size,
            rope_factors=hf_rope_factors(rope, head_size, theta),
            sliding_window=int(window),
        )


def hf_rope_factors(rope: Mapping[str, Any], head_dim: int, theta: float) -> tuple[float, ...] | None:
    """Per-pair frequency divisors for a transformers RoPE config: None (default), the factor
    everywhere (linear), or Llama 3's band-wise factors (as llama.cpp's converter writes ``rope_freqs``)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return (float(rope["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        return llama3_rope_factors(
            head_dim,
            theta,
            factor=float(rope["factor"]),
            low=float(rope["low_freq_factor"]),
            high=float(rope["high_freq_factor"]),
            original_context=int(rope["original_max_position_embeddings"]),
        )
    raise BatchError(f"RoPE scaling {kind!r} is not supported; supported: default, linear, llama3")


def llama3_rope_factors(
    head_dim: int, theta: float, *, factor: float, low: float, high: float, original_context: int
) -> tuple[float, ...]:
    """Llama 3.1's RoPE scaling as frequency divisors: 1 for wavelengths under ``original_context /
    high``, ``factor`` past ``original_context / low``, a smooth blend between (transformers'
    ``_compute_llama3_parameters``)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_context / high:
            factors.append(1.0)
        elif wavelength > original_context / low:
            factors.append(factor)
        else:
            smooth = (original_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
