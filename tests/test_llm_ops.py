"""Transformer ops on wgpu against the numpy reference: norms, rope, kv cache writes, grouped-query
attention with per-execute position scalars, embedding, argmax, fused silu*up and matmul + bias."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array
from .test_ops import check


@pytest.mark.parametrize("shape", [(1, 1), (3, 576), (2, 5, 7), (4, 1000)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_norms(gpu, ref, shape, dtype):
    rng = np.random.default_rng(40)
    x, r = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    w, b = random_array(rng, shape[-1:], dtype), random_array(rng, shape[-1:], dtype)
    check(gpu, ref, [x, w], lambda bt, tx, tw: bt.rms_norm(tx, tw, 1e-5), dtype, scale=2)
    check(gpu, ref, [x, w, b], lambda bt, tx, tw, tb: bt.layer_norm(tx, tw, tb, 1e-5), dtype, scale=4)
    check(gpu, ref, [x, r, w], lambda bt, tx, tr, tw: bt.add_rms_norm(tx, tr, tw, 1e-5)[0], dtype, scale=2)
    check(gpu, ref, [x, r, w], lambda bt, tx, tr, tw: bt.add_rms_norm(tx, tr, tw, 1e-5)[1], dtype)


def test_rms_norm_matches_transformers_formula(ref):
    x = random_array(np.random.default_rng(41), (3, 64), np.float32)
    w = random_array(np.random.default_rng(42), (64,), np.float32)
    batch = bg.GpuCommandBatch(ref)
    y = batch.rms_norm(batch.upload(x), batch.upload(w), 1e-5)
    batch.execute()
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(batch.read_sync(y), expected, rtol=1e-5)


@pytest.mark.parametrize("shape,pos", [((1, 9, 64), 0), ((5, 3, 64), 3), ((7, 2, 6), 11), ((2, 1, 2), 1000)])
def test_rope_fixed_positions(gpu, ref, shape, pos):
    x = random_array(np.random.default_rng(43), shape, np.float32)
    check(gpu, ref, [x], lambda b, t: b.rope(t, pos, 100000.0), np.float32, scale=20)


def test_rope_is_rotate_half_llama(ref):
    """Rotate-half as in transformers' apply_rotary_pos_emb, written out independently."""
    x = random_array(np.random.default_rng(44), (3, 2, 8), np.float32)
    batch = bg.GpuCommandBatch(ref)
    y = batch.rope(batch.upload(x), 5, 10000.0)
    batch.execute()
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    angles = np.outer(np.arange(5, 8), inv)
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    np.testing.assert_allclose(batch.read_sync(y), x * np.cos(emb) + rotated * np.sin(emb), rtol=1e-5, atol=1e-6)


def test_kv_cache_decode_with_position_scalar(gpu, ref):
    """Prefill of 5 tokens, then single-token steps through the same recorded batch shape."""
    rng = np.random.default_rng(45)
    heads, kv_heads, head_dim, cache_len = 9, 3, 64, 37
    lengths = [5, 1, 1, 1, 3]
    q_steps = [random_array(rng, (n, heads, head_dim), np.float32) for n in lengths]
    k_steps = [random_array(rng, (n, kv_heads, head_dim), np.float32) for n in lengths]
    v_steps = [random_array(rng, (n, kv_heads, head_dim), np.float32) for n in lengths]
    # One recorded batch per token count, executed at increasing positions, sharing the caches.
    outputs = {}
    for device in (gpu, ref):
        k_cache = device.tensor(np.zeros((cache_len, kv_heads, head_dim), np.float32))
        v_cache = device.tensor(np.zeros((cache_len, kv_heads, head_dim), np.float32))
        batches = {}
        position, results = 0, []
        compiled = None
        for qs, ks, vs in zip(q_steps, k_steps, v_steps):
            n = qs.shape[0]
            if n not in batches:
                batch = bg.GpuCommandBatch(device)
                pos = batch.scalar("pos")
                tq, tk, tv = batch.upload(qs), batch.upload(ks), batch.upload(vs)
                batch.kv_write(k_cache, batch.rope(tk, pos, 10000.0), pos)
                batch.kv_write(v_cache, tv, pos)
                batches[n] = (batch, tq, tk, tv, batch.attention(batch.rope(tq, pos, 10000.0), k_cache, v_cache, pos))
            batch, tq, tk, tv, out = batches[n]
            if n == 1 and compiled is None and len(results) > 1:
                compiled = device.stats.pipelines_compiled
            batch.execute({tq: qs, tk: ks, tv: vs}, scalars={"pos": position})
            results.append(batch.read_sync(out))
            position += n
        if compiled is not None:
            assert device.stats.pipelines_compiled == compiled  # later decode steps compile nothing
        outputs[device.kind] = results
    for actual, expected in zip(outputs["wgpu"], outputs["reference"]):
        assert_close(actual, expected, np.float32, scale=20)


def test_attention_matches_explicit_softmax(ref):
    """The reference attention against a direct per-head loop (GQA, causal mask at an offset)."""
    rng = np.random.default_rng(46)
    q = random_array(rng, (3, 4, 8), np.float32)
    k = random_array(rng, (10, 2, 8), np.float32)
    v = random_array(rng, (10, 2, 8), np.float32)
    batch = bg.GpuCommandBatch(ref)
    out = batch.attention(batch.upload(q), batch.upload(k), batch.upload(v), 4)
    batch.execute()
    expected = np.zeros_like(q, dtype=np.float64)
    for t in range(3):
        for h in range(4):
            keys = k[: 4 + t + 1, h // 2].astype(np.float64)
            s = keys @ q[t, h] / np.sqrt(8)
            p = np.exp(s - s.max())
            expected[t, h] = (p / p.sum()) @ v[: 4 + t + 1, h // 2]
    np.testing.assert_allclose(batch.read_sync(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_attention_fixed_position(gpu, ref, causal):
    rng = np.random.default_rng(47)
    q = random_array(rng, (4, 6, 16), np.float32)
    k = random_array(rng, (13, 2, 16), np.float32)
    v = random_array(rng, (13, 2, 16), np.float32)
    check(gpu, ref, [q, k, v], lambda b, tq, tk, tv: b.attention(tq, tk, tv, 7, causal=causal), np.float32, scale=10)


def test_position_scalar_bounds_and_errors(gpu):
    batch = bg.GpuCommandBatch(gpu)
    pos = batch.scalar("pos")
    cache = gpu.tensor(np.zeros((8, 1, 4), np.float32))
    new = batch.upload(np.ones((2, 1, 4), np.float32))
    batch.kv_write(cache, new, pos)
    batch.execute(scalars={"pos": 6})
    with pytest.raises(bg.LimitError, match="exceeds 6"):
        batch.execute(scalars={"pos": 7})
    with pytest.raises(bg.BatchError, match="unknown scalar 'position'"):
        batch.execute(scalars={"position": 1})
    with pytest.raises(bg.DTypeError, match="needs an int"):
        batch.execute(scalars={"pos": 1.5})
    with pytest.raises(bg.BatchError, match="already declares"):
        batch.scalar("pos")
    batch.execute(scalars={"pos": 2})  # still usable after the refused executes
    expected = np.zeros((8, 1, 4), np.float32)
    expected[2:4] = 1
    expected[6:8] = 1
    np.testing.assert_array_equal(gpu.read(cache), expected)


def test_embedding(gpu, ref):
    rng = np.random.default_rng(48)
    table = random_array(rng, (101, 33), np.float32)
    ids = rng.integers(0, 101, (2, 7)).astype(np.int32)
    ids[0, 0], ids[1, 3] = -1, 101  # out of range: zero rows
    out = check(gpu, ref, [ids, table], lambda b, i, t: b.embedding(i, t), np.float32)
    assert not out[0, 0].any() and not out[1, 3].any()
    np.testing.assert_array_equal(out[1, 1], table[ids[1, 1]])


@pytest.mark.parametrize("shape,axis", [((4, 49152), -1), ((1,), 0), ((3, 5, 7), 1), ((7, 300), 0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_argmax(gpu, ref, shape, axis, dtype):
    x = random_array(np.random.default_rng(49), shape, dtype)
    out = check(gpu, ref, [x], lambda b, t: b.argmax(t, axis=axis), np.int32)
    np.testing.assert_array_equal(out, np.argmax(x, axis=axis))


def test_argmax_ties_pick_the_first(gpu):
    x = np.zeros((2, 1000), np.float32)
    x[0, [17, 400, 999]] = 5.0
    x[1, :] = 1.0
    batch = bg.GpuCommandBatch(gpu)
    out = batch.argmax(batch.upload(x))
    batch.execute()
    np.testing.assert_array_equal(batch.read_sync(out), [17, 0])


def test_matmul_bias_and_silu_mul(gpu, ref):
    rng = np.random.default_rng(50)
    x = random_array(rng, (5, 70), np.float32)
    w = random_array(rng, (70, 130), np.float32)
    bias = random_array(rng, (130,), np.float32)
    out = check(gpu, ref, [x, w, bias], lambda b, tx, tw, tb: b.matmul(tx, tw, bias=tb), np.float32, scale=40)
    np.testing.assert_allclose(out, x @ w + bias, rtol=1e-4, atol=1e-4)
    g, u = random_array(rng, (3, 17), np.float32), random_array(rng, (3, 17), np.float32)
    out = check(gpu, ref, [g, u], lambda b, tg, tu: b.silu_mul(tg, tu), np.float32)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)


def quantized_pair(device_list, qtype: str, rows: int, k: int, seed: int):
    """Random weights quantized with the gguf package, uploaded to each device, plus gguf's own
    dequantization (the ground truth)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    kind = getattr(gguf_quants.GGMLQuantizationType, qtype.upper())
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    raw = gguf_quants.quantize(w, kind)
    truth = gguf_quants.dequantize(raw, kind).astype(np.float32)
    return [d.quantized(raw, qtype, (rows, k)) for d in device_list], truth


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,rows,k", [(1, 1, 32), (1, 1536, 576), (5, 67, 96), (9, 33, 64)])
def test_quantized_matmul_against_gguf_dequantize(gpu, ref, qtype, m, rows, k):
    (wg, wr), truth = quantized_pair([gpu, ref], qtype, rows, k, seed=m * 1000 + rows)
    x = random_array(np.random.default_rng(51), (m, k), np.float32)
    bias = random_array(np.random.default_rng(52), (rows,), np.float32)
    expected = x.astype(np.float64) @ truth.T.astype(np.float64) + bias
    results = []
    for device, w in ((gpu, wg), (ref, wr)):
        batch = bg.GpuCommandBatch(device)
        y = batch.matmul(batch.upload(x), w, transpose_b=True, bias=batch.upload(bias))
        batch.execute()
        results.append(batch.read_sync(y))
    scale = np.abs(expected).max()
    np.testing.assert_allclose(results[1], expected, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(results[0], expected, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_quantized_embedding(gpu, ref, qtype):
    (wg, wr), truth = quantized_pair([gpu, ref], qtype, 50, 64, seed=53)
    ids = np.array([3, 0, 49, 17, 3], np.int32)
    for device, table in ((gpu, wg), (ref, wr)):
        batch = bg.GpuCommandBatch(device)
        out = batch.embedding(batch.upload(ids), table)
        batch.execute()
        np.testing.assert_allclose(batch.read_sync(out), truth[ids], rtol=1e-6, atol=1e-7)


def test_quantized_errors(gpu):
    (w,), _ = quantized_pair([gpu], "q8_0", 8, 64, seed=54)
    batch = bg.GpuCommandBatch(gpu)
    x = batch.upload(np.ones((2, 64), np.float32))
    with pytest.raises(bg.ShapeError, match="transpose_b=True"):
        batch.matmul(x, w)
    with pytest.raises(bg.ShapeError, match="must end in K=64"):
        batch.matmul(batch.upload(np.ones((2, 32), np.float32)), w, transpose_b=True)
    with pytest.raises(bg.ShapeError, match="not a multiple"):
        gpu.quantized(np.zeros(34, np.uint8), "q8_0", (1, 30))
    with pytest.raises(bg.DTypeError, match="unknown block format"):
        gpu.quantized(np.zeros(34, np.uint8), "q5_k", (1, 32))
