"""Weights from a Hugging Face model directory: ``config.json`` and ``*.safetensors`` (one file or shards
with ``model.safetensors.index.json``; float32, float16 or bfloat16). Tensors are renamed to GGUF's names
with the ``gguf`` package's own name map and read one at a time from memory-mapped files, so loading holds
about one tensor in host memory beyond what the device keeps; 2-D float16 / bfloat16 weights go to the
device as they are (``f16`` / ``bf16`` blocks), everything else as float32.

Every file is read as untrusted input (batchgpu/models/files.py): the index may name only plain file names
that resolve inside the directory, and must list exactly the tensors its shards hold; each shard's header is
checked against its file (batchgpu/models/safetensors_file.py); no tensor is in two shards; the config's
sizes are checked (batchgpu/models/config.py) and every tensor's shape against them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BatchError, ModelFileError
from .codec import TextCodec
from .config import LlamaConfig, hf_model_type, hf_tied
from .decoder import PART_TENSORS
from .fields import Fields
from .files import model_file, optional_file, read_json
from .safetensors_file import Stored, read_header
from .weights import Raw, Weights, block_format, check_tensors, check_vocabulary

INDEX = "model.safetensors.index.json"
RECOMPUTED = ("rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that the decoder computes itself."""
LANGUAGE_MODEL_NAMES = {
    "gemma3": (
        {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.", "model.language_model.": "model."},
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    )
}
"""A multimodal model's ``model_type`` -> (the prefixes of its language model's tensors -> those of the text-only
model's, the prefixes of the tensors text does not use, left unread): transformers 4's and 5's names alike."""
NORM_SHIFTS = {"gemma3": 1.0}
"""Architecture -> what llama.cpp's converter adds to each of its RMS norm weights (GGUF name ``*norm.weight``):
Gemma's norm multiplies by ``1 + w`` and stores ``w``; a GGUF file holds ``1 + w`` (added in float32, as
transformers computes it), which the decoder multiplies by."""


def shard_files(directory: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The checkpoint's safetensors files, and the tensor -> file map of its index where it has one (else
    its files are every ``*.safetensors`` of the directory)."""
    index_file = optional_file(directory, INDEX)
    if index_file is None:
        files = [
            model_file(directory, file.name, directory, "file") for file in sorted(directory.glob("*.safetensors"))
        ]
        if not files:
            raise BatchError(f"{directory}: no *.safetensors files (a Hugging Face checkpoint in safetensors format)")
        return files, None
    weight_map = Fields(read_json(index_file), index_file).mapping("weight_map")
    if weight_map is None:
        raise ModelFileError(f"{index_file}: weight_map is missing")
    places = {
        tensor: model_file(directory, shard, index_file, f"weight_map[{tensor!r}]")
        for tensor, shard in weight_map.values.items()
    }
    return sorted(set(places.values())), places


def read_checkpoint(directory: Path) -> dict[str, Stored]:
    """Every tensor of the checkpoint by its name, each in one file, as its index (if any) says."""
    files, places = shard_files(directory)
    stored: dict[str, Stored] = {}
    for file in files:
        for name, tensor in read_header(file).items():
            if name in stored:
                raise ModelFileError(
                    f"{file}: tensor {name!r} is in two shards: {stored[name].file.name} and {file.name}"
                )
            stored[name] = tensor
    if places is not None:
        index = directory / INDEX
        for name, place in places.items():
            if name not in stored or stored[name].file != place:
                where = f"in {stored[name].file.name}" if name in stored else "in no shard"
                raise ModelFileError(f"{index}: weight_map[{name!r}] is {place.name}, but the tensor is {where}")
        for name, tensor in stored.items():
            if name not in places:
                raise ModelFileError(f"{index}: weight_map lacks tensor {name!r} of {tensor.file.name}")
    return stored


def gguf_names(
    config: LlamaConfig, names: list[str], model_type: str | None = None, source: Path | str = ""
) -> dict[str, str]:
    """GGUF name -> the checkpoint's name, by the ``gguf`` package's tensor name map (a multimodal
    ``model_type``'s language model tensors first renamed as the text-only model's, its other tensors left
    out: :data:`LANGUAGE_MODEL_NAMES`); a name it does not map is kept as it is (and refused as unused), two
    names of one GGUF name are refused (``source`` names the checkpoint). The map covers at most as many
    layers as there are tensors (a layer index past that cannot have all its tensors)."""
    import gguf

    architecture = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == config.architecture)
    name_map = gguf.get_tensor_name_map(architecture, min(config.layers, len(names)))
    prefixes, unread = LANGUAGE_MODEL_NAMES.get(model_type, ({}, ()))
    renamed = {}
    for name in names:
        if name.endswith(RECOMPUTED) or name.startswith(unread):
            continue
        prefix = next((prefix for prefix in prefixes if name.startswith(prefix)), None)
        text_name = prefixes[prefix] + name.removeprefix(prefix) if prefix is not None else name
        gguf_name = name_map.get_name(text_name, try_suffixes=(".weight", ".bias")) or name
        if gguf_name in renamed:
            raise ModelFileError(
                f"{source}: tensors {renamed[gguf_name]!r} and {name!r} are both the model's {gguf_name!r}"
            )
        renamed[gguf_name] = name
    return renamed


def same_tensor(a: Stored, b: Stored) -> bool:
    """Whether two stored tensors hold the same values: dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a.array().view(np.uint8), b.array().view(np.uint8)))


class SafetensorsWeights(Weights):
    """A Hugging Face checkpoint's tensors under GGUF names and conventions as llama.cpp's converter writes them
    (q/k rows as stored: no permutation; Gemma's norm weights + 1, :data:`NORM_SHIFTS`)."""

    def __init__(self, directory: Path | str) -> None:
        self.path = Path(directory)
        config_file = optional_file(self.path, "config.json")
        if config_file is None:
            raise BatchError(f"{self.path}: no config.json (a Hugging Face model directory has one)")
        self.settings: dict[str, Any] = read_json(config_file)
        self.config = LlamaConfig.from_hf(self.settings, str(config_file))
        stored = read_checkpoint(self.path)
        self._names = gguf_names(self.config, list(stored), self.settings.get("model_type"), self.path)
        self._stored = {gguf: stored[name] for gguf, name in self._names.items()}
        self.check_head(hf_tied(self.settings, str(config_file)), config_file)
        self.check_biases(config_file)
        shapes = {name: tensor.shape for name, tensor in self._stored.items()}
        check_tensors(self.config, shapes, self.describe, f"{self.path} (by {config_file.name})")
        for name in self._stored:
            self.layout(name)

    def check_head(self, tied: bool, config_file: Path) -> None:
        """The output head as ``tied`` (tie_word_embeddings, or its model type's default) says: the token embedding
        (a checkpoint's own lm_head, which transformers 4 would replace by it and 5 keep, must then be equal to it),
        or the checkpoint's lm_head (which must be there: transformers would start from random weights)."""
        head = self._stored.get("output.weight")
        if tied and head is not None:
            embedding = self._stored.get("token_embd.weight")
            if embedding is None or not same_tensor(head, embedding):
                raise ModelFileError(
                    f"{self.describe('output.weight')} differs from the token embedding, but tie_word_embeddings is "
                    "true (transformers 4 would use the embedding, 5 this head); refusing rather than choosing"
                )
            del self._stored["output.weight"]  # tied: the embedding is the head
        if not tied and head is None:
            absent = not Fields(self.settings, config_file).has("tie_word_embeddings")
            why = f" (absent: a {self.settings['model_type']} model's default)" if absent else ""
            raise ModelFileError(f"{config_file}: tie_word_embeddings is false{why} but the checkpoint has no lm_head")

    def check_biases(self, config_file: Path) -> None:
        """ModelFileError where the checkpoint has q/k/v biases its model type has none of (transformers' model
        would leave them unread: :attr:`~batchgpu.models.config.HFModelType.qkv_biases`)."""
        if hf_model_type(self.settings).qkv_biases:
            return
        for name in self._stored:
            if name.startswith("blk.") and name.split(".", 2)[2] in PART_TENSORS["qkv_biases"]:
                raise ModelFileError(
                    f"{self.describe(name)} is a q/k/v bias, but a {self.settings['model_type']} model has none "
                    f"(attention_bias is false or absent in {config_file.name}; transformers would not read it); "
                    "refusing rather than computing a different model"
                )

    def describe(self, name: str) -> str:
        """The tensor as messages name it: its file and its name there (and GGUF's)."""
        stored_name = self._names[name]
        return f"{self._stored[name].file}: tensor {stored_name!r}" + (f" ({name})" if stored_name != name else "")

    def names(self) -> list[str]:
        return list(self._stored)

    def layout(self, name: str) -> tuple[str | None, tuple[int, ...]]:
        stored = self._stored[name]
        return block_format(stored.dtype, stored.shape, self.describe(name)), stored.shape

    def raw(self, name: str) -> Raw:
        qtype, shape = self.layout(name)
        data = self._stored[name].array()
        if qtype is not None:  # float16 / bfloat16 rows: their bytes are the blocks
            return np.ascontiguousarray(data).view(np.uint8).reshape(shape[0], -1), qtype, shape
        if self._stored[name].dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return self.as_gguf(name, np.asarray(data, np.float32)), None, shape

    def as_gguf(self, name: str, data: np.ndarray) -> np.ndarray:
        """A float32 tensor as a GGUF file holds it: norm weights shifted by :data:`NORM_SHIFTS` (a new array;
        the memory-mapped checkpoint is never written)."""
        shift = NORM_SHIFTS.get(self.config.architecture)
        if shift is None or not name.endswith("norm.weight"):
            return data
        return data + np.float32(shift)

    def codec(self) -> TextCodec:
        return check_vocabulary(TextCodec.from_hf(self.path), self.config, f"{self.path / 'tokenizer.json'}")
