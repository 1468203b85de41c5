"""A model's weights as the decoder reads them, whatever file they come from: tensors by GGUF name
(``blk.0.attn_q.weight``), each either block bytes per row in a format of batchgpu/quant.py (kept that way
on the device) or a float32 array, whichever file format they come from (:func:`batchgpu.models.loader.open_weights`
opens either)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..errors import BatchError, ModelFileError
from ..quant import BLOCK, FORMATS, dequantize_words, to_device_words
from .codec import TextCodec
from .config import LlamaConfig

BLOCK_TYPES = {name.upper(): name for name in FORMATS}
"""Tensor types (GGUF's and safetensors' names) kept as blocks on the device (batchgpu/quant.py)."""
FLOAT_TYPES = ("F32", "F16", "BF16")

MODEL_TENSORS: dict[str, tuple[tuple[str, ...], bool]] = {
    "token_embd.weight": (("vocab", "hidden"), True),
    "output_norm.weight": (("hidden",), True),
    "output.weight": (("vocab", "hidden"), False),
    "rope_freqs.weight": (("rope_pairs",), False),
}
LAYER_TENSORS: dict[str, tuple[tuple[str, ...], bool]] = {
    "attn_norm.weight": (("hidden",), True),
    "ffn_norm.weight": (("hidden",), True),
    "attn_q.weight": (("q_rows", "hidden"), True),
    "attn_k.weight": (("kv_rows", "hidden"), True),
    "attn_v.weight": (("kv_rows", "hidden"), True),
    "attn_output.weight": (("hidden", "q_rows"), True),
    "ffn_gate.weight": (("ffn", "hidden"), True),
    "ffn_up.weight": (("ffn", "hidden"), True),
    "ffn_down.weight": (("hidden", "ffn"), True),
    "attn_q.bias": (("q_rows",), False),
    "attn_k.bias": (("kv_rows",), False),
    "attn_v.bias": (("kv_rows",), False),
    "attn_q_norm.weight": (("head_dim",), False),
    "attn_k_norm.weight": (("head_dim",), False),
    "post_attention_norm.weight": (("hidden",), False),
    "post_ffw_norm.weight": (("hidden",), False),
}
"""Every tensor the decoder computes with, per model and per layer (``blk.<i>.``): its shape in the
config's terms and whether every model has it (``rope_freqs``: the config's RoPE factors). A file holding
others (biases elsewhere, layers past the config's count) is refused rather than run without them."""
PAIRED = (("attn_q_norm.weight", "attn_k_norm.weight"), ("post_attention_norm.weight", "post_ffw_norm.weight"))
"""Per-layer tensors a layer has all of or none of, in sets."""

Raw = tuple[np.ndarray, "str | None", tuple[int, ...]]


def block_format(kind: str, shape: tuple[int, ...], name: str) -> str | None:
    """The device format of a tensor of type ``kind`` (GGUF or safetensors spelling): None (float32) for
    F32, for vectors and for float16 / bfloat16 rows that are not whole blocks, else its block format;
    BatchError naming the tensor for types nobody here reads, ModelFileError for a block-quantized tensor
    that is not a matrix."""
    if kind == "F32" or (kind in FLOAT_TYPES and (len(shape) != 2 or shape[1] % BLOCK)):
        return None
    if kind not in BLOCK_TYPES:
        supported = ", ".join(["F32", *BLOCK_TYPES])
        raise BatchError(f"{name}: block format {kind} is not supported; supported: {supported}")
    if len(shape) != 2:
        raise ModelFileError(f"{name}: a tensor in block format {kind} must be a matrix, got shape {shape}")
    return BLOCK_TYPES[kind]


def expected_tensors(config: LlamaConfig) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """Tensor name -> (shape, the shape in the config's terms, required) for a model of ``config``."""
    sizes = {
        "vocab": config.vocab,
        "hidden": config.hidden,
        "ffn": config.ffn,
        "head_dim": config.head_dim,
        "rope_pairs": config.head_dim // 2,
        "q_rows": config.heads * config.head_dim,
        "kv_rows": config.kv_heads * config.head_dim,
    }

    def entry(dims: tuple[str, ...], required: bool) -> tuple[tuple[int, ...], str, bool]:
        return tuple(sizes[d] for d in dims), " x ".join(f"{d} {sizes[d]}" for d in dims), required

    tensors = {name: entry(*spec) for name, spec in MODEL_TENSORS.items()}
    for layer in range(config.layers):
        tensors.update({f"blk.{layer}.{name}": entry(*spec) for name, spec in LAYER_TENSORS.items()})
    return tensors


def check_tensors(
    config: LlamaConfig, shapes: Mapping[str, tuple[int, ...]], describe: Callable[[str], str], model: str
) -> None:
    """ModelFileError unless the tensors (GGUF name -> shape) are those a model of ``config`` computes with,
    each of the shape the config implies and every required one present; ``describe(name)`` names a
    tensor's file and name in it, ``model`` the model's files (for a missing tensor)."""
    expected = expected_tensors(config)
    unused = sorted(name for name in shapes if name not in expected)
    if unused:
        raise ModelFileError(
            f"{describe(unused[0])} is not used by this decoder (and {len(unused) - 1} more; the config's layer "
            f"count is {config.layers}); refusing rather than computing without it"
        )
    for name, (shape, terms, required) in expected.items():
        if name not in shapes:
            if required:
                raise ModelFileError(f"{model}: tensor {name!r} ({terms}) is missing")
            continue
        if tuple(shapes[name]) != shape:
            raise ModelFileError(
                f"{describe(name)} must have the shape the config implies, ({terms}) = {shape}, got {shapes[name]}"
            )
    for layer, paired in ((layer, paired) for layer in range(config.layers) for paired in PAIRED):
        present = [f"blk.{layer}.{name}" for name in paired if f"blk.{layer}.{name}" in shapes]
        if present and len(present) != len(paired):
            missing = next(f"blk.{layer}.{name}" for name in paired if f"blk.{layer}.{name}" not in shapes)
            raise ModelFileError(f"{describe(present[0])} comes without tensor {missing!r}")


def check_vocabulary(codec: TextCodec, config: LlamaConfig, source: str) -> TextCodec:
    """``codec`` where its tokenizer's ids are all rows of the model's embedding; ModelFileError otherwise."""
    if codec.vocab_size > config.vocab:
        raise ModelFileError(
            f"{source} has {codec.vocab_size} tokens, more than the model's vocabulary of {config.vocab} "
            "(token_embd.weight rows)"
        )
    return codec


class Weights(ABC):
    """The tensors of one model file by GGUF name, and the model's :class:`LlamaConfig`."""

    config: LlamaConfig
    path: Path

    @abstractmethod
    def names(self) -> list[str]:
        """Every tensor's name."""

    @abstractmethod
    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        """(block format or None for float32, logical shape), without reading the data."""

    @abstractmethod
    def raw(self, name: str) -> Raw:
        """(data, block format or None, logical shape): block bytes per row (uint8) for block formats."""

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32, blocks dequantized."""
        data, qtype, shape = self.raw(name)
        if qtype is None:
            return data
        return dequantize_words(to_device_words(data, qtype, shape), qtype, shape)

    @abstractmethod
    def codec(self) -> TextCodec:
        """The model's :class:`~batchgpu.models.codec.TextCodec` (tokenizer, end token, chat template)."""
