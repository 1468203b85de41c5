"""The block-format table (batchgpu/quant.py): every GGUF format's device layout dequantizes, in numpy, to
the ``gguf`` package's own dequantization bit for bit on random valid blocks; the reference executor and
every kernel (GEMV CPU and GPU forms, embedding gathers, WGSL and CUDA) compute with every format; unknown
formats are refused with the supported list."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import quant
from batchgpu.errors import DTypeError, ShapeError

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
    np.testing.assert_allclose(batch.read(y), x.astype(np.float64) @ weights.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(batch.read(rows_out), weights[ids].astype(np.float32))


def run_quantized(device, raw, name, shape, x, ids, bias):
    """``x @ W.T + bias`` and ``embedding(ids, W)`` with W (shape) in format ``name`` on ``device``."""
    w = device.quantized(raw, name, shape)
    batch = bg.GpuCommandBatch(device)
    y = batch.matmul(batch.upload(x), w, transpose_b=True, bias=batch.upload(bias))
    rows = batch.embedding(batch.upload(ids), w)
    batch.execute()
    return batch.read(y), batch.read(rows)


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_quantized_matmul_and_embedding_kernels_every_format(gpu, name):
    """Each format's kernels (the GEMV's CPU form here; its GPU form in test_wgpu_gpu_kernels.py, the CUDA
    sources in test_cuda_kernels_cpu.py) against float64 of gguf's dequantization: rows 1, 7 and 13 (not a
    multiple of the 8 per invocation), one and three rows of x, K of one and of several blocks."""
    rng = np.random.default_rng(5)
    for rows, k in [(1, 256), (7, 512), (13, 768 if quant.FORMATS[name].weights == 256 else 224)]:
        raw = random_blocks(rng, name, rows, k)
        weights = gguf_dequantized(raw, name, (rows, k)).astype(np.float64)
        for m in (1, 3):
            x = rng.standard_normal((m, k), dtype=np.float32)
            bias = rng.standard_normal(rows, dtype=np.float32)
            ids = rng.integers(0, rows, 5).astype(np.int32)
            y, embedded = run_quantized(gpu, raw, name, (rows, k), x, ids, bias)
            expected = x.astype(np.float64) @ weights.T + bias
            scale = np.abs(x).astype(np.float64) @ np.abs(weights).T + 1
            assert np.all(np.abs(y - expected) <= 2e-6 * scale), (name, rows, k, m, np.abs(y - expected).max())
            np.testing.assert_array_equal(embedded, weights[ids].astype(np.float32))


@pytest.mark.parametrize("name", ["q4_0", "q5_1", "q4_k", "q6_k", "bf16"])
def test_quantized_matmul_split_k_every_kind_of_format(gpu, small_bounds, name):
    """Split-K over the blocks (2 per split under small_bounds): splits that start inside a K-quant
    super-block read the right sub-blocks."""
    rng = np.random.default_rng(6)
    rows, k = 9, 768
    raw = random_blocks(rng, name, rows, k)
    weights = gguf_dequantized(raw, name, (rows, k)).astype(np.float64)
    x = rng.standard_normal((2, k), dtype=np.float32)
    y, _ = run_quantized(gpu, raw, name, (rows, k), x, np.zeros(1, np.int32), np.zeros(rows, np.float32))
    expected = x.astype(np.float64) @ weights.T
    assert np.all(np.abs(y - expected) <= 2e-6 * (np.abs(x).astype(np.float64) @ np.abs(weights).T + 1))


def test_unknown_formats_and_bad_shapes_are_refused(ref):
    with pytest.raises(DTypeError, match=r"block format 'q3_k' is not supported; supported: q4_0, q4_1"):
        ref.quantized(np.zeros(110, np.uint8), "q3_k", (1, 256))
    with pytest.raises(ShapeError, match=r"q4_k: K = 224 is not a multiple of the 256-weight block"):
        ref.quantized(np.zeros(144, np.uint8), "q4_k", (1, 224))
    with pytest.raises(ShapeError, match=r"q6_k: 209 bytes do not hold a \(1, 256\) matrix \(210 bytes expected\)"):
        ref.quantized(np.zeros(209, np.uint8), "q6_k", (1, 256))


def test_gguf_tensors_of_every_format_load(tmp_path, gpu):
    """A GGUF written here with tensors in block formats, float16 and bfloat16 (matrices and vectors):
    the loader keeps the blocks for the device and reads vectors as float32, both equal to gguf's
    dequantization."""
    gguf = pytest.importorskip("gguf")
    from batchgpu.models.llama import GGUFWeights

    rng = np.random.default_rng(11)
    path = tmp_path / "formats.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rows, k, layers = 3, 256, len(quant.FORMATS)  # a whole model: one format per layer's up projection (3, 256)
    for key, value in (("block_count", layers), ("embedding_length", k), ("attention.head_count", 2),
                       ("attention.head_count_kv", 2), ("attention.key_length", 2), ("feed_forward_length", rows),
                       ("vocab_size", 10), ("rope.freq_base", 10000.0),
                       ("attention.layer_norm_rms_epsilon", 1e-5)):  # fmt: skip
        (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"llama.{key}", value)
    expected = {}
    float_shapes = {"attn_norm": (k,), "ffn_norm": (k,), "attn_q": (4, k), "attn_k": (4, k), "attn_v": (4, k),
                    "attn_output": (k, 4), "ffn_gate": (rows, k), "ffn_down": (k, rows)}  # fmt: skip
    for layer, name in enumerate(quant.FORMATS):
        raw = random_blocks(rng, name, rows, k).reshape(rows, -1)
        kind = getattr(gguf.GGMLQuantizationType, name.upper())
        writer.add_tensor(f"blk.{layer}.ffn_up.weight", raw, raw_dtype=kind)
        expected[f"blk.{layer}.ffn_up.weight"] = (name, gguf_dequantized(raw.reshape(-1), name, (rows, k)))
        for tensor, shape in float_shapes.items():
            writer.add_tensor(f"blk.{layer}.{tensor}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.add_tensor("token_embd.weight", rng.standard_normal((10, k)).astype(np.float32))
    vector = rng.standard_normal(k).astype(np.float32)
    writer.add_tensor("output_norm.weight", vector.astype(np.float16))
    expected["output_norm.weight"] = (None, vector.astype(np.float16).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    weights = GGUFWeights(path)
    for name, (qtype, values) in expected.items():
        assert weights.layout(name) == (qtype, values.shape), name
        np.testing.assert_array_equal(weights.float32(name), values)
        data, got_qtype, shape = weights.raw(name)
        if got_qtype is not None:
            np.testing.assert_array_equal(gpu.read(gpu.quantized(data, got_qtype, shape)), values)
