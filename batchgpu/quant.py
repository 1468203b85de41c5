"""GGUF block-quantized weights (Q4_1, Q8_0): host-side layout, repacking for the device, and the
numpy dequantizers the reference executor uses. Blocks run along the last (K) axis of a (rows, K)
matrix, 32 weights per block, as in llama.cpp.

Device layout, 4-byte aligned so WGSL reads whole words:
- Q4_1: the GGUF block as is, 20 bytes = 5 words: [d: f16 | m: f16], then 16 bytes of nibbles
  (byte j holds weight j in its low nibble and weight j + 16 in its high nibble); w = d * q + m.
- Q8_0: the 34-byte GGUF block padded to 36 bytes = 9 words: [d: f16 | 0], then 32 int8; w = d * q.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DTypeError, ShapeError

BLOCK = 32


@dataclass(frozen=True)
class QuantFormat:
    name: str
    gguf_block_bytes: int
    device_block_words: int


FORMATS = {
    "q4_1": QuantFormat("q4_1", 20, 5),
    "q8_0": QuantFormat("q8_0", 34, 9),
}


def quant_format(qtype: str) -> QuantFormat:
    try:
        return FORMATS[qtype.lower()]
    except (KeyError, AttributeError):
        raise DTypeError(f"quantized: unknown block format {qtype!r}; expected one of {', '.join(FORMATS)}") from None


def block_bytes(blocks: Any, what: str) -> np.ndarray:
    """GGUF block data as a flat uint8 array: a uint8/int8 array, ``bytes``, ``bytearray`` or ``memoryview``.
    Other dtypes are refused: casting float weights to bytes would silently make nonsense blocks."""
    if isinstance(blocks, (bytes, bytearray, memoryview)):
        return np.frombuffer(blocks, np.uint8)
    array = np.asarray(blocks)
    if array.dtype not in (np.dtype(np.uint8), np.dtype(np.int8)):
        raise DTypeError(
            f"{what}: blocks must be the GGUF block bytes (uint8 array, bytes or memoryview), got an array of "
            f"dtype {array.dtype.name}; to quantize float weights use gguf.quants.quantize(weights, type)"
        )
    return np.ascontiguousarray(array).view(np.uint8).reshape(-1)


def _blocks(raw: np.ndarray, fmt: QuantFormat, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    if cols % BLOCK:
        raise ShapeError(f"quantized {fmt.name}: K = {cols} is not a multiple of the {BLOCK}-weight block")
    expected = rows * cols // BLOCK * fmt.gguf_block_bytes
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != expected:
        raise ShapeError(
            f"quantized {fmt.name}: {data.size} bytes do not hold a {shape} matrix ({expected} bytes expected)"
        )
    return data.reshape(-1, fmt.gguf_block_bytes)


def to_device_words(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """GGUF block bytes of a (rows, K) matrix to the device's 4-byte aligned uint32 words."""
    fmt = quant_format(qtype)
    blocks = _blocks(raw, fmt, shape)
    if fmt.name == "q8_0":
        padded = np.zeros((blocks.shape[0], 36), np.uint8)
        padded[:, 0:2] = blocks[:, 0:2]
        padded[:, 4:] = blocks[:, 2:]
        blocks = padded
    return np.ascontiguousarray(blocks).view(np.uint32).reshape(-1)


def dequantize_words(words: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Device words back to a float32 (rows, K) matrix (the reference executor's view)."""
    fmt = quant_format(qtype)
    blocks = np.ascontiguousarray(words, dtype=np.uint32).reshape(-1, fmt.device_block_words).view(np.uint8)
    if fmt.name == "q4_1":
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        m = blocks[:, 2:4].view(np.float16).astype(np.float32)
        qs = blocks[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        values = q * d + m
    else:
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        values = blocks[:, 4:36].view(np.int8).astype(np.float32) * d
    return values.reshape(shape)
