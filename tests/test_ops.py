"""Every op on the wgpu executor against the numpy reference executor: random non-zero data, odd
shapes (1, primes, non-multiples of tiles, broadcasts), each supported dtype, poisoned outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.ops import OPS
from batchgpu.ops.elementwise import EXPRESSIONS

from .conftest import assert_close, random_array
from .op_examples import accepts

DTYPES = [np.float32, np.float16, np.int32, np.uint32]


def run_on(device: bg.Device, arrays: Sequence[np.ndarray], build: Callable) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    inputs = [batch.upload(a) for a in arrays]
    out = build(batch, *inputs)
    batch.execute()
    return batch.read(out)


def check(gpu, ref, arrays, build, dtype=None, scale=1.0) -> np.ndarray:
    expected = run_on(ref, arrays, build)
    actual = run_on(gpu, arrays, build)
    assert_close(actual, expected, dtype, scale)
    return actual


# every elementwise op of the op-expression table, over each dtype its spec accepts
UNARY_CASES = [
    (op, dtype) for op in sorted(EXPRESSIONS) for dtype in DTYPES if EXPRESSIONS[op].arity == 1 and accepts(op, dtype)
]
BINARY_CASES = [
    (op, dtype) for op in sorted(EXPRESSIONS) for dtype in DTYPES if EXPRESSIONS[op].arity == 2 and accepts(op, dtype)
]


@pytest.mark.parametrize("op,dtype", UNARY_CASES)
def test_unary(gpu, ref, op, dtype):
    domain = OPS[op].domain
    rng = np.random.default_rng(hash((op, str(dtype))) % 2**32)
    for shape in [(1,), (257,), (3, 5, 11)]:
        x = random_array(rng, shape, dtype, domain)
        check(gpu, ref, [x], lambda b, t: getattr(b, op)(t), dtype)


def test_unary_reference_matches_numpy(ref):
    """The reference executor itself agrees with plain numpy (float64) on the float ops."""
    rng = np.random.default_rng(1)
    x = random_array(rng, (101,), np.float32)
    pos = random_array(rng, (101,), np.float32, "positive")
    numpy_fns = {
        "exp": np.exp,
        "tanh": np.tanh,
        "sqrt": np.sqrt,
        "log": np.log,
        "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
    }
    for op, fn in numpy_fns.items():
        data = pos if OPS[op].domain == "positive" else x
        np.testing.assert_allclose(
            run_on(ref, [data], lambda b, t, op=op: getattr(b, op)(t)), fn(data.astype(np.float64)), rtol=1e-6
        )


def test_transcendentals_saturate(gpu, ref):
    """Large magnitudes: tanh/sigmoid/silu/gelu stay finite and match the reference."""
    x = np.array([-120.0, -30.0, -9.5, 0.25, 9.5, 30.0, 120.0], dtype=np.float32)
    for op in ("tanh", "sigmoid", "silu", "gelu", "exp"):
        check(gpu, ref, [x], lambda b, t, op=op: getattr(b, op)(t), np.float32)


BROADCASTS = [((7,), (7,)), ((3, 1, 5), (4, 5)), ((1,), (13,)), ((2, 3, 4), (3, 1)), ((5, 1), (1, 6)), ((), (3, 2))]


@pytest.mark.parametrize("op,dtype", BINARY_CASES)
def test_binary_broadcast(gpu, ref, op, dtype):
    rng = np.random.default_rng(hash((op, str(dtype), 2)) % 2**32)
    for a_shape, b_shape in BROADCASTS:
        a = random_array(rng, a_shape, dtype)
        b = random_array(rng, b_shape, dtype, "positive" if op == "div" else "any")
        if op == "sub" and np.dtype(dtype) == np.uint32:
            a = a + np.uint32(1000)  # keep unsigned differences non-negative
        check(gpu, ref, [a, b], lambda bt, x, y: getattr(bt, op)(x, y), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_python_scalars(gpu, ref, dtype):
    x = random_array(np.random.default_rng(3), (4, 9), dtype)
    check(gpu, ref, [x], lambda b, t: b.mul(b.add(t, 3), 2), dtype)
    check(gpu, ref, [x], lambda b, t: b.sub(5, t), dtype)
    check(gpu, ref, [x], lambda b, t: (t + 1) * 2 - t, dtype)
    if np.dtype(dtype).kind == "f":
        check(gpu, ref, [x], lambda b, t: b.div(1.5, b.add(b.abs(t), 0.5)), dtype)


MATMUL_CASES = [
    ((1, 1), (1, 1), {}),
    ((5, 7), (7, 3), {}),
    ((67, 129), (129, 65), {}),
    ((3, 17, 33), (3, 33, 19), {}),
    ((2, 1, 5, 7), (3, 7, 4), {}),
    ((3, 17, 33), (33, 19), {}),
    ((33, 17), (33, 19), {"transpose_a": True}),
    ((17, 33), (19, 33), {"transpose_b": True}),
    ((2, 33, 17), (2, 19, 33), {"transpose_a": True, "transpose_b": True}),
    ((31,), (31, 5), {}),
    ((4, 31), (31,), {}),
    ((1, 300), (300, 1), {}),
    # decode GEMVs (m <= 8, b stored (N, K)): native executors run a warp per output column
    ((1, 577), (131, 577), {"transpose_b": True}),
    ((8, 37), (67, 37), {"transpose_b": True}),
    ((7, 1), (3, 1), {"transpose_b": True}),
    ((37, 5), (61, 37), {"transpose_a": True, "transpose_b": True}),
]


@pytest.mark.parametrize("a_shape,b_shape,params", MATMUL_CASES)
def test_matmul_float32(gpu, ref, a_shape, b_shape, params):
    rng = np.random.default_rng(sum(a_shape) * 31 + sum(b_shape))
    a = random_array(rng, a_shape, np.float32)
    b = random_array(rng, b_shape, np.float32)
    k = a_shape[-2] if params.get("transpose_a") else a_shape[-1]
    check(gpu, ref, [a, b], lambda bt, x, y: bt.matmul(x, y, **params), np.float32, scale=4 * np.sqrt(k))


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint32])
def test_matmul_other_dtypes(gpu, ref, dtype):
    rng = np.random.default_rng(5)
    a = random_array(rng, (19, 70), dtype) // (1 if np.dtype(dtype).kind == "f" else 10)
    b = random_array(rng, (70, 23), dtype) // (1 if np.dtype(dtype).kind == "f" else 10)
    a, b = a.astype(dtype), b.astype(dtype)
    check(gpu, ref, [a, b], lambda bt, x, y: bt.matmul(x, y), dtype, scale=10)
    decode_a = random_array(rng, (3, 70), dtype) // (1 if np.dtype(dtype).kind == "f" else 10)
    decode = [decode_a.astype(dtype), b.T.copy()]  # (3, K) @ (N, K)^T: the native executors' warp GEMV
    check(gpu, ref, decode, lambda bt, x, y: bt.matmul(x, y, transpose_b=True), dtype, scale=10)


BIG_TILE_CASES = [  # the native executors' 128 x 128 tiles (matmul_128; float16: matmul_mma_f16)
    (np.float32, (32, 129, 37), (37, 131), {}),  # 128 big tiles: matmul_128, ragged m, n and k
    (np.float32, (32, 37, 129), (131, 37), {"transpose_a": True, "transpose_b": True}),
    (np.int32, (32, 129, 9), (9, 130), {}),
    (np.float16, (130, 67), (67, 193), {}),  # tensor cores: several k steps, ragged edges
    (np.float16, (67, 130), (193, 67), {"transpose_a": True, "transpose_b": True}),
    (np.float16, (3, 33, 40), (3, 40, 17), {}),
    # 16-byte staging of whole aligned tiles (A along k, B along n), the ragged ones element by element
    (np.float16, (136, 96), (96, 264), {}),
    (np.float16, (96, 136), (264, 96), {"transpose_a": True, "transpose_b": True}),  # A along m, B along k
    (np.float16, (2, 128, 104), (104, 128), {}),  # whole k steps, then a partial last one; batched
]


@pytest.mark.parametrize("dtype,a_shape,b_shape,params", BIG_TILE_CASES)
def test_matmul_big_tiles(gpu, ref, dtype, a_shape, b_shape, params):
    rng = np.random.default_rng(sum(a_shape) + 7 * sum(b_shape))
    integer = np.dtype(dtype).kind != "f"
    a = (random_array(rng, a_shape, dtype) // (10 if integer else 1)).astype(dtype)
    b = (random_array(rng, b_shape, dtype) // (10 if integer else 1)).astype(dtype)
    k = a_shape[-2] if params.get("transpose_a") else a_shape[-1]
    check(gpu, ref, [a, b], lambda bt, x, y: bt.matmul(x, y, **params), dtype, scale=4 * np.sqrt(k))


def test_matmul_large_tile_edges(gpu, ref):
    """Several 64x64 tiles plus ragged edges in every dim and k not a multiple of 16."""
    rng = np.random.default_rng(6)
    a = random_array(rng, (130, 67), np.float32)
    b = random_array(rng, (67, 193), np.float32)
    check(gpu, ref, [a, b], lambda bt, x, y: bt.matmul(x, y), np.float32, scale=40)


REDUCE_CASES = [
    ((1,), None, False),
    ((257,), 0, False),
    ((3, 5, 7), None, False),
    ((3, 5, 7), -1, False),
    ((3, 5, 7), 1, True),
    ((3, 5, 7), 0, False),
    ((3, 5, 7), (0, 2), False),
    ((3, 5, 7), (1, 2), True),
    ((2, 1000), 1, False),
    ((1000, 3), 0, False),
]


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("shape,axis,keepdims", REDUCE_CASES)
def test_reductions_float32(gpu, ref, op, shape, axis, keepdims):
    x = random_array(np.random.default_rng(len(shape) * 7 + shape[0]), shape, np.float32)
    check(gpu, ref, [x], lambda b, t: getattr(b, op)(t, axis=axis, keepdims=keepdims), np.float32, scale=20)


@pytest.mark.parametrize(
    "op,dtype",
    [
        ("sum", np.int32),
        ("max", np.int32),
        ("sum", np.uint32),
        ("max", np.uint32),
        ("sum", np.float16),
        ("mean", np.float16),
        ("max", np.float16),
    ],
)
def test_reductions_other_dtypes(gpu, ref, op, dtype):
    x = random_array(np.random.default_rng(8), (6, 333), dtype)
    for axis in (None, 0, 1):
        check(gpu, ref, [x], lambda b, t, axis=axis: getattr(b, op)(t, axis=axis), dtype, scale=4)


@pytest.mark.parametrize(
    "shape,axis", [((1,), -1), ((3, 5, 7), -1), ((3, 5, 7), 1), ((3, 5, 7), 0), ((2, 1000), -1), ((4, 49152), -1)]
)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax(gpu, ref, shape, axis, dtype):
    x = random_array(np.random.default_rng(9), shape, dtype) * 4
    out = check(gpu, ref, [x], lambda b, t: b.softmax(t, axis=axis), dtype, scale=2)
    np.testing.assert_allclose(out.astype(np.float64).sum(axis=axis), 1.0, rtol=5e-3 if dtype == np.float16 else 1e-5)


def test_softmax_large_values_are_stable(gpu, ref):
    x = np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -999.0]], dtype=np.float32)
    out = check(gpu, ref, [x], lambda b, t: b.softmax(t), np.float32)
    assert np.isfinite(out).all()


def test_reshape_is_a_free_view(gpu, ref):
    x = random_array(np.random.default_rng(10), (6, 35), np.float32)
    batch = bg.GpuCommandBatch(gpu)
    t = batch.upload(x)
    v = batch.reshape(t, (5, -1, 7))
    assert v.shape == (5, 6, 7) and v.storage is t.storage
    assert len(batch.nodes[0].launches) == 0
    check(gpu, ref, [x], lambda b, t: b.relu(b.reshape(t, 3, 70)), np.float32)


@pytest.mark.parametrize("axes", [None, (1, 0, 2), (2, 0, 1), (0, 2, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_transpose_permute(gpu, ref, axes, dtype):
    x = random_array(np.random.default_rng(11), (3, 5, 7), dtype)
    check(gpu, ref, [x], lambda b, t: b.transpose(t, axes), dtype)


@pytest.mark.parametrize(
    "key",
    [
        (slice(1, 4),),
        (slice(None), 2),
        (Ellipsis, slice(None, None, -2)),
        (1, slice(2, None), slice(None, 5, 3)),
        (-1,),
        (slice(None, None, -1), slice(1, -1)),
    ],
)
def test_slice(gpu, ref, key):
    x = random_array(np.random.default_rng(12), (5, 6, 7), np.float32)
    check(gpu, ref, [x], lambda b, t: b.slice(t, key), np.float32)
    check(gpu, ref, [x], lambda b, t: t[key], np.float32)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(gpu, ref, axis):
    rng = np.random.default_rng(13)
    shapes = {
        0: [(2, 3, 5), (1, 3, 5), (4, 3, 5)],
        1: [(2, 1, 5), (2, 3, 5), (2, 7, 5)],
        -1: [(2, 3, 1), (2, 3, 2), (2, 3, 11)],
    }[axis]
    arrays = [random_array(rng, s, np.int32) for s in shapes]
    check(gpu, ref, arrays, lambda b, *ts: b.concat(ts, axis=axis), np.int32)


@pytest.mark.parametrize(
    "src,dst",
    [
        (np.float32, np.int32),
        (np.float32, np.float16),
        (np.float16, np.float32),
        (np.int32, np.float32),
        (np.uint32, np.float32),
        (np.int32, np.uint32),
        (np.float32, np.uint32),
        (np.uint32, np.int32),
    ],
)
def test_cast(gpu, ref, src, dst):
    rng = np.random.default_rng(14)
    x = random_array(rng, (257,), src, "positive" if np.dtype(dst) == np.uint32 else "any")
    check(gpu, ref, [x], lambda b, t: b.cast(t, dst), dst)


CAST_EDGES = [np.nan, -np.nan, np.inf, -np.inf, 1e20, -1e20, 2147483520.0, 2147483648.0, -2147483648.0]
CAST_EDGES += [-2147483904.0, 4294967040.0, 4294967296.0, 65504.0, -0.5, -1.0, 0.999, 3.7, -3.7, 0.0, -0.0]


@pytest.mark.parametrize("src", [np.float32, np.float16])
@pytest.mark.parametrize("dst", [np.int32, np.uint32])
def test_float_to_int_cast_truncates_saturates_and_maps_nan_to_zero(gpu, ref, src, dst):
    """The contract of ``cast`` from float to int on every executor, alone and inside a fused kernel: toward
    zero, saturating at the integer type's bounds (inf included), NaN to 0 (CUDA's cvt.rzi, Rust's ``as``).
    numpy leaves these undefined, WGSL's conversion leaves NaN indeterminate and saturates at the nearest
    float32 (2147483520 for int32), C++ makes them undefined behaviour: the kernels test the bits first."""
    rng = np.random.default_rng(16)
    with np.errstate(over="ignore"):
        x = np.concatenate([CAST_EDGES, rng.standard_normal(100) * 1e3, rng.standard_normal(100) * 1e10]).astype(src)
    info = np.iinfo(dst)
    wide = x.astype(np.float64)
    want = np.where(np.isnan(wide), 0, np.clip(np.trunc(np.nan_to_num(wide, nan=0.0)), info.min, info.max))
    for device in (gpu, ref):
        for fused in (False, True):
            batch = bg.GpuCommandBatch(device, fusion=fused)
            t = batch.upload(x)
            out = batch.cast(batch.neg(batch.neg(t)) if fused else t, dst)  # neg twice: a chain, exactly x
            batch.outputs(out)
            batch.execute(profile=True)
            assert any(row.op.startswith("fused(") for row in batch.profile().rows) == fused
            got = batch.read(out)
            wrong = np.flatnonzero(got != want.astype(dst))
            assert not wrong.size, f"{device.kind} fused={fused}: {x[wrong]} gave {got[wrong]}, not {want[wrong]}"


def test_chain_of_ops_matches_numpy(gpu, ref):
    """A small layer through several families in one batch: also checks intermediate plumbing."""
    rng = np.random.default_rng(15)
    x = random_array(rng, (7, 33), np.float32)
    w = random_array(rng, (33, 12), np.float32)

    def build(b, tx, tw):
        h = b.gelu(b.matmul(tx, tw))
        h = b.sub(h, b.mean(h, axis=-1, keepdims=True))
        return b.softmax(b.concat([h, b.transpose(b.slice(h, (slice(None), slice(0, 7))), None)], axis=1))

    check(gpu, ref, [x, w], build, np.float32, scale=20)


@pytest.mark.slow
def test_op_above_one_dispatch_limit(gpu):
    """2^25 elements need more workgroups than one dimension allows: the dispatch is split."""
    n = 2**25
    groups = n // 256
    assert groups > gpu.limits.max_compute_workgroups_per_dimension
    rng = np.random.default_rng(16)
    x = rng.standard_normal(n, dtype=np.float32)
    batch = bg.GpuCommandBatch(gpu)
    t = batch.upload(x)
    y = batch.add(batch.relu(t), 1.5)
    s = batch.sum(y)
    batch.execute()
    np.testing.assert_array_equal(batch.read(y), np.maximum(x, 0) + np.float32(1.5))
    np.testing.assert_allclose(batch.read(s), (np.maximum(x, 0) + 1.5).astype(np.float64).sum(), rtol=1e-4)


@pytest.mark.slow
def test_fused_llm_ops_above_one_dispatch_limit(gpu):
    """swiglu and rope_kv_write at sizes needing more workgroups than one grid dimension allows."""
    limit = gpu.limits.max_compute_workgroups_per_dimension
    rng = np.random.default_rng(18)
    rows = limit * 256 + 999  # swiglu: one invocation per output, 256 per workgroup
    x = rng.standard_normal((rows, 2), dtype=np.float32).astype(np.float16)
    batch = bg.GpuCommandBatch(gpu)
    y = batch.swiglu(batch.upload(x))
    batch.execute()
    gate, up = x[:, 0].astype(np.float64), x[:, 1].astype(np.float64)
    np.testing.assert_allclose(batch.read(y)[:, 0], gate / (1 + np.exp(-gate)) * up, rtol=2e-3, atol=1e-3)
    tokens = limit * 64 // (15 * 32) + 3  # rope_kv_write: one invocation per pair of 15 heads of 64, 64 per group
    assert tokens * 15 * 32 > limit * 64
    qkv = rng.standard_normal((tokens, 15, 64), dtype=np.float32)
    caches = [gpu.tensor(np.zeros((tokens, 3, 64), np.float32)) for _ in range(2)]
    batch = bg.GpuCommandBatch(gpu)
    q = batch.rope_kv_write(batch.upload(qkv), *caches, 0)
    batch.execute()
    ref = bg.Device("reference")
    expected = run_on(ref, [qkv], lambda b, t: b.rope(b.slice(t, (slice(None), slice(0, 12))), 0, 10000.0))
    np.testing.assert_allclose(batch.read(q), expected[:, :9], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gpu.read(caches[0]), expected[:, 9:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gpu.read(caches[1]), qkv[:, 12:])


def test_many_rows_split_over_two_dims(gpu, ref):
    """Row reductions use one workgroup per row: more rows than one grid dimension allows."""
    rows = gpu.limits.max_compute_workgroups_per_dimension + 17
    x = random_array(np.random.default_rng(17), (rows, 3), np.float32)
    check(gpu, ref, [x], lambda b, t: b.max(t, axis=1), np.float32)
    check(gpu, ref, [x], lambda b, t: b.softmax(t), np.float32)


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_long_rows_take_several_passes(gpu, ref, op):
    """Rows longer than one workgroup's chunk reduce through partials (and long columns get permuted)."""
    from batchgpu.ops.bounds import COLUMN_LIMIT, ROW_CHUNK

    rng = np.random.default_rng(18)
    x = random_array(rng, (2, 3 * ROW_CHUNK + 5), np.float32)
    check(gpu, ref, [x], lambda b, t: getattr(b, op)(t, axis=1), np.float32, scale=100)
    y = random_array(rng, (COLUMN_LIMIT + 3, 5), np.float32)
    check(gpu, ref, [y], lambda b, t: getattr(b, op)(t, axis=0), np.float32, scale=100)


def test_softmax_long_columns(gpu, ref):
    from batchgpu.ops.bounds import COLUMN_LIMIT

    x = random_array(np.random.default_rng(19), (COLUMN_LIMIT + 3, 2, 3), np.float32)
    check(gpu, ref, [x], lambda b, t: b.softmax(t, axis=0), np.float32)


@pytest.mark.parametrize("width", [1, 299, 300, 301, 601, 1000])  # pieces of 300; 1000: a ragged last piece
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_long_rows(gpu, ref, small_bounds, width, dtype):
    """Rows longer than ROW_CHUNK: per-piece (max, sum of exp) partials combined as online softmax does; a
    long non-last axis is moved last first, a short one (1 here) takes the column kernel."""
    x = random_array(np.random.default_rng(21), (3, width), dtype) * 4
    check(gpu, ref, [x], lambda b, t: b.softmax(t), dtype, scale=2)
    check(gpu, ref, [np.ascontiguousarray(x.T)], lambda b, t: b.softmax(t, axis=0), dtype, scale=2)


def test_softmax_long_rows_with_masked_pieces(gpu, ref, small_bounds):
    """A piece of -inf only (max -inf: its sum of exp(x - max) is NaN) adds nothing to its row."""
    x = random_array(np.random.default_rng(22), (2, 1000), np.float32)
    x[0, 300:600] = -np.inf  # exactly the second piece
    x[1, 250:700] = -np.inf  # the second piece and parts of its neighbours
    out = check(gpu, ref, [x], lambda b, t: b.softmax(t), np.float32)
    assert not out[np.isinf(x)].any()


def test_softmax_past_loop_cap(gpu):
    """A 6M row: one workgroup's three loops of 6M / 256 iterations would pass llvmpipe's per-invocation
    cap (65,535) and leave elements unwritten."""
    x = np.random.default_rng(23).standard_normal(6_000_000, dtype=np.float32)
    batch = bg.GpuCommandBatch(gpu)
    out = batch.softmax(batch.upload(x))
    batch.execute()
    shifted = np.exp(x.astype(np.float64) - x.max())
    np.testing.assert_allclose(batch.read(out), shifted / shifted.sum(), rtol=2e-5, atol=0)  # values ~1e-7


# Split-K: K longer than bounds.MATMUL_K_CHUNK (32 under small_bounds) is cut into ranges whose partial
# products (float32 for float16, wrapping for integers; the bias added once) a sum over the splits adds.
# Every kernel form honours the split: the tiled kernel, matmul_skinny, the GEMV of b stored (N, K)
# (matmul_gemv_t: tests/test_wgpu_gpu_kernels.py, tests/test_cuda_kernels_cpu.py) and matmul_128.


def check_split_k(gpu, ref, arrays, build, dtype, k: int) -> None:
    """``check``, after asserting that the matmul lowers to a split-K pass and a sum exactly when K is
    longer than the chunk."""
    from batchgpu.ops import bounds

    batch = bg.GpuCommandBatch(ref)
    build(batch, *(batch.upload(a) for a in arrays))
    assert (len(batch.nodes[-1].launches) > 1) == (k > bounds.MATMUL_K_CHUNK)
    check(gpu, ref, arrays, build, dtype, scale=4 * np.sqrt(k))


SPLIT_K_CASES = [  # a shape, b shape, flags, with a bias
    ((3, 1), (1, 5), {}, True),  # K = 1 and K = 31: one split, the kernels as without split-K
    ((1, 31), (31, 7), {}, False),
    ((1, 33), (33, 1), {}, True),  # matmul_skinny: 2 splits, the last one k long
    ((5, 97), (97, 13), {}, True),  # 4 splits
    ((8, 97), (131, 97), {"transpose_b": True}, True),  # decode GEMV (matmul_gemv_t on GPUs)
    ((1, 257), (67, 257), {"transpose_b": True}, False),  # 9 splits > COLUMN_LIMIT (7): summed as rows
    ((67, 97), (97, 131), {}, True),  # tiled: 2 x 3 tiles of 64, ragged
    ((97, 9), (97, 65), {"transpose_a": True}, False),
    ((2, 1, 9, 33), (3, 33, 65), {}, True),  # broadcast batch dims
    ((2, 33, 17), (2, 19, 33), {"transpose_a": True, "transpose_b": True}, True),
    ((97,), (97, 5), {}, True),  # 1-D operands
    ((11, 97), (97,), {}, False),
    ((97,), (97,), {}, False),
]


@pytest.mark.parametrize("a_shape,b_shape,params,with_bias", SPLIT_K_CASES)
def test_matmul_split_k_float32(gpu, ref, small_bounds, a_shape, b_shape, params, with_bias):
    rng = np.random.default_rng(sum(a_shape) * 17 + sum(b_shape))
    arrays = [random_array(rng, a_shape, np.float32), random_array(rng, b_shape, np.float32)]
    n = (b_shape[-2] if params.get("transpose_b") else b_shape[-1]) if len(b_shape) > 1 else 1
    arrays += [random_array(rng, (n,), np.float32)] if with_bias else []
    k = a_shape[-2] if params.get("transpose_a") else a_shape[-1]

    def build(bt, x, y, *bias):
        return bt.matmul(x, y, bias=bias[0] if bias else None, **params)

    check_split_k(gpu, ref, arrays, build, np.float32, k)


SPLIT_K_DTYPE_CASES = [
    ((13, 97), (97, 67), {}),  # tiled
    ((2, 5, 33), (33, 9), {}),  # batched
    ((3, 97), (67, 97), {"transpose_b": True}),  # decode GEMV
    ((1, 65), (65, 70), {}),  # matmul_skinny
]


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint32])
@pytest.mark.parametrize("a_shape,b_shape,params", SPLIT_K_DTYPE_CASES)
def test_matmul_split_k_other_dtypes(gpu, ref, small_bounds, dtype, a_shape, b_shape, params):
    rng = np.random.default_rng(sum(a_shape) * 19 + sum(b_shape))
    shrink = 1 if np.dtype(dtype).kind == "f" else 10
    n = b_shape[-2] if params.get("transpose_b") else b_shape[-1]
    arrays = [(random_array(rng, shape, dtype) // shrink).astype(dtype) for shape in (a_shape, b_shape, (n,))]
    check_split_k(gpu, ref, arrays, lambda bt, x, y, z: bt.matmul(x, y, bias=z, **params), dtype, a_shape[-1])


@pytest.mark.parametrize(
    "dtype,a_shape,b_shape",
    [
        (np.float32, (16, 129, 65), (65, 131)),  # 2 x 2 tiles of 128 x 16 x 3 splits: matmul_128
        (np.float16, (8, 129, 97), (97, 130)),  # float16 with splits: matmul_128, not tensor cores
        (np.int32, (16, 130, 33), (33, 129)),
    ],
)
def test_matmul_split_k_big_tiles(gpu, ref, small_bounds, dtype, a_shape, b_shape):
    """The native executors' 128 x 128 tiles with split-K (grid y: m tiles x splits); other executors run
    the tiled kernel."""
    rng = np.random.default_rng(sum(a_shape) + 3 * sum(b_shape))
    shrink = 1 if np.dtype(dtype).kind == "f" else 10
    arrays = [(random_array(rng, shape, dtype) // shrink).astype(dtype) for shape in (a_shape, b_shape, b_shape[1:])]
    check_split_k(gpu, ref, arrays, lambda bt, x, y, z: bt.matmul(x, y, bias=z), dtype, a_shape[-1])


def test_matmul_k_chunk_fits_the_loop_budget():
    """Loop iterations per invocation at the chunk, as llvmpipe counts them (batchgpu/ops/bounds.py): 18
    per 16-deep k tile of the tiled kernel, one per k of matmul_skinny, one per block of the quantized
    kernels; the chunk is a whole number of k tiles (no tile straddles two splits)."""
    from batchgpu.ops import bounds, matmul

    assert bounds.MATMUL_K_CHUNK % matmul.TILE_K == 0
    assert 18 * bounds.MATMUL_K_CHUNK // matmul.TILE_K <= bounds.LOOP_BUDGET
    assert bounds.MATMUL_K_CHUNK <= bounds.LOOP_BUDGET and bounds.QUANT_BLOCK_CHUNK <= bounds.LOOP_BUDGET


@pytest.mark.parametrize("m,k,n", [(1, 70_000, 8), (9, 65_536, 2)])  # matmul_skinny; the tiled kernel
def test_matmul_long_k_past_loop_cap(gpu, m, k, n):
    """K whose one-invocation loop passes llvmpipe's 65,535 iterations per invocation (matmul_skinny: one
    per k; the tiled kernel: 18 per 16 k) and silently gave wrong numbers: split-K."""
    rng = np.random.default_rng(k + m)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    batch = bg.GpuCommandBatch(gpu)
    out = batch.matmul(batch.upload(a), batch.upload(b))
    batch.execute()
    assert_close(batch.read(out), (a.astype(np.float64) @ b).astype(np.float32), scale=4 * np.sqrt(k))


# NaN propagates exactly like numpy through the ops built on max/min (relu, maximum, minimum, the max
# reduction, tanh's clamp, softmax's row max): the kernels test NaN by bit pattern, for float data only.
# check() compares through assert_allclose, which requires NaN and +-inf at the same positions.
NAN_OPS = {
    "relu": lambda b, x, y: b.relu(x),
    "tanh": lambda b, x, y: b.tanh(x),
    "maximum": lambda b, x, y: b.maximum(x, y),
    "minimum": lambda b, x, y: b.minimum(x, y),
    "maximum_broadcast": lambda b, x, y: b.maximum(b.slice(y, slice(0, 1)), x),
    "minimum_broadcast": lambda b, x, y: b.minimum(x, b.slice(y, slice(0, 1))),
    "max_rows": lambda b, x, y: b.max(x, axis=-1),
    "max_cols": lambda b, x, y: b.max(x, axis=0),
    "max_all": lambda b, x, y: b.max(x),
    "softmax_rows": lambda b, x, y: b.softmax(x),
    "softmax_cols": lambda b, x, y: b.softmax(x, axis=0),
}


def nan_data(rng: np.random.Generator, shape: tuple[int, int], dtype, spots: dict) -> np.ndarray:
    x = random_array(rng, shape, dtype)
    for value, where in spots.items():
        for at in where:
            x[at] = value
    return x


def check_nan(gpu, ref, arrays, build, dtype) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return check(gpu, ref, arrays, build, dtype, scale=2)


@pytest.mark.parametrize("op", sorted(NAN_OPS))
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nan_propagates_like_numpy(gpu, ref, op, dtype):
    """NaN first, last, in the middle, twice in a row, next to +-inf; rows without NaN; rows of one."""
    rng = np.random.default_rng(31)
    x = nan_data(
        rng,
        (6, 7),
        dtype,
        {np.nan: [(0, 0), (1, 6), (2, 3), (3, 1), (3, 5)], np.inf: [(2, 2), (3, 0), (4, 4)], -np.inf: [(1, 0), (5, 6)]},
    )
    y = nan_data(rng, (6, 7), dtype, {np.nan: [(0, 1), (1, 6), (4, 4), (5, 2)], np.inf: [(1, 1)], -np.inf: [(2, 0)]})
    out = check_nan(gpu, ref, [x, y], NAN_OPS[op], dtype)
    assert np.isnan(out).any()
    singles = nan_data(rng, (5, 1), dtype, {np.nan: [(1, 0), (3, 0)], np.inf: [(4, 0)]})
    check_nan(gpu, ref, [singles, singles[::-1].copy()], NAN_OPS[op], dtype)


@pytest.mark.parametrize("op", ["max_rows", "max_cols", "softmax_rows", "softmax_cols"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nan_in_long_rows_and_columns(gpu, ref, small_bounds, op, dtype):
    """Rows longer than ROW_CHUNK (300 here) reduce in pieces whose partials another pass combines, columns
    longer than COLUMN_LIMIT are permuted first: a NaN anywhere still makes its row NaN. Row 3's middle
    piece is -inf but for one NaN (softmax skips pieces of -inf only); row 4's last piece is all NaN; row 6
    has none."""
    x = nan_data(
        np.random.default_rng(32),
        (7, 1000),
        dtype,
        {np.nan: [(0, 0), (1, 999), (2, 450), (3, 450), (5, 299), (5, 300)], np.inf: [(2, 7)], -np.inf: [(1, 5)]},
    )
    x[3, 300:600] = -np.inf
    x[3, 450] = np.nan
    x[4, 900:] = np.nan
    if op.endswith("cols"):
        x = np.ascontiguousarray(x.T)
    out = check_nan(gpu, ref, [x, x], NAN_OPS[op], dtype)
    assert np.isnan(out).any() and not np.isnan(out).all()


INT_NAN_BITS = {
    np.int32: [0x7FC00000, -1, 0x7F800001, -0x400000, 0x7F800000, 3, -5, 0],
    np.uint32: [0x7FC00000, 0xFFFFFFFF, 0x7F800001, 0xFFC00000, 0x7F800000, 3, 5, 0],
}


@pytest.mark.parametrize("op", ["relu", "maximum", "minimum", "max_rows", "max_cols", "max_all"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_integers_with_nan_bit_patterns_stay_integers(gpu, ref, op, dtype):
    """int32/uint32 values whose bits read as a float NaN (or inf) are plain integers to every op."""
    x = np.array(INT_NAN_BITS[dtype], dtype).reshape(2, 4)
    y = x[:, ::-1].copy()
    check(gpu, ref, [x, y], NAN_OPS[op], dtype)
    check(gpu, ref, [y, x], NAN_OPS[op], dtype)


@pytest.mark.parametrize("dtype", [np.int32, np.uint32])
def test_integer_long_rows_with_nan_bit_patterns(gpu, ref, small_bounds, dtype):
    """The chunked max passes treat NaN-looking integer bits as integers too."""
    rng = np.random.default_rng(33)
    x = rng.choice(np.array(INT_NAN_BITS[dtype], dtype), (3, 700))
    check(gpu, ref, [x], lambda b, t: b.max(t, axis=-1), dtype)
    check(gpu, ref, [np.ascontiguousarray(x.T)], lambda b, t: b.max(t, axis=0), dtype)
