"""One safetensors file's header read and checked against the file before any tensor is touched: 8 bytes of
little-endian header length (at most the file's size less 8), then a JSON object naming each tensor's
dtype, shape and byte range ``data_offsets`` in the data section after the header. Each entry's dtype must
be one read here, its shape a list of integers >= 0, its range inside the data section and exactly
shape x dtype bytes long, and no two ranges overlap; ``__metadata__`` is an object of strings. Anything
else is a :class:`~batchgpu.errors.ModelFileError` naming the file, the tensor and the field.

The header is read here because the ``safetensors`` package's numpy reader has no bfloat16."""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError
from .fields import Fields
from .files import describe, parse_json

STORED_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}
"""safetensors dtypes read here -> the numpy type their bytes are mapped as (bfloat16: raw 16-bit words;
int64: the ``position_ids`` buffer BERT checkpoints carry, never a weight)."""
MAX_HEADER_BYTES = 100_000_000
"""The safetensors library's own limit on a header's length."""
METADATA = "__metadata__"


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes are: its file, dtype, shape, absolute byte offset and byte count."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    size: int

    def array(self) -> np.ndarray:
        """The tensor's bytes, memory-mapped (read when touched)."""
        if 0 in self.shape:
            return np.zeros(self.shape, STORED_TYPES[self.dtype])
        return np.memmap(self.file, STORED_TYPES[self.dtype], "r", self.offset, self.shape)


def read_header(file: Path) -> dict[str, Stored]:
    """The tensors of one safetensors file by their name in the file, every entry checked against it."""
    size = file.stat().st_size
    with file.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{file}: header length must be 8 bytes, got a file of {size} bytes")
        (length,) = struct.unpack("<Q", head)
        limit = min(size - 8, MAX_HEADER_BYTES)
        if length > limit:
            raise ModelFileError(
                f"{file}: header length must be at most {limit} (the file's {size} bytes less 8, and at most "
                f"{MAX_HEADER_BYTES}), got {length}"
            )
        header = parse_json(handle.read(length), file, "the header")
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: the header must be a JSON object, got {describe(header)}")
    metadata = header.get(METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFileError(f"{file}: {METADATA} must be an object of strings, got {describe(metadata)}")
    data_size, start = size - 8 - length, 8 + length
    tensors = {name: stored(file, name, entry, data_size, start) for name, entry in header.items() if name != METADATA}
    check_disjoint(file, tensors, start)
    return tensors


def stored(file: Path, name: str, entry: Any, data_size: int, start: int) -> Stored:
    """One header entry, checked: ``data_offsets`` are relative to the data section at byte ``start``."""
    if not isinstance(entry, dict):
        raise ModelFileError(
            f"{file}: tensor {name!r} must be an object of dtype, shape and data_offsets, got {describe(entry)}"
        )
    fields = Fields(entry, file, f"tensor {name!r} ")
    dtype = fields.text("dtype", choices=STORED_TYPES)
    shape = tuple(int(extent) for extent in fields.integers("shape", low=0, high=max(data_size, 1)))
    begin, end = range_of(fields, data_size)
    expected = byte_count(shape, np.dtype(STORED_TYPES[dtype]).itemsize, data_size)
    if end - begin != expected:
        raise fields.refuse(
            "data_offsets",
            f"a range of shape {list(shape)} x {dtype} = {expected} bytes",
            (begin, end),
            f"[{begin}, {end}) ({end - begin} bytes)",
        )
    return Stored(file, dtype, shape, start + begin, end - begin)


def range_of(fields: Fields, data_size: int) -> tuple[int, int]:
    """``data_offsets``: [begin, end] with 0 <= begin <= end <= the data section's size."""
    expected = f"[begin, end] with 0 <= begin <= end <= {data_size} (the data section's size)"
    offsets = fields.integers("data_offsets", low=0, high=1 << 62)
    if len(offsets) != 2 or not offsets[0] <= offsets[1] <= data_size:
        raise fields.refuse("data_offsets", expected, offsets)
    return int(offsets[0]), int(offsets[1])


def byte_count(shape: tuple[int, ...], itemsize: int, limit: int) -> int:
    """shape x itemsize bytes, or ``limit + 1`` once the product passes ``limit`` (no huge integers)."""
    if 0 in shape:
        return 0
    count = itemsize
    for extent in shape:
        count *= extent
        if count > limit:
            return limit + 1
    return count


def check_disjoint(file: Path, tensors: dict[str, Stored], start: int) -> None:
    """ModelFileError where two tensors' byte ranges overlap (``start``: the data section's first byte)."""
    ranges = sorted((t.offset - start, t.offset - start + t.size, name) for name, t in tensors.items())
    for (_, end, name), (begin, after, other) in itertools.pairwise(ranges):
        if begin < end:
            raise ModelFileError(
                f"{file}: tensor {other!r} data_offsets [{begin}, {after}) overlap those of tensor {name!r} "
                f"(ending at {end})"
            )
