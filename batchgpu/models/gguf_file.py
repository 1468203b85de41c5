"""Weights from a GGUF file (llama.cpp's format, read with the ``gguf`` package): tensors kept in their
block format, float16 / bfloat16 vectors read as float32, and llama.cpp's q/k row permutation undone where
its converter applied it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .config import LlamaConfig
from .weights import FLOAT_TYPES, Raw, Weights, block_format, refuse_unused

PERMUTED_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-RoPE row permutation of attn_q/attn_k (works on float rows and
    on rows of quantized block bytes alike, since blocks run along each row)."""
    n, width = rows.shape
    return rows.reshape(heads, n // heads // 2, 2, width).swapaxes(1, 2).reshape(n, width)


class GGUFWeights(Weights):
    """The GGUF tensors by name, as (rows, K) blocks or float32 arrays, with the q/k fix applied."""

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(path))
        self.config = LlamaConfig.from_gguf(self.reader)
        self._tensors = {t.name: t for t in self.reader.tensors}
        refuse_unused(f"GGUF {self.config.architecture} model", self._tensors)

    def names(self) -> list[str]:
        return [name for name in self._tensors if name != "rope_freqs.weight"]  # in the config already

    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        tensor = self._tensors[name]
        shape = tuple(int(e) for e in reversed(tensor.shape))  # GGUF lists dims innermost first
        return block_format(tensor.tensor_type.name, shape, f"GGUF tensor {name}"), shape

    def raw(self, name: str) -> Raw:
        qtype, shape = self.layout(name)
        tensor = self._tensors[name]
        data = np.asarray(tensor.data)
        if qtype is None and tensor.tensor_type.name in FLOAT_TYPES[1:]:
            from gguf import quants

            data = quants.dequantize(data, tensor.tensor_type)
        if self.config.permuted and name.endswith(PERMUTED_TENSORS):
            heads = self.config.heads if "attn_q" in name else self.config.kv_heads
            data = unpermute_rows(data.reshape(shape[0], -1), heads)
        if qtype is None:
            return data.reshape(shape).astype(np.float32), None, shape
        return data.view(np.uint8), qtype, shape

    def codec(self) -> Any:
        from ..llm.text import TextCodec

        return TextCodec.from_gguf(self.reader)
