"""Weights from a GGUF file (llama.cpp's format, read and checked by batchgpu/models/gguf_reader.py): tensors
kept in their block format, float16 / bfloat16 vectors read as float32, and llama.cpp's q/k row permutation
undone where its converter applied it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .codec import TextCodec
from .config import LlamaConfig
from .gguf_reader import GGUFFile
from .weights import Raw, Weights, block_format, check_tensors, check_vocabulary

PERMUTED_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of attn_q/attn_k (works on float rows and
    on rows of quantized block bytes alike, since blocks run along each row)."""
    n, width = rows.shape
    return rows.reshape(heads, n // heads // 2, 2, width).swapaxes(1, 2).reshape(n, width)


class GGUFWeights(Weights):
    """The GGUF tensors by name, as (rows, K) blocks or float32 arrays, with the q/k fix applied. Opening
    checks the file's layout, its config and every tensor's shape and type against the config."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.config = LlamaConfig.from_gguf(self.file)
        self._tensors = self.file.tensors
        check_tensors(self.config, {n: t.shape for n, t in self._tensors.items()}, self.describe, str(self.path))
        for name in self._tensors:
            self.layout(name)  # a type nobody here reads is refused now, not halfway through an upload

    def describe(self, name: str) -> str:
        """The tensor as messages name it."""
        return f"{self.path}: tensor {name!r}"

    def names(self) -> list[str]:
        return [name for name in self._tensors if name != "rope_freqs.weight"]  # in the config already

    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        tensor = self._tensors[name]
        return block_format(tensor.kind, tensor.shape, self.describe(name)), tensor.shape

    def raw(self, name: str) -> Raw:
        qtype, shape = self.layout(name)
        tensor = self._tensors[name]
        data = self.file.data(tensor)
        if qtype is None and tensor.kind != "F32":  # float16 / bfloat16 vectors and rows of partial blocks
            from gguf import GGMLQuantizationType, quants

            data = quants.dequantize(data, GGMLQuantizationType[tensor.kind])
        elif qtype is None:
            data = data.view("<f4")
        rows = data.reshape(shape[0], -1)
        if self.config.permuted and name.endswith(PERMUTED_TENSORS):
            heads = self.config.heads if "attn_q" in name else self.config.kv_heads
            rows = unpermute_rows(rows, heads)
        if qtype is None:
            return rows.reshape(shape).astype(np.float32), None, shape
        return rows, qtype, shape

    def codec(self) -> TextCodec:
        return check_vocabulary(TextCodec.from_gguf(self.file), self.config, f"{self.path}: tokenizer.ggml.tokens")
