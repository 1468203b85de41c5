"""GGUF files (llama.cpp's format) read with every count, length, type and offset checked against the file
before it is used: the header, the metadata (key -> value), the tensor infos (name, dimensions, GGML type,
offset), then each tensor's bytes inside the data section and no two tensors' bytes overlapping. Anything
else is a :class:`~batchgpu.errors.ModelFileError` naming the file and the field.

The ``gguf`` package's GGML types and their block sizes are used; its reader is not: it takes lengths as
they come (an array of 2**40 bytes claimed by a file of 60 bytes has it allocate until memory runs out)
and builds several Python objects per array item. Here numeric arrays are read as one numpy array each,
strings once each, and a file's metadata holds at most :data:`MAX_METADATA_ITEMS` array items."""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError
from .fields import Fields

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
"""GGML_MAX_DIMS: a tensor has 1 to 4 dimensions."""
DEFAULT_ALIGNMENT = 32
MAX_METADATA_ITEMS = 1 << 22
"""Array items across a file's metadata: 4x the largest vocabularies' tokens, types and merges together
(Gemma 3: 262144 tokens with scores and types)."""

SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("?"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
"""GGUF scalar value types (the format's numbering, ``gguf.GGUFValueType``) -> their little-endian numpy
types: uint8, int8, uint16, int16, uint32, int32, float32, bool, uint64, int64, float64."""
STRING, ARRAY = 8, 9
STRING_HEAD = 8  # a string's uint64 length
SMALLEST_KV = 8 + 4 + 1  # an empty key, the value type and a one-byte value
SMALLEST_TENSOR_INFO = 8 + 4 + 8 + 4 + 8  # an empty name, n_dims, one dimension, the type and the offset


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its GGML type's name (``F32``, ``Q4_K``), its shape outermost first
    (``(rows, K)``; GGUF lists dimensions innermost first) and its bytes' place in the file."""

    name: str
    kind: str
    shape: tuple[int, ...]
    offset: int
    size: int


class _Cursor:
    """Reads the file's fields in order; each read past the end is a ModelFileError naming the field."""

    def __init__(self, view: memoryview, source: str) -> None:
        self.view, self.source, self.at = view, source, 0

    def remaining(self) -> int:
        return len(self.view) - self.at

    def take(self, size: int, what: str) -> int:
        """The offset of the next ``size`` bytes, which hold ``what``."""
        if size > self.remaining():
            raise ModelFileError(
                f"{self.source}: the file ends at byte {len(self.view)} inside {what} "
                f"({size} bytes from byte {self.at})"
            )
        self.at += size
        return self.at - size

    def unpack(self, kind: str, what: str) -> int:
        return struct.unpack_from(kind, self.view, self.take(struct.calcsize(kind), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", f"{what} (its length)")
        start = self.take(length, what)
        try:
            return str(self.view[start : start + length], "utf-8")
        except UnicodeDecodeError as error:
            raise ModelFileError(f"{self.source}: {what} must be UTF-8 text: {error}") from None


class GGUFFile:
    """A GGUF file's ``metadata`` (key -> int, float, bool, str, list of str, or a 1-D numpy array) and
    ``tensors`` by name, everything checked against the file; tensor bytes are memory-mapped."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.source = str(self.path)
        size = self.path.stat().st_size
        if size < len(MAGIC):
            raise ModelFileError(f"{self.source}: the file ends at byte {size} inside the magic (a GGUF file)")
        self.bytes = np.memmap(self.path, np.uint8, "r")
        cursor = _Cursor(self.bytes.data, self.source)
        self._header(cursor)
        self.items = 0
        self.metadata: dict[str, Any] = {}
        for i in range(self.kv_count):
            self._key_value(cursor, i)
        self._check_count("tensor_count", self.tensor_count, SMALLEST_TENSOR_INFO)
        infos: dict[str, GGUFTensor] = {}
        for i in range(self.tensor_count):
            info = self._tensor_info(cursor, i)
            if info.name in infos:
                raise ModelFileError(f"{self.source}: tensor {info.name!r} appears twice")
            infos[info.name] = info
        alignment = self.fields().integer("general.alignment", DEFAULT_ALIGNMENT, low=1)
        if alignment & (alignment - 1):
            raise self.fields().refuse("general.alignment", "a power of two", alignment)
        data = -(-cursor.at // alignment) * alignment
        self.tensors = {name: self._placed(info, data, alignment) for name, info in infos.items()}
        self._check_disjoint()

    def fields(self) -> Fields:
        """The metadata as :class:`~batchgpu.models.fields.Fields` (keys in full: ``llama.block_count``)."""
        return Fields(self.metadata, self.source)

    def data(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes (uint8, memory-mapped)."""
        return self.bytes[tensor.offset : tensor.offset + tensor.size]

    # the layout, in file order ----------------------------------------------------------------------

    def _header(self, cursor: _Cursor) -> None:
        start = cursor.take(len(MAGIC), "the magic")
        magic = bytes(cursor.view[start : start + len(MAGIC)])
        if magic != MAGIC:
            raise ModelFileError(f"{self.source}: the magic must be {MAGIC!r} (a GGUF file), got {magic!r}")
        version = cursor.unpack("<I", "the version")
        if version not in VERSIONS:
            order = " (a big-endian file, not supported)" if version and not version & 0xFFFF else ""
            raise ModelFileError(f"{self.source}: the version must be 2 or 3, got {version}{order}")
        self.tensor_count = cursor.unpack("<Q", "tensor_count")
        self.kv_count = cursor.unpack("<Q", "kv_count")
        self._check_count("kv_count", self.kv_count, SMALLEST_KV)

    def _check_count(self, name: str, count: int, smallest: int) -> None:
        """ModelFileError where ``count`` entries of at least ``smallest`` bytes each cannot fit in the file
        (a count that fits is read entry by entry, each read checked)."""
        if count * smallest > len(self.bytes):
            raise ModelFileError(
                f"{self.source}: {name} must be at most {len(self.bytes) // smallest} (each entry takes at least "
                f"{smallest} of the file's {len(self.bytes)} bytes), got {count}"
            )

    def _key_value(self, cursor: _Cursor, index: int) -> None:
        key = cursor.string(f"key {index} (of kv_count {self.kv_count})")
        if key in self.metadata:
            raise ModelFileError(f"{self.source}: key {key!r} appears twice")
        kind = cursor.unpack("<I", f"{key!r} (its type)")
        self.metadata[key] = self._value(cursor, key, kind)

    def _value(self, cursor: _Cursor, key: str, kind: int) -> Any:
        if kind in SCALARS:
            dtype = SCALARS[kind]
            return np.frombuffer(cursor.view, dtype, 1, cursor.take(dtype.itemsize, repr(key)))[0].item()
        if kind == STRING:
            return cursor.string(repr(key))
        if kind != ARRAY:
            raise ModelFileError(f"{self.source}: {key!r} type must be a GGUF value type (0 to 12), got {kind}")
        item = cursor.unpack("<I", f"{key!r} (its item type)")
        count = cursor.unpack("<Q", f"{key!r} (its length)")
        if item not in SCALARS and item != STRING:
            raise ModelFileError(
                f"{self.source}: {key!r} item type must be a GGUF scalar or string type, got {item}"
                + (" (arrays of arrays are not supported)" if item == ARRAY else "")
            )
        itemsize = SCALARS[item].itemsize if item in SCALARS else STRING_HEAD
        if count * itemsize > cursor.remaining():
            raise ModelFileError(
                f"{self.source}: {key!r} length must be at most {cursor.remaining() // itemsize} (what the rest of "
                f"the file holds), got {count}"
            )
        self.items += count
        if self.items > MAX_METADATA_ITEMS:
            raise ModelFileError(
                f"{self.source}: {key!r} takes the metadata's array items to {self.items}; at most "
                f"{MAX_METADATA_ITEMS} are read"
            )
        if item == STRING:
            return [cursor.string(f"{key!r} item {i}") for i in range(count)]
        dtype = SCALARS[item]
        return np.frombuffer(cursor.view, dtype, count, cursor.take(count * itemsize, repr(key))).copy()

    def _tensor_info(self, cursor: _Cursor, index: int) -> GGUFTensor:
        name = cursor.string(f"tensor {index}'s name (of tensor_count {self.tensor_count})")
        what = f"tensor {name!r}"
        dims = cursor.unpack("<I", f"{what} n_dims")
        if not 1 <= dims <= MAX_DIMS:
            raise ModelFileError(f"{self.source}: {what} n_dims must be in [1, {MAX_DIMS}], got {dims}")
        extents = [cursor.unpack("<Q", f"{what} dimension {d}") for d in range(dims)]
        code = cursor.unpack("<I", f"{what} type")
        offset = cursor.unpack("<Q", f"{what} offset")
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            kind = GGMLQuantizationType(code)
            block, block_bytes = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise ModelFileError(f"{self.source}: {what} type must be a GGML type, got {code}") from None
        for d, extent in enumerate(extents):
            if extent < 1:
                raise ModelFileError(f"{self.source}: {what} dimension {d} must be at least 1, got {extent}")
        if extents[0] % block:
            raise ModelFileError(
                f"{self.source}: {what} dimension 0 must be a multiple of {kind.name}'s block of {block}, "
                f"got {extents[0]}"
            )
        elements = int(np.prod(extents, dtype=object))
        return GGUFTensor(name, kind.name, tuple(reversed(extents)), offset, elements // block * block_bytes)

    def _placed(self, info: GGUFTensor, data: int, alignment: int) -> GGUFTensor:
        """The tensor with its absolute offset, checked to lie inside the file."""
        what = f"tensor {info.name!r}"
        if info.offset % alignment:
            raise ModelFileError(
                f"{self.source}: {what} offset must be a multiple of the alignment {alignment}, got {info.offset}"
            )
        begin = data + info.offset
        if begin + info.size > len(self.bytes):
            raise ModelFileError(
                f"{self.source}: {what} data (bytes {begin} to {begin + info.size}, shape {info.shape} "
                f"{info.kind}) runs past the end of the file ({len(self.bytes)} bytes)"
            )
        return GGUFTensor(info.name, info.kind, info.shape, begin, info.size)

    def _check_disjoint(self) -> None:
        placed = sorted(self.tensors.values(), key=lambda t: (t.offset, t.size))
        for before, after in itertools.pairwise(placed):
            if after.offset < before.offset + before.size:
                raise ModelFileError(
                    f"{self.source}: tensor {after.name!r} data (bytes {after.offset} to {after.offset + after.size}) "
                    f"overlaps tensor {before.name!r} (bytes {before.offset} to {before.offset + before.size})"
                )
