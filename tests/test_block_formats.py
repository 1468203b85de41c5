"""The block-format table (batchgpu/quant.py): every GGUF format's device layout dequantizes, in numpy, to
the ``gguf`` package's own dequantization bit for bit on random valid blocks; the reference executor
computes matmuls and embedding gathers with every format; executors without kernels for a format refuse
it by name, and unknown formats are refused with the supported list."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import quant
from batchgpu.errors import DTypeError, ShapeError, UnsupportedError

gguf_quants = pytest.importorskip("gguf.quants", reason="the gguf package is the reference dequantization")

SCALE_OFFSETS = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}
"""Byte offsets of each format's float16 scales in a GGUF block (random bytes there could be NaN)."""


def random_blocks(rng: np.random.Generator, name: str, rows: int, k: int) -> np.ndarray:
    """GGUF bytes of a (rows, k) matrix: random quants, scales and mins, finite float16 super-scales."""
    fmt = quant.FORMATS[name]
    count = rows * k // fmt.weights
    if name in ("f16", "bf16"):
        values = (rng.standard_normal(count * 32) * 3).astype(np.float32)
        halves = values.astype(np.float16) if name == "f16" else (values.view(np.uint32) >> 16).astype(np.uint16)
        return halves.view(np.uint8)
    blocks = rng.integers(0, 256, (count, fmt.gguf_bytes), dtype=np.uint8)
    for at in SCALE_OFFSETS[name]:
        blocks[:, at : at + 2] = rng.uniform(-2, 2, (count, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


def gguf_dequantized(raw: np.ndarray, name: str, shape: tuple[int, int]) -> np.ndarray:
    kind = getattr(gguf_quants.GGMLQuantizationType, name.upper())
    return np.asarray(gguf_quants.dequantize(raw, kind), np.float32).reshape(shape)


def shapes(name: str) -> list[tuple[int, int]]:
    """Rows 1, a prime and more; K one super-block (256) or, where blocks are 32 weights, not a multiple
    of 256."""
    k_values = [256, 768] if quant.FORMATS[name].weights == 256 else [32, 224, 800]
    return [(rows, k) for rows in (1, 7) for k in k_values]


def test_the_table_covers_the_issue_formats():
    assert set(quant.FORMATS) == {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16"}
    for fmt in quant.FORMATS.values():
        assert fmt.device_bytes % 4 == 0 and fmt.device_bytes >= fmt.gguf_bytes
        expected = gguf_quants.GGML_QUANT_SIZES[getattr(gguf_quants.GGMLQuantizationType, fmt.name.upper())]
        assert (fmt.gguf_bytes, fmt.weights) == (expected[1], expected[0]) or fmt.name in ("f16", "bf16")


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_device_layout_dequantizes_as_gguf_bit_for_bit(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    for shape in shapes(name):
        raw = random_blocks(rng, name, *shape)
        words = quant.to_device_words(raw, name, shape)
        assert words.dtype == np.uint32 and words.nbytes == shape[0] * shape[1] // quant.FORMATS[name].weights * (
            quant.FORMATS[name].device_bytes
        )
        got = quant.dequantize_words(words, name, shape)
        np.testing.assert_array_equal(got.view(np.uint32), gguf_dequantized(raw, name, shape).view(np.uint32))


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_reference_matmul_and_embedding_with_every_format(ref, name):
    rng = np.random.default_rng(3)
    rows, k = 7, 256 if quant.FORMATS[name].weights == 256 else 224
    raw = random_blocks(rng, name, rows, k)
    weights = gguf_dequantized(raw, name, (rows, k)).astype(np.float64)
    w = ref.quantized(raw, name, (rows, k))
    np.testing.assert_array_equal(ref.read(w), weights.astype(np.float32))
    x = rng.standard_normal((3, k), dtype=np.float32)
    ids = np.array([6, 0, 3, 3], np.int32)
    batch = bg.GpuCommandBatch(ref)
    y = batch.matmul(batch.upload(x), w, transpose_b=True)
    rows_out = batch.embedding(batch.upload(ids), w)
    batch.execute()
    np.testing.assert_allclose(batch.read_sync(y), x.astype(np.float64) @ weights.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(batch.read_sync(rows_out), weights[ids].astype(np.float32))


@pytest.mark.parametrize("name", sorted(set(quant.FORMATS) - quant.KERNEL_FORMATS))
def test_formats_without_kernels_are_refused_by_name(gpu, name):
    rng = np.random.default_rng(4)
    k = 256
    with pytest.raises(UnsupportedError, match=rf"block format {name} has no kernels on the wgpu executor.*q4_1"):
        gpu.quantized(random_blocks(rng, name, 2, k), name, (2, k))
    batch = bg.GpuCommandBatch(gpu)  # the device goes on
    y = batch.add(batch.upload(np.ones(3, np.float32)), 1.0)
    batch.execute()
    np.testing.assert_array_equal(batch.read_sync(y), np.full(3, 2, np.float32))


def test_unknown_formats_and_bad_shapes_are_refused(ref):
    with pytest.raises(DTypeError, match=r"block format 'q3_k' is not supported; supported: q4_0, q4_1"):
        ref.quantized(np.zeros(110, np.uint8), "q3_k", (1, 256))
    with pytest.raises(ShapeError, match=r"q4_k: K = 224 is not a multiple of the 256-weight block"):
        ref.quantized(np.zeros(144, np.uint8), "q4_k", (1, 224))
    with pytest.raises(ShapeError, match=r"q6_k: 209 bytes do not hold a \(1, 256\) matrix \(210 bytes expected\)"):
        ref.quantized(np.zeros(209, np.uint8), "q6_k", (1, 256))
