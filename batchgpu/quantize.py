"""Float weights to GGUF block bytes (the inverse of batchgpu/quant.py's dequantizers): Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, F16 and BF16 through the ``gguf`` package (llama.cpp's reference rounding), and Q4_K, Q5_K and
Q6_K here, vectorized in numpy (the ``gguf`` package only dequantizes them).

The K-quants here take each sub-block's minimum and maximum (llama.cpp searches for better scales; these
are valid blocks of the same layout, a little less precise): every weight dequantizes to within half a
quantization step (its sub-block's ``d * scale``) of the float given, the float16 super-scales are finite
and non-negative and the 6-bit scales and mins (Q4_K, Q5_K) and int8 scales (Q6_K) in range."""

from __future__ import annotations

import numpy as np

from .errors import DTypeError, ShapeError
from .quant import quant_format

SUB_BLOCKS = 8
"""Q4_K / Q5_K: 32-weight sub-blocks per 256-weight super-block, each with a 6-bit scale and min."""
SCALE_MAX = 63
"""The largest 6-bit scale or min of Q4_K / Q5_K."""
Q6_SUB_BLOCKS, Q6_SCALE_MAX = 16, 127
"""Q6_K: 16-weight sub-blocks per super-block, each with an int8 scale."""


def quantize(weights: np.ndarray, name: str) -> np.ndarray:
    """The GGUF block bytes ``(n, gguf_bytes)`` uint8 of float ``weights`` (any shape; its size a multiple of the
    format's block) in block format ``name`` (batchgpu/quant.py's names: ``q4_0``, ``q4_k``, ``f16``, ...)."""
    fmt = quant_format(name)
    values = np.asarray(weights, dtype=np.float32).reshape(-1)
    if values.size % fmt.weights:
        raise ShapeError(f"quantize {fmt.name}: {values.size} weights are not whole blocks of {fmt.weights}")
    if not np.isfinite(values).all():
        raise DTypeError(f"quantize {fmt.name}: the weights must be finite")
    blocks = values.reshape(-1, fmt.weights)
    if fmt.name in K_QUANTIZERS:
        return K_QUANTIZERS[fmt.name](blocks)
    from gguf import GGMLQuantizationType, quants

    data = quants.quantize(blocks, GGMLQuantizationType[fmt.name.upper()])
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, fmt.gguf_bytes)


def f16_at_least(values: np.ndarray) -> np.ndarray:
    """The smallest float16 of each value that is at least it (values >= 0): a scale rounded up, so the
    range it spans still covers its block."""
    half = values.astype(np.float16)
    low = half.astype(np.float32) < values
    half[low] = np.nextafter(half[low], np.float16(np.inf))
    if not np.isfinite(half).all():
        raise DTypeError("quantize: a block's scale is past float16's range (weights of magnitude over ~1e6)")
    return half


def steps(need: np.ndarray, scale: np.ndarray, top: int) -> np.ndarray:
    """``ceil(need / scale)`` in [0, top] (0 where the scale is 0): the integer sub-scales that cover ``need``."""
    safe = np.where(scale > 0, scale, 1)
    return np.clip(np.ceil(need / safe), 0, top).astype(np.uint8) * (scale > 0)


def rounded(x: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    """``round(x / step)`` clipped to [low, high] (``low`` where the step is 0)."""
    safe = np.where(step > 0, step, 1)
    return np.where(step > 0, np.clip(np.rint(x / safe), low, high), low)


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """(n, 8) 6-bit scales and mins -> the 12 bytes of a Q4_K / Q5_K super-block (``quant.k_scales``'
    inverse): sub-blocks 0-3 in the low 6 bits of bytes 0-3 and 4-7; 4-7 in the nibbles of bytes 8-11, their
    top two bits in the top bits of bytes 0-3 and 4-7."""
    low = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
    mid = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
    high = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def k_levels(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K (``levels`` 15) or Q5_K (31): (d, dmin as float16 bytes (n, 2) each, scales, mins (n, 8) uint8,
    quants (n, 8, 32)) with w = d sc q - dmin m. Each sub-block's offset ``dmin m`` is at least minus its
    minimum (and 0 when all its weights are positive), its step ``d sc`` spans from there to its maximum."""
    x = blocks.reshape(-1, SUB_BLOCKS, 32)
    offset = np.maximum(-x.min(axis=2), 0)  # the sub-block's min, negated (llama.cpp stores mins >= 0)
    dmin = f16_at_least(offset.max(axis=1) / SCALE_MAX)
    mins = steps(offset, dmin.astype(np.float32)[:, None], SCALE_MAX)
    shift = dmin.astype(np.float32)[:, None] * mins  # what the block's dequantization subtracts
    need = (x.max(axis=2) + shift) / levels
    d = f16_at_least(np.maximum(need.max(axis=1), 0) / SCALE_MAX)
    scales = steps(need, d.astype(np.float32)[:, None], SCALE_MAX)
    step = d.astype(np.float32)[:, None] * scales
    q = rounded(x + shift[:, :, None], step[:, :, None], 0, levels).astype(np.uint8)
    return d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, mins, q


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, mins, q = k_levels(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2i, 2i + 1: low, high nibbles
    return np.concatenate([d, dmin, pack_k_scales(scales, mins), qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, mins, q = k_levels(blocks, 31)
    bits = (q >> 4).astype(np.uint8) << np.arange(SUB_BLOCKS, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(bits, axis=1)  # bit s of byte j: sub-block s, weight j
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    return np.concatenate([d, dmin, pack_k_scales(scales, mins), qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """w = d sc (q - 32), q in [0, 63]: each 16-weight sub-block's step spans its largest magnitude in 31."""
    x = blocks.reshape(-1, Q6_SUB_BLOCKS, 16)
    need = np.abs(x).max(axis=2) / 31
    d = f16_at_least(need.max(axis=1) / Q6_SCALE_MAX)
    scales = steps(need, d.astype(np.float32)[:, None], Q6_SCALE_MAX)
    step = (d.astype(np.float32)[:, None] * scales)[:, :, None]
    q = (rounded(x, step, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (half, i, j): 128h + 32i + j
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # byte 64h + 32(i % 2) + j: i < 2 low, else high
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
        axis=1,
    )


K_QUANTIZERS = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}
"""The block formats quantized here rather than by the ``gguf`` package."""
