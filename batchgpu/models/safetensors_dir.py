"""Weights from a Hugging Face model directory: ``config.json`` and ``*.safetensors`` (one file or shards
with ``model.safetensors.index.json``; float32, float16 or bfloat16). Tensors are renamed to GGUF's names
with the ``gguf`` package's own name map and read one at a time from memory-mapped files, so loading holds
about one tensor in host memory beyond what the device keeps; 2-D float16 / bfloat16 weights go to the
device as they are (``f16`` / ``bf16`` blocks), everything else as float32.

The safetensors header (8 bytes of length, then JSON naming each tensor's dtype, shape and byte range) is
read here because the ``safetensors`` package's numpy reader has no bfloat16."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BatchError
from .config import LlamaConfig
from .weights import Raw, Weights, block_format, refuse_unused

STORED_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
"""safetensors dtypes read here -> the numpy type their bytes are mapped as (bfloat16: raw 16-bit words)."""

RECOMPUTED = ("rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that the decoder computes itself."""


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte offset."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def array(self) -> np.ndarray:
        """The tensor's bytes, memory-mapped (read when touched)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        if count == 0:
            return np.zeros(self.shape, STORED_TYPES[self.dtype])
        return np.memmap(self.file, STORED_TYPES[self.dtype], "r", self.offset, self.shape)


def read_header(file: Path) -> dict[str, Stored]:
    """The tensors of one safetensors file, by their name in the file."""
    with file.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in STORED_TYPES:
            raise BatchError(
                f"{file.name}: tensor {name} has dtype {entry['dtype']}; supported: {', '.join(STORED_TYPES)}"
            )
        tensors[name] = Stored(file, entry["dtype"], tuple(entry["shape"]), 8 + length + entry["data_offsets"][0])
    return tensors


def shard_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / shard for shard in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise BatchError(f"{directory}: no *.safetensors files (a Hugging Face checkpoint in safetensors format)")
    return files


def gguf_names(config: LlamaConfig, names: list[str]) -> dict[str, str]:
    """GGUF name -> the checkpoint's name, by the ``gguf`` package's tensor name map; a name it does not map
    is kept as it is (and refused as unused)."""
    import gguf

    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == config.architecture)
    name_map = gguf.get_tensor_name_map(architecture, config.layers)
    renamed = {}
    for name in names:
        if name.endswith(RECOMPUTED):
            continue
        renamed[name_map.get_name(name, try_suffixes=(".weight", ".bias")) or name] = name
    return renamed


class SafetensorsWeights(Weights):
    """A Hugging Face checkpoint's tensors under GGUF names (q/k rows as stored: no permutation)."""

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise BatchError(f"{self.path}: no config.json (a Hugging Face model directory has one)")
        self.settings: dict[str, Any] = json.loads(config_file.read_text())
        self.config = LlamaConfig.from_hf(self.settings)
        stored: dict[str, Stored] = {}
        for file in shard_files(self.path):
            stored.update(read_header(file))
        self._stored = {gguf: stored[name] for gguf, name in gguf_names(self.config, list(stored)).items()}
        refuse_unused(f"{self.path.name} ({self.settings['model_type']})", self._stored)
        if "output.weight" in self._stored and self.settings.get("tie_word_embeddings"):
            del self._stored["output.weight"]  # tied: the embedding is the head
        if "output.weight" not in self._stored and self.settings.get("tie_word_embeddings") is False:
            raise BatchError(f"{self.path.name}: tie_word_embeddings is false but the checkpoint has no lm_head")

    def names(self) -> list[str]:
        return list(self._stored)

    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        stored = self._stored[name]
        return block_format(stored.dtype, stored.shape, f"{self.path.name}: tensor {name}"), stored.shape

    def raw(self, name: str) -> Raw:
        qtype, shape = self.layout(name)
        data = self._stored[name].array()
        if qtype is not None:  # float16 / bfloat16 rows: their bytes are the blocks
            return np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1), qtype, shape
        if self._stored[name].dtype == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32), None, shape
        return np.asarray(data, np.float32), None, shape

    def codec(self) -> Any:
        from ..llm.text import TextCodec

        return TextCodec.from_hf(self.path)
