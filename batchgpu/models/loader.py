"""Opening a model's weights by path: a GGUF file (:class:`~batchgpu.models.gguf_file.GGUFWeights`) or a
Hugging Face directory (:class:`~batchgpu.models.safetensors_dir.SafetensorsWeights`), the two kinds of
:class:`~batchgpu.models.weights.Weights`."""

from __future__ import annotations

from pathlib import Path

from ..errors import BatchError
from .gguf_file import GGUFWeights
from .safetensors_dir import SafetensorsWeights
from .weights import Weights


def open_weights(path: Path | str) -> Weights:
    """The weights of a GGUF file, or of a Hugging Face directory (``config.json`` + ``*.safetensors``)."""
    path = Path(path)
    if path.is_dir():
        return SafetensorsWeights(path)
    if not path.is_file():
        raise BatchError(f"model {str(path)!r}: no such file or directory")
    return GGUFWeights(path)
