"""A model's weights as the decoder reads them, whatever file they come from: tensors by GGUF name
(``blk.0.attn_q.weight``), each either block bytes per row in a format of batchgpu/quant.py (kept that way
on the device) or a float32 array. :func:`open_weights` opens a GGUF file or a Hugging Face directory."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BatchError
from ..quant import BLOCK, FORMATS, dequantize_words, to_device_words
from .config import LlamaConfig

BLOCK_TYPES = {name.upper(): name for name in FORMATS}
"""Tensor types (GGUF's and safetensors' names) kept as blocks on the device (batchgpu/quant.py)."""
FLOAT_TYPES = ("F32", "F16", "BF16")

MODEL_TENSORS = re.compile(
    r"token_embd\.weight|output_norm\.weight|output\.weight|rope_freqs\.weight"
    r"|blk\.\d+\.(attn_norm|ffn_norm|attn_output|ffn_gate|ffn_up|ffn_down|attn_q_norm|attn_k_norm)\.weight"
    r"|blk\.\d+\.attn_[qkv]\.(weight|bias)"
)
"""Every tensor the decoder computes with (``rope_freqs``: the config's RoPE factors); a file holding others
(biases elsewhere, a model of another shape) is refused rather than run without them."""

Raw = tuple[np.ndarray, "str | None", tuple[int, ...]]


def block_format(kind: str, shape: tuple[int, ...], name: str) -> str | None:
    """The device format of a tensor of type ``kind`` (GGUF or safetensors spelling): None (float32) for
    F32, for vectors and for float16 / bfloat16 rows that are not whole blocks, else its block format;
    BatchError naming the tensor for types nobody here reads."""
    if kind == "F32" or (kind in FLOAT_TYPES and (len(shape) != 2 or shape[1] % BLOCK)):
        return None
    if kind not in BLOCK_TYPES:
        supported = ", ".join(["F32", *BLOCK_TYPES])
        raise BatchError(f"tensor {name}: block format {kind} is not supported; supported: {supported}")
    return BLOCK_TYPES[kind]


def refuse_unused(source: str, names: Iterable[str]) -> None:
    """BatchError naming the first tensor the decoder would not use (the file is not the model it runs)."""
    extra = sorted(name for name in names if not MODEL_TENSORS.fullmatch(name))
    if extra:
        raise BatchError(
            f"{source}: tensor {extra[0]!r} is not used by this decoder (and {len(extra) - 1} more); "
            "refusing rather than computing without it"
        )


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
    def codec(self) -> Any:
        """The model's :class:`~batchgpu.llm.text.TextCodec` (tokenizer, end token, chat template)."""


def open_weights(path: Path | str) -> Weights:
    """The weights of a GGUF file, or of a Hugging Face directory (``config.json`` + ``*.safetensors``)."""
    path = Path(path)
    if path.is_dir():
        from .safetensors_dir import SafetensorsWeights

        return SafetensorsWeights(path)
    if not path.is_file():
        raise BatchError(f"model {str(path)!r}: no such file or directory")
    from .gguf_file import GGUFWeights

    return GGUFWeights(path)
