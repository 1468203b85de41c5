"""GGUF block-quantized weights: the block-format table (one row per format: GGUF block size, the
device's 4-byte aligned layout, the numpy dequantization the reference executor and ``Device.read``
use), repacking GGUF bytes for the device, and the checks. Blocks run along the last (K) axis of a
(rows, K) matrix, as in llama.cpp (``ggml-quants.c``).

Device layout: each GGUF block copied into whole 4-byte words, its fields at the GGUF offsets except
where a 2-byte scale would leave the quants unaligned (a 2-byte pad after it):

- Q4_0 18 -> 20 bytes: [d: f16 | pad], 16 bytes of nibbles (byte j: weight j low, j + 16 high); w = d (q - 8).
- Q4_1 20 bytes: [d | m], 16 bytes of nibbles; w = d q + m.
- Q5_0 22 -> 24 bytes: [d | pad], qh (bit j: the fifth bit of weight j), 16 bytes of nibbles; w = d (q - 16).
- Q5_1 24 bytes: [d | m], qh, 16 bytes of nibbles; w = d q + m.
- Q8_0 34 -> 36 bytes: [d | pad], 32 int8; w = d q.
- Q4_K 144 bytes (256 weights): d, dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks, 128 bytes of
  nibbles (sub-blocks 2i and 2i + 1: the low and high nibbles of bytes 32i..32i + 31); w = d sc q - dmin m.
- Q5_K 176 bytes: as Q4_K with 32 bytes of fifth bits (bit s of byte j: sub-block s, weight j) before the
  nibbles.
- Q6_K 210 -> 212 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16
  weights), d, pad; w = d sc (q - 32).
- F16, BF16: 32 weights (64 bytes) per block, as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DTypeError, ShapeError

BLOCK = 32
"""Weights per block as the kernels walk them (a K-quant super-block is 8 of them)."""


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of each block, as a (n, 1) float32 column."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per row -> 32 values: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes per row (a little-endian u32) -> 32 bits, bit j for weight j."""
    bits = qh.copy().view(np.uint32)
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 4:20]).astype(np.float32) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * (q.astype(np.float32) - 16)


def _q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 4:36].view(np.int8).astype(np.float32)


def k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and mins of each Q4_K/Q5_K super-block from its 12 bytes: sub-blocks 0-3 in the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 with their top two
    bits in the top bits of bytes 0-3 and 4-7."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], axis=1)
    mins = np.concatenate([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quants(b: np.ndarray, fifth: np.ndarray | None) -> np.ndarray:
    """Q4_K (``fifth`` None) or Q5_K: 8 sub-blocks of 32, w = d sc q - dmin m."""
    scales, mins = k_scales(b[:, 4:16])
    qs = b[:, -128:].reshape(-1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)  # sub-block 2i: low, 2i + 1: high
    if fifth is not None:
        q = q | (((fifth[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    d, dmin = _f16(b, 0)[:, :, None], _f16(b, 2)[:, :, None]
    return (d * scales[:, :, None] * q.astype(np.float32) - dmin * mins[:, :, None]).reshape(-1, 256)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_quants(b, None)


def _q5_k(b: np.ndarray) -> np.ndarray:
    return _k_quants(b, b[:, 16:48])


def _q6_k(b: np.ndarray) -> np.ndarray:
    """Two halves of 128 weights: half h's weights 32i + j (i < 4) take the low (i < 2) or high nibble of
    ql byte 64h + 32(i % 2) + j and bits 2i, 2i + 1 of qh byte 32h + j; scale 8h + 2i + j // 16."""
    ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, half, i, j)
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    q = (low | (high << 4)).astype(np.float32) - 32
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 4, 2, 1)
    d = _f16(b, 208)[:, :, None, None, None]
    return (d * scales * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, 256)


def _f16_block(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _bf16_block(b: np.ndarray) -> np.ndarray:
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class BlockFormat:
    """One row of the block-format table: ``weights`` per GGUF block of ``gguf_bytes``; on the device
    ``device_bytes`` (a multiple of 4) with the GGUF bytes at ``segments`` ((gguf offset, length, device
    offset) each); ``dequantize`` of (blocks, device_bytes) uint8 to (blocks, weights) float32."""

    name: str
    weights: int
    gguf_bytes: int
    device_bytes: int
    dequantize: Callable[[np.ndarray], np.ndarray]
    segments: tuple[tuple[int, int, int], ...] = ()

    @property
    def device_block_words(self) -> int:
        return self.device_bytes // 4

    def repack(self, blocks: np.ndarray) -> np.ndarray:
        """(n, gguf_bytes) uint8 -> (n, device_bytes) uint8."""
        if not self.segments and self.device_bytes == self.gguf_bytes:
            return blocks
        return repack_blocks(blocks, self.device_bytes, self.segments or ((0, self.gguf_bytes, 0),))


def repack_blocks(blocks: np.ndarray, device_bytes: int, segments: Sequence[Sequence[int]]) -> np.ndarray:
    """(n, gguf bytes) uint8 blocks -> (n, ``device_bytes``) uint8, the bytes at ``segments`` ((gguf offset,
    length, device offset) each) moved, the rest zero."""
    out = np.zeros((blocks.shape[0], device_bytes), np.uint8)
    for source, length, target in segments:
        out[:, target : target + length] = blocks[:, source : source + length]
    return out


_AFTER_SCALE = ((0, 2, 0),)  # a 2-byte scale, then 2 bytes of pad
FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("q4_0", 32, 18, 20, _q4_0, (*_AFTER_SCALE, (2, 16, 4))),
        BlockFormat("q4_1", 32, 20, 20, _q4_1),
        BlockFormat("q5_0", 32, 22, 24, _q5_0, (*_AFTER_SCALE, (2, 20, 4))),
        BlockFormat("q5_1", 32, 24, 24, _q5_1),
        BlockFormat("q8_0", 32, 34, 36, _q8_0, (*_AFTER_SCALE, (2, 32, 4))),
        BlockFormat("q4_k", 256, 144, 144, _q4_k),
        BlockFormat("q5_k", 256, 176, 176, _q5_k),
        BlockFormat("q6_k", 256, 210, 212, _q6_k),
        BlockFormat("f16", 32, 64, 64, _f16_block),
        BlockFormat("bf16", 32, 64, 64, _bf16_block),
    )
}
"""Every block format batchgpu stores, by name (``Device.quantized(blocks, name, shape)``)."""

TUNED_FORMATS = frozenset({"q4_1", "q8_0"})
"""Formats with kernels of their own (``matmul_q4_1``, ...: units of block words per lane in the GPU
form); every other format runs the generic entries (``matmul_blocks``, ``embedding_blocks``), which
dequantize a whole 32-weight block through the format's ``load_block`` (``shaders/*/formats/``)."""


def kernel_entry(prefix: str, qtype: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The entry of a quantized kernel family (``prefix`` "matmul", "embedding") for format ``qtype`` and
    the snippets that render the format into it."""
    if qtype in TUNED_FORMATS:
        return f"{prefix}_{qtype}", ()
    return f"{prefix}_blocks", (("FORMAT", qtype),)


def quant_format(qtype: str) -> BlockFormat:
    try:
        return FORMATS[qtype.lower()]
    except (KeyError, AttributeError):
        raise DTypeError(
            f"quantized: block format {qtype!r} is not supported; supported: {', '.join(FORMATS)}"
        ) from None


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


def _blocks(raw: np.ndarray, fmt: BlockFormat, shape: tuple[int, int]) -> np.ndarray:
    rows, cols = shape
    if cols % fmt.weights or cols % BLOCK:
        raise ShapeError(
            f"quantized {fmt.name}: K = {cols} is not a multiple of the {max(fmt.weights, BLOCK)}-weight block"
        )
    expected = rows * cols // fmt.weights * fmt.gguf_bytes
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != expected:
        raise ShapeError(
            f"quantized {fmt.name}: {data.size} bytes do not hold a {shape} matrix ({expected} bytes expected)"
        )
    return data.reshape(-1, fmt.gguf_bytes)


def to_device_words(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """GGUF block bytes of a (rows, K) matrix to the device's 4-byte aligned uint32 words."""
    fmt = quant_format(qtype)
    return np.ascontiguousarray(fmt.repack(_blocks(raw, fmt, shape))).view(np.uint32).reshape(-1)


def dequantize_words(words: np.ndarray, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Device words back to a float32 (rows, K) matrix (the reference executor's view)."""
    fmt = quant_format(qtype)
    blocks = np.ascontiguousarray(words, dtype=np.uint32).view(np.uint8).reshape(-1, fmt.device_bytes)
    return fmt.dequantize(blocks).reshape(shape)
