"""Transformer ops on wgpu against the numpy reference: norms, rope, kv cache writes, grouped-query
attention with per-execute position scalars, embedding, argmax, fused silu*up and matmul + bias."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import batchgpu as bg

from .conftest import assert_close, random_array
from .test_ops import check, run_on


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
    np.testing.assert_allclose(batch.read(y), expected, rtol=1e-5)


@pytest.mark.parametrize("shape,pos", [((1, 9, 64), 0), ((5, 3, 64), 3), ((7, 2, 6), 11), ((2, 1, 2), 1000)])
def test_rope_fixed_positions(gpu, ref, shape, pos):
    x = random_array(np.random.default_rng(43), shape, np.float32)
    check(gpu, ref, [x], lambda b, t: b.rope(t, pos, 100000.0), np.float32, scale=20)


@pytest.mark.parametrize("pos", [1000, 8184, 100000])
def test_rope_far_positions_match_the_f32_angle(gpu, ref, pos):
    """Far positions (SmolLM2's 8k context and beyond): the kernels reduce transformers' f32 angle
    (position * inv_freq) by whole turns with 2 pi in two parts, so they agree with the reference to a few
    ulp where reducing a rounded turn count used to cost ~1e-4 at 4k."""
    x = random_array(np.random.default_rng(pos), (8, 3, 64), np.float32)
    results = [run_on(device, [x], lambda b, t: b.rope(t, pos, 10000.0)) for device in (gpu, ref)]
    np.testing.assert_allclose(results[0], results[1], rtol=0, atol=4e-6 * np.abs(x).max())


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
    np.testing.assert_allclose(batch.read(y), x * np.cos(emb) + rotated * np.sin(emb), rtol=1e-5, atol=1e-6)


def test_rope_factors_divide_each_pairs_frequency(gpu, ref):
    """``factors`` (Llama 3's scaling) divide pair i's frequency: written out independently, on both executors."""
    x = random_array(np.random.default_rng(45), (4, 3, 8), np.float32)
    factors = np.array([1.0, 2.0, 5.5, 8.0])
    positions = np.array([0, 7, 300, 41], np.int32)
    inv = 1.0 / 500000.0 ** (np.arange(0, 8, 2) / 8) / factors
    emb = np.concatenate([np.outer(positions, inv)] * 2, axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    expected = x * np.cos(emb) + rotated * np.sin(emb)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        y = batch.rope(batch.upload(x), batch.upload(positions), 500000.0, factors=factors)
        batch.execute()
        np.testing.assert_allclose(batch.read(y), expected, rtol=1e-4, atol=1e-5)


def test_rope_factor_refusals(ref):
    batch = bg.GpuCommandBatch(ref)
    x = batch.upload(np.ones((2, 2, 8), np.float32))
    with pytest.raises(bg.ShapeError, match=r"rope: factors has 3 entries, expected head_dim / 2 = 4"):
        batch.rope(x, 0, factors=[1.0, 2.0, 3.0])
    with pytest.raises(bg.ArgumentError, match=r"rope: factors must be a 1-D sequence of finite numbers > 0"):
        batch.rope(x, 0, factors=[1.0, 0.0, 2.0, 1.0])
    with pytest.raises(bg.ArgumentError, match=r"rope_kv_write: factors must be a number|rope_kv_write: factors"):
        cache = ref.tensor(np.zeros((8, 1, 8), np.float32))
        batch.rope_kv_write(batch.upload(np.ones((2, 4, 8), np.float32)), cache, cache, 0, factors=["a"] * 4)
    y = batch.rope(x, 1, factors=[1.0, 2.0, 3.0, 4.0])  # the batch still records and runs
    batch.execute()
    assert np.isfinite(batch.read(y)).all()


def split_qkv(batch: bg.GpuCommandBatch, x: bg.Tensor, heads: int, kv_heads: int) -> list[bg.Tensor]:
    """The q, k and v heads of a fused projection as three sliced tensors (the unfused ops' inputs)."""
    bounds = [0, heads, heads + kv_heads, heads + 2 * kv_heads]
    return [batch.slice(x, (slice(None), slice(lo, hi))) for lo, hi in itertools.pairwise(bounds)]


ROTATION_EPS = 4
"""wgpu's bound on fused vs unfused rope, in eps of the stored dtype times the largest |qkv|: a multiply and an
add fused into one rounding changes a rotated value by at most an ulp of the larger product (|x1 c|, |x2 s|
<= max |x|), one of cos/sin by an ulp of 1; a float16 store of two nearly equal values may round apart."""


def assert_fused_equals_unfused(device: bg.Device, fused: np.ndarray, unfused: np.ndarray, scale: float) -> None:
    """The contract between rope_kv_write (rope_kv_scatter) and rope + kv_write (scatter_rows) on one device:
    bit for bit on the reference and the native executors (the CUDA rotation spells out each rounding:
    mul.rn / fma.rn, which no compiler contracts; tests/test_cuda_compile.py checks the PTX); on wgpu
    within ROTATION_EPS eps of the dtype times ``scale`` (the largest |qkv|): WGSL lets an implementation
    fuse a product with a sum (its fma may be either), so two kernels may round one rotation differently."""
    if device.kind != "wgpu":
        np.testing.assert_array_equal(fused, unfused)
        return
    bound = ROTATION_EPS * float(np.finfo(fused.dtype).eps) * scale
    np.testing.assert_allclose(fused.astype(np.float64), unfused.astype(np.float64), rtol=0, atol=bound)


def fused_and_unfused(gpu, ref, caches, record, qkv, scalars=None) -> dict:
    """``record(batch, k_cache, v_cache, fused)`` -> q, run fused and unfused on both devices from the same
    starting ``caches``; {(device, fused): [q, k cache, v cache]}, after checking fused against unfused on
    each device by :func:`assert_fused_equals_unfused` (``qkv``: the input, for its scale)."""
    results = {}
    for device in (gpu, ref):
        for fused in (True, False):
            k_cache, v_cache = (device.tensor(c) for c in caches)
            batch = bg.GpuCommandBatch(device)
            q = record(batch, k_cache, v_cache, fused)
            batch.execute(scalars=scalars)
            results[device, fused] = [batch.read(q), device.read(k_cache), device.read(v_cache)]
    scale = float(np.abs(qkv.astype(np.float64)).max())
    for device in (gpu, ref):
        for fused, unfused in zip(results[device, True], results[device, False]):
            assert_fused_equals_unfused(device, fused, unfused, scale)
    return results


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim,cache_len,pos",
    [(1, 9, 3, 64, 37, 36), (5, 9, 3, 64, 37, 0), (3, 2, 1, 2, 11, 7), (7, 6, 2, 10, 8, 1), (2, 13, 13, 6, 5, 3)],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rope_kv_write_equals_rope_and_kv_write(gpu, ref, tokens, heads, kv_heads, head_dim, cache_len, pos, dtype):
    """The fused op against the three unfused ones on each executor (bit for bit except on wgpu, by
    assert_fused_equals_unfused's contract) and against the reference executor; cache rows outside
    pos .. pos + tokens untouched."""
    rng = np.random.default_rng(tokens * 100 + heads)
    qkv = random_array(rng, (tokens, heads + 2 * kv_heads, head_dim), dtype)
    start_k = random_array(rng, (cache_len, kv_heads, head_dim), dtype)
    start_v = random_array(rng, (cache_len, kv_heads, head_dim), dtype)

    def record(batch, k_cache, v_cache, fused):
        position, x = batch.scalar("pos"), batch.upload(qkv)
        if fused:
            return batch.rope_kv_write(x, k_cache, v_cache, position, 5000.0)
        q, k, v = split_qkv(batch, x, heads, kv_heads)
        batch.kv_write(k_cache, batch.rope(k, position, 5000.0), position)
        batch.kv_write(v_cache, v, position)
        return batch.rope(q, position, 5000.0)

    results = fused_and_unfused(gpu, ref, (start_k, start_v), record, qkv, scalars={"pos": pos})
    for got, expected in zip(results[gpu, True], results[ref, True]):
        assert_close(got, expected, dtype, scale=20)
    outside = np.r_[0:pos, pos + tokens : cache_len]
    np.testing.assert_array_equal(results[gpu, True][1][outside], start_k[outside])
    np.testing.assert_array_equal(results[gpu, True][2][outside], start_v[outside])


@pytest.mark.parametrize("tokens", [1, 4, 11])
@pytest.mark.parametrize("qkv_dtype,pool_dtype", [(np.float32, np.float32), (np.float32, np.float16)])
def test_rope_kv_scatter_equals_rope_and_scatter_rows(gpu, ref, tokens, qkv_dtype, pool_dtype):
    """Positions and pool rows from tensors (the engine's paged step): equal to rope at positions + cast +
    scatter_rows on each executor (bit for bit except on wgpu, by assert_fused_equals_unfused's contract),
    rows -1 and past the pool skipped, other rows untouched."""
    rng = np.random.default_rng(tokens + 70)
    heads, kv_heads, head_dim, pool = 9, 3, 64, 23
    qkv = random_array(rng, (tokens, heads + 2 * kv_heads, head_dim), qkv_dtype)
    positions = rng.integers(0, 8192, tokens).astype(np.int32)
    rows = rng.permutation(pool)[:tokens].astype(np.int32)
    rows[::3] = -1
    if tokens > 2:
        rows[1] = pool + 5
    start_k = random_array(rng, (pool, kv_heads, head_dim), pool_dtype)
    start_v = random_array(rng, (pool, kv_heads, head_dim), pool_dtype)

    def record(batch, k_pool, v_pool, fused):
        x, at, where = batch.upload(qkv), batch.upload(positions), batch.upload(rows)
        if fused:
            return batch.rope_kv_write(x, k_pool, v_pool, at, 10000.0, rows=where)
        q, k, v = split_qkv(batch, x, heads, kv_heads)
        k = batch.rope(k, at, 10000.0)
        if pool_dtype != qkv_dtype:
            k, v = batch.cast(k, pool_dtype), batch.cast(v, pool_dtype)
        batch.scatter_rows(k_pool, where, k)
        batch.scatter_rows(v_pool, where, v)
        return batch.rope(q, at, 10000.0)

    results = fused_and_unfused(gpu, ref, (start_k, start_v), record, qkv)
    for got, expected, dtype in zip(results[gpu, True], results[ref, True], (qkv_dtype, pool_dtype, pool_dtype)):
        assert_close(got, expected, dtype, scale=20)
    untouched = np.setdiff1d(np.arange(pool), rows)
    np.testing.assert_array_equal(results[gpu, True][1][untouched], start_k[untouched])


def test_rope_kv_write_refusals(ref):
    batch = bg.GpuCommandBatch(ref)
    cache = ref.tensor(np.zeros((8, 2, 4), np.float32))
    qkv = batch.upload(np.ones((2, 7, 4), np.float32))
    with pytest.raises(bg.ShapeError, match=r"rope_kv_write: qkv .* must hold q heads \(a multiple of the caches' 2"):
        batch.rope_kv_write(qkv, cache, cache, 0)  # 3 q heads over 2 kv heads
    with pytest.raises(bg.LimitError, match=r"rope_kv_write: pos 7 \+ 2 tokens exceeds cache"):
        batch.rope_kv_write(batch.upload(np.ones((2, 6, 4), np.float32)), cache, cache, 7)
    with pytest.raises(bg.DTypeError, match=r"rope_kv_write"):
        batch.rope_kv_write(batch.upload(np.ones((2, 6, 4), np.int32)), cache, cache, 0)
    with pytest.raises(bg.ArgumentError, match=r"rope_kv_write: with a positions Tensor, rows"):
        batch.rope_kv_write(batch.upload(np.ones((2, 6, 4), np.float32)), cache, cache, batch.upload([1, 2]))
    with pytest.raises(bg.ShapeError, match=r"rope_kv_write: rows .* must have shape \(2,\)"):
        x = batch.upload(np.ones((2, 6, 4), np.float32))
        batch.rope_kv_write(x, cache, cache, batch.upload([1, 2]), rows=batch.upload([1, 2, 3]))
    with pytest.raises(bg.ShapeError, match=r"v_cache .* must match k_cache"):
        longer = ref.tensor(np.zeros((9, 2, 4), np.float32))
        batch.rope_kv_write(batch.upload(np.ones((2, 6, 4), np.float32)), cache, longer, 0)


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
            results.append(batch.read(out))
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
    np.testing.assert_allclose(batch.read(out), expected, rtol=1e-5, atol=1e-6)


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
    np.testing.assert_array_equal(batch.read(out), [17, 0])


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


@pytest.mark.parametrize("shape", [(2,), (1, 2), (3, 34), (2, 5, 14), (1, 3072), (70001, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_swiglu_equals_silu_mul_of_the_halves(gpu, ref, shape, dtype):
    """The fused gate/up activation against silu_mul of the two halves, bit for bit on one device (swiglu is
    silu_mul's kernel entry and expression, only the operands' addressing differs: the same float operations
    in the same order, which a compiler contracts or not alike), and against the reference executor; the
    last case has more than 65,535 rows (the grid runs over elements: test_ops' slow test goes past one
    dispatch dimension's groups)."""
    x = random_array(np.random.default_rng(sum(shape)), shape, dtype)
    half = shape[-1] // 2
    fused = check(gpu, ref, [x], lambda b, t: b.swiglu(t), dtype)
    halves = run_on(gpu, [x[..., :half].copy(), x[..., half:].copy()], lambda b, g, u: b.silu_mul(g, u))
    np.testing.assert_array_equal(fused, halves)
    x64 = x.astype(np.float64)
    gate, up = x64[..., :half], x64[..., half:]
    assert_close(fused, (gate / (1 + np.exp(-gate)) * up).astype(dtype), dtype)


def test_swiglu_refuses_an_odd_last_axis(ref):
    batch = bg.GpuCommandBatch(ref)
    with pytest.raises(bg.ShapeError, match=r"swiglu: the last axis of x .* must have an even length"):
        batch.swiglu(batch.upload(np.ones((2, 5), np.float32)))
    with pytest.raises(bg.DTypeError, match=r"swiglu"):
        batch.swiglu(batch.upload(np.ones((2, 4), np.int32)))


def quantized_pair(device_list, qtype: str, rows: int, k: int, seed: int):
    """Random weights quantized with the gguf package, uploaded to each device, plus gguf's own
    dequantization (the ground truth)."""
    gguf_quants = pytest.importorskip("gguf.quants")
    kind = getattr(gguf_quants.GGMLQuantizationType, qtype.upper())
    w = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    raw = gguf_quants.quantize(w, kind)
    truth = gguf_quants.dequantize(raw, kind).astype(np.float32)
    return [d.quantized(raw, qtype, (rows, k)) for d in device_list], truth


def swiglu_of_pairs(y: np.ndarray) -> np.ndarray:
    gate, up = y[..., 0::2], y[..., 1::2]
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,rows,k", [(1, 2, 32), (1, 3072, 576), (5, 70, 96), (3, 18, 64), (2, 34, 1536)])
def test_quantized_matmul_swiglu_epilogue(gpu, ref, qtype, m, rows, k):
    """silu(gate) * up of interleaved (gate, up) weight rows in the GEMV's store, against float64 of gguf's
    dequantization and the reference executor (pairs counts 1, odd, past one invocation's 8 rows)."""
    (wg, wr), truth = quantized_pair([gpu, ref], qtype, rows, k, seed=m * 100 + rows)
    x = random_array(np.random.default_rng(53), (m, k), np.float32)
    expected = swiglu_of_pairs(x.astype(np.float64) @ truth.T.astype(np.float64))
    results = []
    for device, w in ((gpu, wg), (ref, wr)):
        batch = bg.GpuCommandBatch(device)
        y = batch.matmul(batch.upload(x), w, transpose_b=True, epilogue="swiglu")
        assert y.shape == (m, rows // 2)
        batch.execute()
        results.append(batch.read(y))
    scale = np.abs(expected).max()
    for got in results:
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5 * scale)


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_quantized_matmul_swiglu_epilogue_split_k(gpu, ref, small_bounds, qtype):
    """Past the split-K chunk the epilogue is a second pass over the summed product."""
    (wg, wr), truth = quantized_pair([gpu, ref], qtype, 22, 96 * 32, seed=7)
    x = random_array(np.random.default_rng(54), (3, 96 * 32), np.float32)
    expected = swiglu_of_pairs(x.astype(np.float64) @ truth.T.astype(np.float64))
    for device, w in ((gpu, wg), (ref, wr)):
        batch = bg.GpuCommandBatch(device)
        y = batch.matmul(batch.upload(x), w, transpose_b=True, epilogue="swiglu")
        entries = [launch.entry for node in batch.view().nodes for launch in node.launches]
        assert entries[-1] == "binary" and len(entries) >= 3  # partials, their sum, the epilogue pass
        batch.execute()
        np.testing.assert_allclose(batch.read(y), expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float_matmul_swiglu_epilogue(gpu, ref, dtype):
    rng = np.random.default_rng(55)
    x, w = random_array(rng, (4, 40), dtype), random_array(rng, (26, 40), dtype)
    out = check(gpu, ref, [x, w], lambda b, tx, tw: b.matmul(tx, tw, transpose_b=True, epilogue="swiglu"), dtype, 40)
    product = x.astype(np.float64) @ w.T.astype(np.float64)
    assert_close(out, swiglu_of_pairs(product).astype(dtype), dtype, scale=40)


def test_matmul_epilogue_refusals(ref):
    batch = bg.GpuCommandBatch(ref)
    x, w = batch.upload(np.ones((2, 4), np.float32)), batch.upload(np.ones((5, 4), np.float32))
    with pytest.raises(bg.ShapeError, match=r"matmul: epilogue='swiglu' needs a float product with an even"):
        batch.matmul(x, w, transpose_b=True, epilogue="swiglu")
    with pytest.raises(bg.ArgumentError, match=r"matmul: epilogue must be one of \('swiglu',\)"):
        batch.matmul(x, w, transpose_b=True, epilogue="gelu")
    with pytest.raises(bg.ArgumentError, match=r"matmul: epilogue='swiglu' takes no bias"):
        batch.matmul(x, w, transpose_b=True, bias=batch.upload(np.ones(5, np.float32)), epilogue="swiglu")


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
        results.append(batch.read(y))
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
        np.testing.assert_allclose(batch.read(out), truth[ids], rtol=1e-6, atol=1e-7)


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
    with pytest.raises(bg.DTypeError, match="block format 'q3_k' is not supported"):
        gpu.quantized(np.zeros(34, np.uint8), "q3_k", (1, 32))
    with pytest.raises(bg.ShapeError, match="q5_k: K = 32 is not a multiple of the 256-weight block"):
        gpu.quantized(np.zeros(176, np.uint8), "q5_k", (1, 32))


# Long rows: pieces of bounds.ROW_CHUNK elements (300 under small_bounds) whose partial results a second
# pass combines; and rows past llvmpipe's per-invocation loop cap.

LONG_ROW_WIDTHS = [1, 299, 300, 301, 601, 1000]  # 1000: a ragged last piece


@pytest.mark.parametrize("width", LONG_ROW_WIDTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_norms_long_rows(gpu, ref, small_bounds, width, dtype):
    """Per-piece statistics (sums of squares; sums and deviations, combined with Chan's formula) give the
    one-pass results; a ramp makes the pieces' means differ."""
    rng = np.random.default_rng(60)
    shape = (3, width)
    x = random_array(rng, shape, dtype) + np.linspace(-4, 4, width).astype(dtype)
    r = random_array(rng, shape, dtype)
    w, b = random_array(rng, (width,), dtype), random_array(rng, (width,), dtype)
    check(gpu, ref, [x, w], lambda bt, tx, tw: bt.rms_norm(tx, tw, 1e-5), dtype, scale=2)
    check(gpu, ref, [x, w, b], lambda bt, tx, tw, tb: bt.layer_norm(tx, tw, tb, 1e-5), dtype, scale=4)
    check(gpu, ref, [x, r, w], lambda bt, tx, tr, tw: bt.add_rms_norm(tx, tr, tw, 1e-5)[0], dtype, scale=2)
    check(gpu, ref, [x, r, w], lambda bt, tx, tr, tw: bt.add_rms_norm(tx, tr, tw, 1e-5)[1], dtype)


@pytest.mark.parametrize("width", LONG_ROW_WIDTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint32])
def test_argmax_long_rows(gpu, ref, small_bounds, width, dtype):
    """Each piece's first maximum, then one pass per row picks among them (ties to the lower index); a long
    non-last axis is moved last first."""
    x = random_array(np.random.default_rng(61), (3, width), dtype)
    out = check(gpu, ref, [x], lambda b, t: b.argmax(t), np.int32)
    np.testing.assert_array_equal(out, np.argmax(x, axis=-1))
    out = check(gpu, ref, [np.ascontiguousarray(x.T)], lambda b, t: b.argmax(t, axis=0), np.int32)
    np.testing.assert_array_equal(out, np.argmax(x, axis=-1))


@pytest.mark.parametrize("width", [200, 1000])  # one launch; pieces of 300
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint32])
def test_argmax_nan_first_wins(gpu, ref, small_bounds, width, dtype):
    """As numpy: a row with NaN gives its first NaN. Integers with NaN's bit pattern are plain numbers (the
    int32 ones here are -1, the uint32 ones grow along the row so the last is the maximum)."""
    x = random_array(np.random.default_rng(62), (5, width), dtype)
    marked = {0: [5], 1: [width * 2 // 3], 2: [width - 1, width // 2, width // 3], 3: [0, width - 1]}  # 4: none
    for row, columns in marked.items():
        for column in columns:
            x[row, column] = {"f": np.nan, "i": -1, "u": 0x7F800001 + column}[np.dtype(dtype).kind]
    out = check(gpu, ref, [x], lambda b, t: b.argmax(t), np.int32)
    np.testing.assert_array_equal(out, np.argmax(x, axis=-1))
    if np.dtype(dtype).kind == "f":
        np.testing.assert_array_equal(out[:4], [5, width * 2 // 3, width // 3, 0])


PAST_LOOP_CAP = 2**24 + 17
"""A row length whose one-workgroup-per-row loops (length / 256 iterations each) pass llvmpipe's cap of
65,535 iterations per invocation: the kernels must split it (float32: 67 MB, within a 128 MiB binding)."""


def _past_loop_cap_rows(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(PAST_LOOP_CAP, dtype=np.float32) for _ in range(count)]


def test_argmax_past_loop_cap(gpu):
    (x,) = _past_loop_cap_rows(63, 1)
    batch = bg.GpuCommandBatch(gpu)
    out = batch.argmax(batch.upload(x))
    batch.execute()
    assert batch.read(out) == np.argmax(x)


def test_rms_norm_past_loop_cap(gpu):
    x, w = _past_loop_cap_rows(64, 2)
    batch = bg.GpuCommandBatch(gpu)
    out = batch.rms_norm(batch.upload(x), batch.upload(w), 1e-5)
    batch.execute()
    wide = x.astype(np.float64)
    assert_close(batch.read(out), (wide / np.sqrt(np.mean(wide * wide) + 1e-5) * w).astype(np.float32))


def test_add_rms_norm_past_loop_cap(gpu):
    x, residual, w = _past_loop_cap_rows(65, 3)
    batch = bg.GpuCommandBatch(gpu)
    normed, summed = batch.add_rms_norm(batch.upload(x), batch.upload(residual), batch.upload(w), 1e-5)
    batch.execute()
    h = x.astype(np.float64) + residual
    assert_close(batch.read(summed), x + residual)
    assert_close(batch.read(normed), (h / np.sqrt(np.mean(h * h) + 1e-5) * w).astype(np.float32))


def test_layer_norm_past_loop_cap(gpu):
    x, w, b = _past_loop_cap_rows(66, 3)
    x += 3  # a mean far from zero: variance from sums of squares would lose precision
    batch = bg.GpuCommandBatch(gpu)
    out = batch.layer_norm(batch.upload(x), batch.upload(w), batch.upload(b), 1e-5)
    batch.execute()
    centered = x.astype(np.float64) - np.mean(x, dtype=np.float64)
    expected = centered / np.sqrt(np.mean(centered * centered) + 1e-5) * w + b
    assert_close(batch.read(out), expected.astype(np.float32))


# Attention over long caches: blocks of split_rows(head_dim) cache rows (64 or 128 under small_bounds)
# whose partials attention_merge / attention_combine fold, caches past llvmpipe's loop cap, scale and
# position checks.


def attention_float64(
    q, k, v, pos: int, causal: bool = True, scale: float | None = None, window: int = 0
) -> np.ndarray:
    """Grouped-query attention over cache rows [0, pos + T) in float64, written out per token; with a
    ``window``, token t over rows (pos + t - window, pos + t] only."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    tokens, heads, head_dim = q.shape
    group = heads // k.shape[1]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    out = np.empty_like(q)
    for t in range(tokens):
        rows = min(pos + t + 1 if causal else pos + tokens, k.shape[0])
        first = max(rows - window, 0) if window else 0
        keys, values = np.repeat(k[first:rows], group, axis=1), np.repeat(v[first:rows], group, axis=1)
        scores = np.einsum("hd,shd->hs", q[t], keys) * scale
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[t] = np.einsum("hs,shd->hd", weights / weights.sum(axis=-1, keepdims=True), values)
    return out


def _attention_inputs(seed: int, tokens: int, heads: int, kv_heads: int, rows: int, head_dim: int, dtype):
    rng = np.random.default_rng(seed)
    q = random_array(rng, (tokens, heads, head_dim), dtype)
    k, v = (random_array(rng, (rows, kv_heads, head_dim), dtype) for _ in range(2))
    return q, k, v


def _attention_entries(batch: bg.GpuCommandBatch) -> list[str]:
    return [launch.entry for launch in batch.nodes[-1].launches]


SPLIT = ["attention_partial", "attention_combine"]
SPLIT_MERGED = ["attention_partial", "attention_merge", "attention_combine"]


@pytest.mark.parametrize(
    "head_dim,tokens,heads,kv_heads,rows,pos,causal,dtype,entries",
    [
        (2, 1, 6, 2, 300, 299, True, np.float32, SPLIT),  # blocks of 128 rows, the last of 44
        (2, 3, 6, 2, 300, 200, False, np.float16, SPLIT),
        (8, 5, 6, 2, 300, 100, True, np.float16, SPLIT),  # rows 101 to 105 visible: later blocks empty
        (8, 2, 3, 3, 1000, 998, False, np.float32, SPLIT),
        (64, 4, 6, 2, 200, 150, True, np.float32, SPLIT),  # blocks of 64 rows
        (64, 1, 4, 1, 200, 199, False, np.float16, SPLIT),
        (512, 2, 2, 1, 1600, 1500, True, np.float32, SPLIT_MERGED),  # 25 blocks, folded 23 at a time
    ],
)
def test_attention_split_over_cache_blocks(
    gpu, ref, small_bounds, head_dim, tokens, heads, kv_heads, rows, pos, causal, dtype, entries
):
    """Per-block partials (max, sum of exp, weighted value sums) folded into the one-pass softmax result:
    grouped-query heads, causal or not, ragged last blocks, float16 storage computed in f32."""
    q, k, v = _attention_inputs(70 + head_dim, tokens, heads, kv_heads, rows, head_dim, dtype)
    recorded = []

    def build(batch, tq, tk, tv):
        out = batch.attention(tq, tk, tv, pos, causal=causal)
        recorded.append(_attention_entries(batch))
        return out

    out = check(gpu, ref, [q, k, v], build, dtype, scale=10)
    assert recorded == [entries, entries]
    np.testing.assert_allclose(out, attention_float64(q, k, v, pos, causal), rtol=5e-3, atol=5e-3)


@pytest.mark.parametrize(
    "head_dim,tokens,rows,positions",
    [
        (8, 2, 700, [0, 1, 126, 127, 128, 400, 698]),  # 6 blocks of 128: at 0, 5 of them empty
        (512, 1, 1600, [0, 63, 64, 1000, 1471, 1472, 1599]),  # 25 blocks in 2 folds: at 0, the second all empty
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_split_with_position_scalar(gpu, ref, small_bounds, head_dim, tokens, rows, positions, causal):
    """One recorded batch executed at several positions: blocks past the visible rows contribute nothing."""
    q, k, v = _attention_inputs(71, tokens, 6, 2, rows, head_dim, np.float32)
    results = []
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        pos = batch.scalar("pos")
        out = batch.attention(batch.upload(q), batch.upload(k), batch.upload(v), pos, causal=causal)
        assert _attention_entries(batch)[0] == "attention_partial"
        for position in positions:
            batch.execute(scalars={"pos": position})
            results.append(batch.read(out))
    for position, actual, expected in zip(positions, results[: len(positions)], results[len(positions) :]):
        assert_close(actual, expected, np.float32, scale=10)
        np.testing.assert_allclose(actual, attention_float64(q, k, v, position, causal), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [40, 300])  # one pass; blocks of 128 rows (small_bounds)
def test_attention_scale_zero_weighs_rows_uniformly(gpu, ref, small_bounds, rows):
    """scale=0.0 means 0.0 (it used to mean the default): each token gets the mean of its visible v rows."""
    q, k, v = _attention_inputs(72, 2, 4, 2, rows, 8, np.float32)
    pos = rows - 3
    out = check(gpu, ref, [q, k, v], lambda b, tq, tk, tv: b.attention(tq, tk, tv, pos, scale=0.0), np.float32, scale=4)
    for t in range(2):
        means = v[: pos + t + 1].astype(np.float64).mean(axis=0)  # (kv_heads, head_dim)
        assert_close(out[t], np.repeat(means, 2, axis=0).astype(np.float32), scale=10)


@pytest.mark.parametrize(
    "head_dim,tokens,heads,kv_heads,rows,pos,window,dtype",
    [
        (8, 5, 4, 2, 40, 30, 1, np.float32),  # one pass: each token sees its own row only
        (8, 6, 3, 1, 40, 20, 7, np.float16),  # a prime window, every token past it
        (8, 4, 2, 2, 40, 2, 5, np.float32),  # the first tokens inside the window, the later ones past it
        (2, 3, 6, 2, 300, 290, 131, np.float32),  # blocks of 128: the first block wholly before the window
        (8, 4, 6, 2, 300, 150, 13, np.float16),  # the window inside one block, later blocks past the tokens
        (8, 2, 4, 2, 300, 100, 500, np.float32),  # a window longer than the context: every row
        (64, 3, 4, 1, 200, 190, 67, np.float32),  # blocks of 64, a window across two of them
        (512, 2, 2, 1, 1600, 1500, 1031, np.float32),  # 25 blocks folded by attention_merge
    ],
)
def test_attention_sliding_window(gpu, ref, small_bounds, head_dim, tokens, heads, kv_heads, rows, pos, window, dtype):
    """A sliding window (Mistral, Gemma 3): token t attends over the ``window`` rows up to pos + t, in one pass
    and split over blocks of rows (blocks before the window contribute nothing), against float64."""
    q, k, v = _attention_inputs(75 + window, tokens, heads, kv_heads, rows, head_dim, dtype)

    def build(batch, tq, tk, tv):
        return batch.attention(tq, tk, tv, pos, window=window)

    out = check(gpu, ref, [q, k, v], build, dtype, scale=10)
    assert_close(out, attention_float64(q, k, v, pos, window=window).astype(dtype), dtype, scale=10)


@pytest.mark.parametrize("rows,head_dim", [(40, 8), (700, 8)])  # one pass; 6 blocks of 128 (small_bounds)
def test_attention_sliding_window_with_position_scalar(gpu, ref, small_bounds, rows, head_dim):
    """One recorded windowed attention executed at positions before, at and past the window: where the window
    starts is computed from the per-execute position."""
    q, k, v = _attention_inputs(76, 3, 4, 2, rows, head_dim, np.float32)
    window, positions = 17, [0, 13, 14, 15, rows - 3]
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        out = batch.attention(batch.upload(q), batch.upload(k), batch.upload(v), batch.scalar("pos"), window=window)
        for position in positions:
            batch.execute(scalars={"pos": position})
            expected = attention_float64(q, k, v, position, window=window).astype(np.float32)
            assert_close(batch.read(out), expected, np.float32, scale=10)


def test_attention_refuses_bad_windows(gpu):
    """A window that is not an int >= 0, or one without causality, is an ArgumentError at record time; the
    batch still runs a windowed attention afterwards."""
    q, k, v = _attention_inputs(77, 2, 2, 1, 9, 4, np.float32)
    batch = bg.GpuCommandBatch(gpu)
    tq, tk, tv = batch.upload(q), batch.upload(k), batch.upload(v)
    for window in (-1, 2.0, True, 2**31, "3"):
        with pytest.raises(bg.ArgumentError, match=r"attention: window must be an int in \[0, 2\*\*31\)"):
            batch.attention(tq, tk, tv, 3, window=window)
    with pytest.raises(bg.ArgumentError, match=r"attention: a window \(3\) needs causal=True"):
        batch.attention(tq, tk, tv, 3, window=3, causal=False)
    out = batch.attention(tq, tk, tv, 7, window=3)
    batch.execute()
    assert_close(batch.read(out), attention_float64(q, k, v, 7, window=3).astype(np.float32), scale=10)


def test_attention_refuses_bad_scale_and_position(gpu):
    """A non-finite scale, an int position whose tokens run past the cache (or past u32) and a head_dim too
    wide for the workgroup memory are refused at record time; the batch still runs a correct attention."""
    rng = np.random.default_rng(73)
    q, k, v = _attention_inputs(73, 2, 2, 1, 5, 4, np.float32)
    batch = bg.GpuCommandBatch(gpu)
    tq, tk, tv = batch.upload(q, name="q"), batch.upload(k, name="k_rows"), batch.upload(v, name="v_rows")
    for scale in (float("nan"), float("inf"), -float("inf"), 1e39):
        with pytest.raises(bg.BatchError) as refused:
            batch.attention(tq, tk, tv, 0, scale=scale)
        assert "attention" in str(refused.value) and repr(scale) in str(refused.value)
    with pytest.raises(bg.LimitError, match=r"attention: pos 4 \+ 2 tokens.*5 rows of k_cache k_rows"):
        batch.attention(tq, tk, tv, 4)
    with pytest.raises(bg.LimitError, match=r"attention.*6 tokens.*k_rows"):
        batch.attention(batch.upload(random_array(rng, (6, 2, 4), np.float32)), tk, tv, batch.scalar("pos"))
    with pytest.raises(bg.BatchError, match=r"rope: pos .* 4294967296"):  # past u32: was a bare struct.error
        batch.rope(tq, 2**32)
    wide = batch.upload(random_array(rng, (1, 1, 3970), np.float32))
    with pytest.raises(bg.LimitError, match=r"head_dim 3970 .* exceeds 3968"):  # a query row and 64 scores: 16 KiB
        batch.attention(wide, wide, wide, 0)
    out = batch.attention(tq, tk, tv, 3)
    batch.execute()
    assert_close(batch.read(out), attention_float64(q, k, v, 3).astype(np.float32), scale=10)


def test_attention_blocks_fit_the_loop_budget_and_workgroup_memory(ref):
    """Rows per block for common head dims; every head_dim's blocks and folds stay within the bounds;
    SmolLM2 (head_dim 64) keeps one launch per attention up to 2048 cache rows."""
    from batchgpu.ops import attention, bounds

    assert [attention.split_rows(d) for d in (64, 128, 512)] == [2048, 2048, 512]
    for head_dim in range(1, attention.largest_head_dim() + 1):
        rows = attention.split_rows(head_dim)
        assert attention._rows_loops(rows, head_dim) <= bounds.LOOP_BUDGET
        assert attention._rows_workgroup_bytes(rows, head_dim) <= bounds.WORKGROUP_BYTES
        dims = -(-head_dim // attention.ATTENTION_WORKGROUP)
        fan_in = attention.fold_fan_in(head_dim)
        assert (2 + dims) * fan_in + 2 * dims + 3 <= bounds.LOOP_BUDGET  # max, sum, dims x weighted sums
    for rows, entries in ((2048, ["attention"]), (2049, SPLIT)):
        batch = bg.GpuCommandBatch(ref)
        cache = batch.empty((rows, 3, 64))
        batch.attention(batch.empty((1, 9, 64)), cache, cache, batch.scalar("pos"))
        assert _attention_entries(batch) == entries


@pytest.mark.parametrize(
    "rows,head_dim,tokens,heads,kv_heads",
    [
        (7000, 512, 1, 2, 1),  # a 512-long dot product and weighted sum per row: 7.3M iterations in one pass
        (16384, 8, 3, 6, 2),  # scores of 16384 rows: 64 KiB of workgroup memory in one pass
    ],
)
def test_attention_past_loop_cap(gpu, rows, head_dim, tokens, heads, kv_heads):
    """Caches whose one-pass kernel passes llvmpipe's 65,535 loop iterations per invocation (wrong numbers,
    no error) or the workgroup memory limit (refused): split over blocks of cache rows."""
    q, k, v = _attention_inputs(74, tokens, heads, kv_heads, rows, head_dim, np.float32)
    pos = rows - tokens
    batch = bg.GpuCommandBatch(gpu)
    out = batch.attention(batch.upload(q), batch.upload(k), batch.upload(v), pos)
    batch.execute()
    assert_close(batch.read(out), attention_float64(q, k, v, pos).astype(np.float32), scale=10)


# Quantized split-K: K longer than bounds.QUANT_BLOCK_CHUNK blocks (2 under small_bounds) is cut into ranges of
# blocks whose partial sums (the bias added once) a sum over the splits adds; and a GEMV past llvmpipe's cap.


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m,rows,k", [(1, 1, 96), (1, 33, 160), (5, 33, 96), (5, 1, 160), (9, 33, 160), (9, 1, 96)])
def test_quantized_matmul_split_k(gpu, ref, small_bounds, qtype, m, rows, k):
    """K of 3 and 5 blocks: 2 and 3 splits of at most 2 blocks, against gguf's dequantization."""
    (wg, wr), truth = quantized_pair([gpu, ref], qtype, rows, k, seed=m * 100 + rows + k)
    rng = np.random.default_rng(56)
    x, bias = random_array(rng, (m, k), np.float32), random_array(rng, (rows,), np.float32)
    expected = x.astype(np.float64) @ truth.T.astype(np.float64) + bias
    for device, w in ((gpu, wg), (ref, wr)):
        batch = bg.GpuCommandBatch(device)
        y = batch.matmul(batch.upload(x), w, transpose_b=True, bias=batch.upload(bias))
        batch.execute()
        assert len(batch.nodes[-1].launches) == 2  # the partial sums, then their sum
        np.testing.assert_allclose(batch.read(y), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# Several rows of x per weight block (batch decode): the CPU form (matmul_q4_1 / matmul_q8_0 / matmul_blocks)
# dequantizes each block once for XROWS (4) rows of x; counts of rows around multiples of 4 and a last group
# with rows past the end. Each output's sum over the blocks keeps its order, so the tolerance is the one of
# the single-row tests (float32 sums of 32-value blocks against float64; a driver may contract a * b + c).
QUANT_ROW_COUNTS = (1, 2, 3, 4, 5, 16, 17)


def _quantized_weights(devices, qtype: str, rows: int, k: int, seed: int):
    """(weights per device, their float64 values): gguf's quantizer for q4_1 / q8_0, random K-quant blocks."""
    if qtype != "q4_k":
        weights, truth = quantized_pair(devices, qtype, rows, k, seed)
        return weights, truth.astype(np.float64)
    from .test_block_formats import gguf_dequantized, random_blocks

    raw = random_blocks(np.random.default_rng(seed), qtype, rows, k)
    truth = gguf_dequantized(raw, qtype, (rows, k)).astype(np.float64)
    return [device.quantized(raw, qtype, (rows, k)) for device in devices], truth


@pytest.mark.parametrize("qtype,k", [("q4_1", 160), ("q8_0", 160), ("q4_k", 512)])
def test_quantized_matmul_row_groups_split_k(gpu, ref, small_bounds, qtype, k):
    """m rows of x times 37 weight rows (not a multiple of 8 or of the workgroup), K past the split chunk
    (2 blocks under small_bounds), bias: every row count of QUANT_ROW_COUNTS against float64."""
    devices = [gpu, ref]
    weights, truth = _quantized_weights(devices, qtype, 37, k, seed=k)
    rng = np.random.default_rng(61)
    bias = random_array(rng, (37,), np.float32)
    for m in QUANT_ROW_COUNTS:
        x = random_array(rng, (m, k), np.float32)
        expected = x.astype(np.float64) @ truth.T + bias
        for device, w in zip(devices, weights):
            batch = bg.GpuCommandBatch(device)
            y = batch.matmul(batch.upload(x), w, transpose_b=True, bias=batch.upload(bias))
            batch.execute()
            scale = np.abs(x).astype(np.float64) @ np.abs(truth).T + 1
            assert np.all(np.abs(batch.read(y) - expected) <= 2e-6 * scale), (device, m)


@pytest.mark.parametrize("qtype,k", [("q4_1", 96), ("q8_0", 96), ("q4_k", 256)])
def test_quantized_matmul_row_groups_epilogues(gpu, ref, qtype, k):
    """One split, the epilogues in the kernel's store (bias, activation, swiglu) for row counts around the
    rows of one invocation, against float64."""
    devices = [gpu, ref]
    weights, truth = _quantized_weights(devices, qtype, 38, k, seed=k + 1)
    rng = np.random.default_rng(62)
    bias = random_array(rng, (38,), np.float32)
    for m in (3, 5, 17):
        x = random_array(rng, (m, k), np.float32)
        product = x.astype(np.float64) @ truth.T
        with np.errstate(over="ignore"):  # exp(-gate) of a very negative gate: silu gives -0
            cases = (
                (dict(bias=True, activation="relu"), np.maximum(product + bias, 0)),
                (dict(epilogue="swiglu"), swiglu_of_pairs(product)),
            )
        for options, expected in cases:
            for device, w in zip(devices, weights):
                batch = bg.GpuCommandBatch(device)
                extra = dict(options, bias=batch.upload(bias)) if options.get("bias") else options
                y = batch.matmul(batch.upload(x), w, transpose_b=True, **extra)
                assert len(batch.nodes[-1].launches) == 1  # the epilogue in the GEMV's store
                batch.execute()
                np.testing.assert_allclose(batch.read(y), expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max())


def test_quantized_matmul_dequantizes_once_per_row_group(ref):
    """The grids: a workgroup row per 4 rows of x (each weight block dequantized once for them), not one
    per row, in the CPU form; a warp per output of every 4 rows in the GPU form."""
    from batchgpu.ops import matmul

    (w,), _ = quantized_pair([ref], "q8_0", 40, 64, seed=63)
    batch = bg.GpuCommandBatch(ref)
    batch.matmul(batch.upload(np.ones((17, 64), np.float32)), w, transpose_b=True)
    (launch,) = batch.nodes[-1].launches
    assert launch.groups[1] == 5  # ceil(17 / 4)
    assert launch.gpu.groups == math.ceil(40 / matmul.WARPS_PER_BLOCK) * 5


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
def test_matmul_quantized_past_loop_cap(gpu, qtype):
    """K = 2.1M: 65,625 blocks, one loop iteration each in matmul_q4_1 / matmul_q8_0, past llvmpipe's
    65,535 per invocation (the last blocks were silently left out): split-K."""
    k = 2_100_000
    (w,), truth = quantized_pair([gpu], qtype, 3, k, seed=57)
    x = random_array(np.random.default_rng(58), (1, k), np.float32)
    batch = bg.GpuCommandBatch(gpu)
    y = batch.matmul(batch.upload(x), w, transpose_b=True)
    batch.execute()
    expected = x.astype(np.float64) @ truth.T.astype(np.float64)
    np.testing.assert_allclose(batch.read(y), expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_kv_cache_state_survives_re_recording(gpu, ref):
    """A KV cache in ``batch.empty`` written over executes keeps its rows when the batch is planned anew
    (one more op recorded, then ``outputs`` declared): every executor carries device state over."""
    rng = np.random.default_rng(131)
    rows = [random_array(rng, (1, 2, 4), np.float32) for _ in range(5)]
    results = []
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        pos = batch.scalar("pos")
        cache = batch.empty((6, 2, 4), np.float32)
        new = batch.upload(np.zeros((1, 2, 4), np.float32))
        batch.kv_write(cache, new, pos)
        for p, row in enumerate(rows[:3]):
            batch.execute({new: row}, scalars={"pos": p})
        doubled = batch.mul(cache, 2.0)
        batch.execute({new: rows[3]}, scalars={"pos": 3})
        batch.outputs(doubled)
        batch.execute({new: rows[4]}, scalars={"pos": 4})
        results.append(batch.read(doubled)[:5])
    assert_close(results[0], 2 * np.concatenate(rows))
    assert_close(results[1], 2 * np.concatenate(rows))


@pytest.mark.parametrize("rows,pos,window", [(40, 30, 0), (300, 290, 131)])  # one pass; blocks of rows
def test_attention_over_a_half_cache(gpu, ref, small_bounds, rows, pos, window):
    """float32 queries over float16 caches (an exported chat app's f16 variant keeps its KV cache so): each
    cached value is read as the float16 it is, computed in f32, the output float32; against float64."""
    q, k, v = _attention_inputs(77, 3, 4, 2, rows, 8, np.float32)
    k, v = k.astype(np.float16), v.astype(np.float16)
    batch = bg.GpuCommandBatch(ref)
    out = batch.attention(batch.upload(q), batch.upload(k), batch.upload(v), pos, window=window)
    assert out.dtype == np.float32
    actual = check(gpu, ref, [q, k, v], lambda b, tq, tk, tv: b.attention(tq, tk, tv, pos, window=window), np.float32)
    assert_close(actual, attention_float64(q, k, v, pos, window=window).astype(np.float32), np.float32, scale=10)
    with pytest.raises(bg.BatchError, match=r"v_cache .* has dtype float32, but k_cache has float16"):
        batch.attention(batch.upload(q), batch.upload(k), batch.upload(v.astype(np.float32)), pos)
