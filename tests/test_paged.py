"""The paged KV cache ops on every executor (wgpu on lavapipe here; the CUDA kernels on the CPU harness and on
GPUs collect this module too) against the numpy reference, the contiguous ``attention`` op and float64 numpy:
rope at per-token positions, scatter_rows into batch and resident tables, paged_attention through shuffled
block tables (prefill-like and decode-like rows of several sequences, idle rows, grouped-query heads, blocks of
1, 7 and 16 rows, float32 and float16 pools), split over blocks of positions (``small_bounds``), at long
contexts and past llvmpipe's per-invocation loop cap."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg

from .conftest import TOLERANCES, assert_close, random_array
from .test_ops import check

FLOATS = [np.float32, np.float16]
DTYPES = [np.float32, np.float16, np.int32, np.uint32]

# rope at per-token positions ----------------------------------------------------------------------


def rope_float64(x: np.ndarray, positions: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """Rotate-half rotary embedding (transformers' apply_rotary_pos_emb) in float64, token t at positions[t],
    with the float32 inverse frequencies and angles the kernels use."""
    head_dim = x.shape[-1]
    inv = (1.0 / np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))).astype(
        np.float32
    )
    angles = (positions.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)  # f32 angles, as the kernels
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]
    x = x.astype(np.float64)
    rotated = np.concatenate([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


@pytest.mark.parametrize("shape,start", [((1, 9, 64), 0), ((5, 3, 64), 3), ((7, 2, 6), 11), ((3, 2, 8), 8000)])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_positions_tensor_equals_scalar_positions(gpu, ref, shape, start, dtype):
    """Consecutive positions from a tensor give exactly what an int and a per-execute scalar give: one kernel."""
    x = random_array(np.random.default_rng(200 + start), shape, dtype)
    positions = np.arange(start, start + shape[0], dtype=np.int32)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        tx, pos = batch.upload(x), batch.scalar("pos")
        outs = [batch.rope(tx, batch.upload(positions)), batch.rope(tx, start), batch.rope(tx, pos)]
        assert [batch.nodes[i].launches[0].entry for i in range(3)] == ["rope_positions", "rope", "rope"]
        batch.execute(scalars={"pos": start})
        by_tensor, by_int, by_scalar = (batch.read(out) for out in outs)
        np.testing.assert_array_equal(by_tensor, by_int)
        np.testing.assert_array_equal(by_tensor, by_scalar)


@pytest.mark.parametrize("dtype", FLOATS)
def test_rope_arbitrary_positions(gpu, ref, dtype):
    """Shuffled, repeated and large positions (up to 8191, SmolLM2's last), against the reference and float64.
    The kernels reduce the f32 angle to [-pi, pi] in f32 (an error growing with the position, ~1e-7 x angle),
    numpy's cos/sin do it exactly: the tolerance grows with each token's position."""
    rng = np.random.default_rng(210)
    positions = np.array([8191, 0, 5, 5, 8190, 4097, 1, 8191, 2047, 300, 5, 65535], np.int32)
    rng.shuffle(positions)
    x = random_array(rng, (len(positions), 3, 64), dtype)
    out, expected = run_rope(gpu, x, positions), run_rope(ref, x, positions)
    base = TOLERANCES[np.dtype(dtype)]
    magnitude = np.abs(x.astype(np.float64)).max(axis=(1, 2), keepdims=True)
    reduction = 2e-7 * positions.astype(np.float64)[:, None, None] * magnitude  # the kernels' angle reduction
    for actual, truth in ((out, expected.astype(np.float64)), (out, rope_float64(x, positions))):
        error = np.abs(actual.astype(np.float64) - truth)
        allowed = base["atol"] * 4 + base["rtol"] * 4 * np.abs(truth) + reduction
        assert (error <= allowed).all(), (error - allowed).max()
    assert_close(expected, rope_float64(x, positions).astype(dtype), dtype, scale=4)  # numpy reduces exactly
    wrong = rope_float64(x, np.roll(positions, 1))  # a position of another token fails it
    assert (np.abs(out.astype(np.float64) - wrong) > base["atol"] * 4 + reduction).any()


def run_rope(device: bg.Device, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    out = batch.rope(batch.upload(x), batch.upload(positions))
    batch.execute()
    return batch.read(out)


def test_rope_positions_errors(gpu):
    batch = bg.GpuCommandBatch(gpu)
    x = batch.upload(np.ones((3, 2, 4), np.float32), name="x")
    with pytest.raises(bg.DTypeError, match=r"rope: pos .* must be int32"):
        batch.rope(x, batch.upload(np.zeros(3, np.float32)))
    with pytest.raises(bg.ShapeError, match=r"rope: pos .* must have shape \(3,\)"):
        batch.rope(x, batch.upload(np.zeros(4, np.int32)))
    with pytest.raises(bg.ShapeError, match=r"shape \(3,\)"):
        batch.rope(x, batch.upload(np.zeros((3, 1), np.int32)))
    with pytest.raises(bg.BatchError, match="int32 Tensor of one position per token"):
        batch.rope(x, -1)
    out = batch.rope(x, batch.upload(np.array([2, 0, 1], np.int32)))
    batch.execute()
    np.testing.assert_allclose(batch.read(out), rope_float64(np.ones((3, 2, 4)), np.array([2, 0, 1])), atol=1e-6)


# scatter_rows -------------------------------------------------------------------------------------


def scatter_numpy(table: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = table.copy()
    for target, value in zip(rows, values):
        if 0 <= target < len(table):
            out[target] = value
    return out


@pytest.mark.parametrize("shape", [(13, 3, 5), (9,), (17, 33)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows(gpu, ref, shape, dtype):
    """Distinct targets in any order, skipped entries (-1, -5, the row count, past it); the other rows keep
    their values on the poisoned device."""
    rng = np.random.default_rng(220 + len(shape))
    table = random_array(rng, shape, dtype)
    count = shape[0]
    rows = np.array([7, -1, 0, count, count - 1, 2, 1000, -5], np.int32)
    values = random_array(rng, (len(rows), *shape[1:]), dtype)
    expected = scatter_numpy(table, rows, values)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        t = batch.upload(table)
        assert batch.scatter_rows(t, batch.upload(rows), batch.upload(values)) is t
        batch.execute()
        np.testing.assert_array_equal(batch.read(t), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rows_state_across_executes(gpu, ref, dtype):
    """A batch table (uploaded once) and a ``batch.empty`` one accumulate the rows of every execute."""
    rng = np.random.default_rng(230)
    table = random_array(rng, (10, 4), dtype)
    feeds = [(np.array(r, np.int32), random_array(rng, (3, 4), dtype)) for r in ([4, -1, 9], [0, 4, 20], [-1, -1, 6])]
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        t, empty = batch.upload(table), batch.empty((10, 4), dtype)
        rows, values = batch.upload(feeds[0][0]), batch.upload(feeds[0][1])
        batch.scatter_rows(t, rows, values)
        batch.scatter_rows(empty, rows, values)
        expected = table
        for step, (r, v) in enumerate(feeds):
            batch.execute({rows: r, values: v})
            expected = scatter_numpy(expected, r, v)
            np.testing.assert_array_equal(batch.read(t), expected)
            written = sorted({int(i) for rr, _ in feeds[: step + 1] for i in rr if 0 <= i < 10})
            np.testing.assert_array_equal(batch.read(empty)[written], expected[written])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32])
def test_scatter_rows_into_a_resident_table_from_two_batches(gpu, ref, dtype):
    """Two recorded batches write one resident table (a KV pool shared by a prefill and a decode step)."""
    rng = np.random.default_rng(240)
    table = random_array(rng, (12, 2, 3), dtype)
    steps = [
        (0, np.array([3, 4, -1], np.int32)),
        (1, np.array([11, -1], np.int32)),
        (0, np.array([0, 3, 12], np.int32)),
        (1, np.array([5, 6], np.int32)),
    ]
    values = [random_array(rng, (len(r), 2, 3), dtype) for _, r in steps]
    for device in (gpu, ref):
        pool = device.tensor(table)
        batches = []
        for size in (3, 2):
            batch = bg.GpuCommandBatch(device)
            rows, new = batch.upload(np.zeros(size, np.int32)), batch.upload(np.zeros((size, 2, 3), dtype))
            batch.scatter_rows(pool, rows, new)
            batches.append((batch, rows, new))
        expected = table
        for (which, r), v in zip(steps, values):
            batch, rows, new = batches[which]
            batch.execute({rows: r, new: v})
            expected = scatter_numpy(expected, r, v)
            np.testing.assert_array_equal(device.read(pool), expected)


def test_scatter_rows_errors(gpu):
    batch = bg.GpuCommandBatch(gpu)
    table = batch.upload(np.zeros((6, 4), np.float32), name="table")
    rows = batch.upload(np.array([0, 2], np.int32), name="rows")
    values = batch.upload(np.ones((2, 4), np.float32), name="values")
    with pytest.raises(bg.DTypeError, match=r"scatter_rows: rows .* must be int32"):
        batch.scatter_rows(table, batch.upload(np.array([0.0, 2.0], np.float32)), values)
    with pytest.raises(bg.ShapeError, match=r"scatter_rows: rows .* must be 1-D"):
        batch.scatter_rows(table, batch.upload(np.zeros((2, 1), np.int32)), values)
    with pytest.raises(bg.ShapeError, match=r"scatter_rows: values .* must have shape \(2, 4\)"):
        batch.scatter_rows(table, rows, batch.upload(np.ones((2, 5), np.float32)))
    with pytest.raises(bg.DTypeError, match=r"scatter_rows: values .* float16"):
        batch.scatter_rows(table, rows, batch.upload(np.ones((2, 4), np.float16)))
    with pytest.raises(bg.ArgumentError, match="scatter_rows: rows must be a Tensor, got ndarray"):
        batch.scatter_rows(table, np.array([0, 2], np.int32), values)
    with pytest.raises(bg.BatchError, match="shares its buffer"):
        batch.scatter_rows(table, rows, batch.reshape(table, (3, 8)))
    batch.scatter_rows(table, rows, values)
    batch.execute()
    np.testing.assert_array_equal(batch.read(table), [[1] * 4, [0] * 4, [1] * 4, *[[0] * 4] * 3])


# paged_attention ----------------------------------------------------------------------------------


def paged_pools(rng, keys, values, block_size: int, max_blocks: int, dtype, spare: int = 3):
    """The sequences' contiguous keys and values (lists of (length, kv_heads, head_dim) arrays) laid out in a
    pool of shuffled blocks of ``block_size`` rows, ``spare`` more blocks of other random data; block tables of
    ``max_blocks`` columns (-1 past a sequence's blocks). Returns (k_pool, v_pool, block_tables)."""
    needed = [-(-len(k) // block_size) for k in keys]
    blocks = sum(needed) + spare
    order = rng.permutation(blocks)
    shape = (blocks * block_size, *keys[0].shape[1:])
    k_pool, v_pool = random_array(rng, shape, dtype), random_array(rng, shape, dtype)
    tables = np.full((len(keys), max_blocks), -1, np.int32)
    taken = 0
    for s, (k, v) in enumerate(zip(keys, values)):
        for i in range(needed[s]):
            block = order[taken]
            taken += 1
            tables[s, i] = block
            rows = slice(i * block_size, (i + 1) * block_size)
            k_pool[block * block_size : block * block_size + len(k[rows])] = k[rows]
            v_pool[block * block_size : block * block_size + len(v[rows])] = v[rows]
    return k_pool, v_pool, tables


def attention_rows_float64(q, keys, values, seq, lengths, scale=None, window=0) -> np.ndarray:
    """Row n of q over the first lengths[n] rows of sequence seq[n]'s contiguous keys and values (with a
    ``window``, the last ``window`` of them), float64; zeros for a row with none."""
    q = q.astype(np.float64)
    out = np.zeros_like(q)
    heads, head_dim = q.shape[1:]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    for n, (s, length) in enumerate(zip(seq, lengths)):
        if length <= 0:
            continue
        group = heads // keys[s].shape[1]
        first = max(length - window, 0) if window else 0
        k = np.repeat(keys[s][first:length].astype(np.float64), group, axis=1)
        v = np.repeat(values[s][first:length].astype(np.float64), group, axis=1)
        scores = np.einsum("hd,phd->hp", q[n], k) * scale
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[n] = np.einsum("hp,phd->hd", weights / weights.sum(axis=-1, keepdims=True), v)
    return out


def paged_entries(batch: bg.GpuCommandBatch, node: int = -1) -> list[str]:
    return [launch.entry for launch in batch.nodes[node].launches]


SPLIT = ["paged_attention_partial", "attention_combine"]
SPLIT_MERGED = ["paged_attention_partial", "attention_merge", "attention_combine"]

# Rows of one call: a prefill-like chunk of sequence 0 (positions 140..144, causal: lengths 141..145) interleaved
# with decode-like rows of sequences 2, 1 and 3 and idle rows (length 0).
SEQUENCE_LENGTHS = [150, 37, 201, 9]
ROWS = [(0, 141), (2, 201), (3, 0), (0, 142), (1, 37), (0, 143), (0, 144), (0, 145), (3, 9), (1, 0)]


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("dtype", FLOATS)
def test_paged_attention_equals_contiguous_attention(gpu, ref, small_bounds, head_dim, block_size, dtype):
    """Through shuffled block tables, each row gives what the contiguous attention op gives on its sequence's
    cache at its position (GQA 6/2 heads, causal prefill rows and decode rows in one call), idle rows give
    zeros; split over blocks of 128 (head_dim 8) or 64 (head_dim 64) positions by small_bounds."""
    rng = np.random.default_rng(250 + head_dim + block_size)
    keys = [random_array(rng, (n, 2, head_dim), dtype) for n in SEQUENCE_LENGTHS]
    values = [random_array(rng, (n, 2, head_dim), dtype) for n in SEQUENCE_LENGTHS]
    max_blocks = -(-max(SEQUENCE_LENGTHS) // block_size) + 2  # unused trailing columns: -1
    k_pool, v_pool, tables = paged_pools(rng, keys, values, block_size, max_blocks, dtype)
    q = random_array(rng, (len(ROWS), 6, head_dim), dtype)
    seq = np.array([s for s, _ in ROWS], np.int32)
    lengths = np.array([n for _, n in ROWS], np.int32)
    results = {}
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        tq = batch.upload(q)
        args = [batch.upload(a) for a in (k_pool, v_pool, tables, seq, lengths)]
        paged = batch.paged_attention(tq, *args, block_size=block_size)
        assert paged_entries(batch) == SPLIT
        contiguous = []
        for n, (s, length) in enumerate(ROWS):
            if length:
                cache_k, cache_v = batch.upload(keys[s]), batch.upload(values[s])
                contiguous.append((n, batch.attention(tq[n : n + 1], cache_k, cache_v, length - 1)))
        batch.execute()
        out = results[device.kind] = batch.read(paged)
        for n, expected in contiguous:
            assert_close(out[n : n + 1], batch.read(expected), dtype, scale=10)
        idle = lengths == 0
        np.testing.assert_array_equal(out[idle], 0)
    expected = attention_rows_float64(q, keys, values, seq, lengths)
    for out in results.values():
        assert_close(out, expected.astype(dtype), dtype, scale=10)


@pytest.mark.parametrize(
    "window,block_size,table_blocks,dtype,split",
    [
        (1, 7, 30, np.float32, True),  # each row its own position only; 210 positions over blocks of 128
        (7, 1, 210, np.float16, True),  # a prime window over pool blocks of one row
        (13, 16, 14, np.float32, False),  # one pass over 224 positions
        (131, 7, 30, np.float16, True),  # a window across pool blocks and blocks of positions; short rows see all
        (1000, 16, 14, np.float32, True),  # a window longer than every sequence: all positions
    ],
)
def test_paged_attention_sliding_window(gpu, ref, request, window, block_size, table_blocks, dtype, split):
    """Each row attends over the last ``window`` positions of its sequence, through shuffled block tables,
    prefill-like and decode-like rows and idle rows in one call, in one pass and split over blocks of positions
    (``small_bounds``), against float64 and the contiguous windowed attention of each row's sequence."""
    if split:
        request.getfixturevalue("small_bounds")
    rng = np.random.default_rng(280 + window)
    keys = [random_array(rng, (n, 2, 8), dtype) for n in SEQUENCE_LENGTHS]
    values = [random_array(rng, (n, 2, 8), dtype) for n in SEQUENCE_LENGTHS]
    k_pool, v_pool, tables = paged_pools(rng, keys, values, block_size, table_blocks, dtype)
    q = random_array(rng, (len(ROWS), 6, 8), dtype)
    seq = np.array([s for s, _ in ROWS], np.int32)
    lengths = np.array([n for _, n in ROWS], np.int32)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        tq = batch.upload(q)
        args = [batch.upload(a) for a in (k_pool, v_pool, tables, seq, lengths)]
        paged = batch.paged_attention(tq, *args, block_size=block_size, window=window)
        assert paged_entries(batch) == (SPLIT if split else ["paged_attention"])
        contiguous = [
            (
                n,
                batch.attention(
                    tq[n : n + 1], batch.upload(keys[s]), batch.upload(values[s]), length - 1, window=window
                ),
            )
            for n, (s, length) in enumerate(ROWS)
            if length
        ]
        batch.execute()
        out = batch.read(paged)
        for n, expected in contiguous:
            assert_close(out[n : n + 1], batch.read(expected), dtype, scale=10)
        expected = attention_rows_float64(q, keys, values, seq, lengths, window=window)
        assert_close(out, expected.astype(dtype), dtype, scale=10)


@pytest.mark.parametrize("q_dtype,pool_dtype", [(np.float32, np.float16), (np.float16, np.float32)])
def test_paged_attention_mixed_dtypes(gpu, ref, small_bounds, q_dtype, pool_dtype):
    """Pools of another dtype than q (a float16 KV cache under float32 activations): computed in f32, the
    output in q's dtype; one pass (48 positions) and split (240)."""
    rng = np.random.default_rng(260)
    for block_size, blocks in ((4, 12), (16, 15)):
        keys = [random_array(rng, (n, 2, 16), pool_dtype) for n in (45, 20)]
        values = [random_array(rng, (n, 2, 16), pool_dtype) for n in (45, 20)]
        k_pool, v_pool, tables = paged_pools(rng, keys, values, block_size, blocks, pool_dtype)
        q = random_array(rng, (4, 4, 16), q_dtype)
        seq, lengths = np.array([0, 1, 0, 1], np.int32), np.array([45, 20, 3, 0], np.int32)
        out = check(
            gpu,
            ref,
            [q, k_pool, v_pool, tables, seq, lengths],
            lambda b, *t, block_size=block_size: b.paged_attention(*t, block_size=block_size),
            q_dtype,
            scale=10,
        )
        assert out.dtype == q_dtype
        expected = attention_rows_float64(q, keys, values, seq, lengths).astype(q_dtype)
        assert_close(out, expected, q_dtype, scale=10)


def test_paged_attention_one_pass_and_split_agree(gpu, ref, small_bounds):
    """The split count is static (from max_blocks * block_size): the same rows through a table with 15 more
    unused columns (-1) run split over blocks of positions and give the one-pass results."""
    rng = np.random.default_rng(270)
    keys = [random_array(rng, (n, 1, 8), np.float32) for n in (50, 120)]
    values = [random_array(rng, (n, 1, 8), np.float32) for n in (50, 120)]
    k_pool, v_pool, narrow = paged_pools(rng, keys, values, 8, 15, np.float32)
    wide = np.concatenate([narrow, np.full((2, 15), -1, np.int32)], axis=1)
    q = random_array(rng, (5, 3, 8), np.float32)
    seq, lengths = np.array([1, 0, 1, 0, 1], np.int32), np.array([120, 50, 1, 0, 64], np.int32)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        tq, tk, tv, ts, tl = (batch.upload(a) for a in (q, k_pool, v_pool, seq, lengths))
        one = batch.paged_attention(tq, tk, tv, batch.upload(narrow), ts, tl, block_size=8)
        split = batch.paged_attention(tq, tk, tv, batch.upload(wide), ts, tl, block_size=8)
        assert paged_entries(batch, -2) == ["paged_attention"] and paged_entries(batch) == SPLIT
        batch.execute()
        assert_close(batch.read(split), batch.read(one), np.float32, scale=4)
        expected = attention_rows_float64(q, keys, values, seq, lengths).astype(np.float32)
        assert_close(batch.read(one), expected, np.float32, scale=10)


@pytest.mark.parametrize("split", [False, True])
def test_paged_attention_edges(gpu, ref, request, split):
    """What the reference defines: a sequence outside the table's rows, a length <= 0, or no position left
    give zeros; lengths past max_blocks * block_size are clamped; positions whose block lies outside the pool
    (negative, past the last block, or the rows of a partial last block past the pool) are left out."""
    if split:
        request.getfixturevalue("small_bounds")  # blocks of 128 positions: 3 splits
    rng = np.random.default_rng(280)
    block_size, pool_rows = 5, 62  # 13 blocks, the last holding 2 rows
    k_pool = random_array(rng, (pool_rows, 2, 8), np.float32)
    v_pool = random_array(rng, (pool_rows, 2, 8), np.float32)
    tables = np.array(
        [
            [3, 0, 7, 1, 2],  # all in the pool
            [12, 4, -1, 9, 13],  # block 12: rows 60, 61 only; -1 and 13 (past the pool) left out
            [-1, -7, 13, 858993460, -1],  # none in the pool (858993460 * 5 wraps to row 4 in 32 bits)
        ],
        np.int32,
    )
    if split:
        tables = np.concatenate([tables, np.full((3, 55), -1, np.int32)], axis=1)  # 300 positions
    rows = [(0, 25), (0, 1000), (1, 25), (1, 2), (1, 13), (2, 20), (-1, 10), (3, 10), (0, -4), (0, 0)]
    q = random_array(rng, (len(rows), 4, 8), np.float32)
    seq, lengths = (np.array(column, np.int32) for column in zip(*rows))

    def build(b, *t):
        return b.paged_attention(*t, block_size=block_size)

    out = check(gpu, ref, [q, k_pool, v_pool, tables, seq, lengths], build, np.float32, scale=10)
    first = np.concatenate([np.arange(b * 5, b * 5 + 5) for b in (3, 0, 7, 1, 2)])
    second = np.array([60, 61, 20, 21, 22, 23, 24, 45, 46, 47, 48, 49])  # positions 0-1, 5-9, 15-19
    caches = [(k_pool[first], v_pool[first]), (k_pool[second], v_pool[second])]
    cases = [(0, 25), (0, 25), (1, 12), (1, 2), (1, 7)]  # valid rows each of the first five rows attends over
    expected = np.zeros(q.shape)
    expected[:5] = attention_rows_float64(
        q[:5], [caches[s][0] for s, _ in cases], [caches[s][1] for s, _ in cases], range(5), [n for _, n in cases]
    )
    assert_close(out, expected.astype(np.float32), np.float32, scale=10)
    np.testing.assert_array_equal(out[5:], 0)


@pytest.mark.parametrize("split", [False, True])
def test_paged_attention_scale(gpu, ref, request, split):
    """scale=0.0 means 0.0: each row gets the mean of its positions' value rows; an explicit scale is used."""
    if split:
        request.getfixturevalue("small_bounds")
    rng = np.random.default_rng(290)
    keys = [random_array(rng, (90, 2, 8), np.float32)]
    values = [random_array(rng, (90, 2, 8), np.float32)]
    k_pool, v_pool, tables = paged_pools(rng, keys, values, 6, 25, np.float32)  # 150 positions
    q = random_array(rng, (3, 4, 8), np.float32)
    seq, lengths = np.zeros(3, np.int32), np.array([90, 7, 1], np.int32)
    arrays = [q, k_pool, v_pool, tables, seq, lengths]
    out = check(gpu, ref, arrays, lambda b, *t: b.paged_attention(*t, block_size=6, scale=0.0), np.float32, 4)
    for n, length in enumerate(lengths):
        means = values[0][:length].astype(np.float64).mean(axis=0)
        assert_close(out[n], np.repeat(means, 2, axis=0).astype(np.float32), scale=10)
    out = check(gpu, ref, arrays, lambda b, *t: b.paged_attention(*t, block_size=6, scale=0.3), np.float32, 10)
    expected = attention_rows_float64(q, keys, values, seq, lengths, scale=np.float32(0.3))
    assert_close(out, expected.astype(np.float32), scale=10)


def test_paged_attention_errors(gpu):
    """Record-time refusals naming the op and the argument; the batch still runs a correct call after them."""
    batch = bg.GpuCommandBatch(gpu)

    def up(shape, dtype=np.float32, name=""):
        return batch.upload(np.ones(shape, dtype), name=name)

    q, k, v = up((3, 4, 8), name="q"), up((20, 2, 8), name="k"), up((20, 2, 8), name="v")
    tables, seq, lengths = up((2, 5), np.int32, "tables"), up(3, np.int32, "seq"), up(3, np.int32, "lengths")
    good = (q, k, v, tables, seq, lengths)

    def refused(error, pattern, *args, **kwargs):
        arguments = [*good]
        for i, value in enumerate(args):
            if value is not None:
                arguments[i] = value
        with pytest.raises(error, match=pattern):
            batch.paged_attention(*arguments, **{"block_size": 4, **kwargs})

    refused(bg.DTypeError, "paged_attention: q .* int32", up((3, 4, 8), np.int32))
    refused(bg.DTypeError, "paged_attention: k_pool .* int32", None, up((20, 2, 8), np.int32))
    refused(bg.DTypeError, "v_pool .* float16, but k_pool has float32", None, None, up((20, 2, 8), np.float16))
    refused(bg.ShapeError, "k_pool .* and v_pool .* one shape", None, None, up((21, 2, 8)))
    refused(bg.ShapeError, "3 query heads .* not a multiple of 2", up((3, 3, 8)))
    refused(bg.ShapeError, "head_dim of q", up((3, 4, 6)))
    refused(bg.ShapeError, "must be 3-D", None, up((20, 16)))
    refused(bg.DTypeError, "block_tables .* must be int32", None, None, None, up((2, 5)))
    refused(bg.ShapeError, "block_tables .* must be 2-D", None, None, None, up(10, np.int32))
    refused(bg.DTypeError, "seq .* must be int32", None, None, None, None, up(3))
    refused(bg.ShapeError, r"lengths .* must have shape \(3,\)", None, None, None, None, None, up(4, np.int32))
    refused(bg.ArgumentError, "seq must be a Tensor, got ndarray", None, None, None, None, np.zeros(3, np.int32))
    for block_size in (0, -3, 1.5, True, "4"):
        refused(bg.ArgumentError, "block_size must be an int >= 1", block_size=block_size)
    refused(bg.LimitError, r"at most 2\*\*31 - 1", block_size=2**30)
    for scale in (float("nan"), float("inf"), 1e39):
        refused(bg.BatchError, "paged_attention: scale must be a finite f32", scale=scale)
    refused(bg.LimitError, "head_dim 3970 .* exceeds 3968", up((1, 1, 3970)), up((2, 1, 3970)), up((2, 1, 3970)))
    quantized = gpu.quantized(np.zeros(20 * 2 * 34, np.uint8), "q8_0", (20, 64))
    refused(bg.DTypeError, "packed q8_0 blocks", None, quantized)
    out = batch.paged_attention(*good, block_size=4)
    batch.execute(
        {tables: np.array([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]], np.int32), lengths: np.array([3, 20, 0], np.int32)}
    )
    result = batch.read(out)
    np.testing.assert_allclose(result[:2], 1, rtol=1e-6)  # ones attended: ones
    np.testing.assert_array_equal(result[2], 0)


# long contexts: SmolLM2's 8192 positions and past llvmpipe's per-invocation loop cap ------------------------


def long_context_case(seed: int, heads: int, kv_heads: int, head_dim: int, block_size: int, lengths, dtype):
    rng = np.random.default_rng(seed)
    longest = max(max(lengths), 1)
    keys = [random_array(rng, (longest, kv_heads, head_dim), dtype)]
    values = [random_array(rng, (longest, kv_heads, head_dim), dtype)]
    k_pool, v_pool, tables = paged_pools(rng, keys, values, block_size, -(-longest // block_size), dtype, spare=1)
    q = random_array(rng, (len(lengths), heads, head_dim), np.float32)
    seq, lengths = np.zeros(len(lengths), np.int32), np.array(lengths, np.int32)
    expected = attention_rows_float64(q, keys, values, seq, lengths)
    return [q, k_pool, v_pool, tables, seq, lengths], expected


@pytest.mark.parametrize("pool_dtype", FLOATS)
def test_paged_attention_long_context(gpu, ref, pool_dtype):
    """SmolLM2's shape (9 query heads over 3 kv heads of 64) up to its trained context: rows at 8192, 8191,
    6000, 4097, 2049, 2048, 100 and 1 positions (blocks of 2048 positions: 4 splits) and an idle row, against
    float64 numpy over the contiguous cache."""
    lengths = [8192, 8191, 6000, 4097, 2049, 2048, 100, 1, 0]
    arrays, expected = long_context_case(300, 9, 3, 64, 16, lengths, pool_dtype)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        out = batch.paged_attention(*(batch.upload(a) for a in arrays), block_size=16)
        assert paged_entries(batch) == SPLIT
        batch.execute()
        assert_close(batch.read(out), expected.astype(np.float32), np.float32, scale=10)


@pytest.mark.parametrize(
    "positions,head_dim,block_size,heads,kv_heads",
    [
        (7000, 512, 16, 2, 1),  # a 512-long dot product and weighted sum per position: 7.3M iterations in one pass
        (70000, 8, 1, 4, 2),  # 70,000 positions, blocks of one row: 35 splits of 2048
    ],
)
def test_paged_attention_past_loop_cap(gpu, positions, head_dim, block_size, heads, kv_heads):
    """Contexts whose one-pass kernel would pass llvmpipe's 65,535 loop iterations per invocation (wrong numbers,
    no error): split over blocks of positions."""
    lengths = [positions, positions - 1, positions // 2 + 3, 1]
    arrays, expected = long_context_case(310, heads, kv_heads, head_dim, block_size, lengths, np.float32)
    batch = bg.GpuCommandBatch(gpu)
    out = batch.paged_attention(*(batch.upload(a) for a in arrays), block_size=block_size)
    assert paged_entries(batch)[0] == "paged_attention_partial"
    batch.execute()
    assert_close(batch.read(out), expected.astype(np.float32), np.float32, scale=10)


def test_paged_attention_blocks_fit_the_loop_budget(ref):
    """The paged kernels run attention_partial's loops (a block-table read per position adds no loop), over
    split_rows(head_dim) positions per workgroup; their CUDA twins' static scores fit ROWS_SHARED."""
    from batchgpu.ops import attention, bounds

    for head_dim in (1, 8, 64, 128, 512, attention.largest_head_dim()):
        rows = attention.split_rows(head_dim)
        assert attention._rows_loops(rows, head_dim) <= bounds.LOOP_BUDGET
        assert rows + head_dim <= attention.ROWS_SHARED
    for max_blocks, entries in ((128, ["paged_attention"]), (129, SPLIT), (8192, SPLIT)):
        batch = bg.GpuCommandBatch(ref)
        pool = batch.empty((4096, 3, 64))
        tables = batch.empty((2, max_blocks), np.int32)
        ids = batch.empty(5, np.int32)
        batch.paged_attention(batch.empty((5, 9, 64)), pool, pool, tables, ids, ids, block_size=16)
        assert paged_entries(batch) == entries
        if max_blocks == 8192:  # 131,072 positions: 64 partials per (row, head), one combine
            assert batch.nodes[-1].launches[0].groups == 5 * 9 * 64


# the serving engine's use: one recorded decode step and one prefill step over shared resident pools ---------


@pytest.mark.parametrize("pool_dtype", FLOATS)
def test_prefill_and_decode_steps_share_resident_pools(gpu, ref, pool_dtype):
    """Two recorded batches, as batchgpu.llm records them (rope at per-row positions, scatter_rows of the new
    keys and values into resident pools, paged_attention with lengths = position + 1), executed in turn over
    shuffled blocks of 4 rows: prompts of 6 and 3 tokens in chunks of 4 rows (padding rows idle), then decode
    steps of 3 slots (one idle). Each step against float64 numpy over contiguous per-sequence caches."""
    rng = np.random.default_rng(320)
    heads, kv_heads, head_dim, block_size, max_blocks = 4, 2, 16, 4, 5
    order = [int(b) for b in rng.permutation(12)]
    tables = np.full((2, max_blocks), -1, np.int32)
    kv_rows = {}  # (sequence, position) -> pool row

    def row_of(s: int, position: int) -> int:
        if (s, position) not in kv_rows:
            if position % block_size == 0:
                tables[s, position // block_size] = order.pop()
            kv_rows[s, position] = int(tables[s, position // block_size]) * block_size + position % block_size
        return kv_rows[s, position]

    # steps: (which batch, [(sequence, position) or None for an idle row])
    schedule = [
        ("prefill", [(0, 0), (0, 1), (0, 2), (0, 3)]),
        ("prefill", [(0, 4), (0, 5), None, None]),
        ("prefill", [(1, 0), (1, 1), (1, 2), None]),
        ("decode", [(0, 6), None, (1, 3)]),
        ("decode", [(0, 7), None, (1, 4)]),
        ("decode", [(0, 8), (1, 5), None]),
    ]
    data = [
        [random_array(rng, (len(rows), count, head_dim), np.float32) for count in (heads, kv_heads, kv_heads)]
        for _, rows in schedule
    ]
    feeds = []
    for (_, rows), _ in zip(schedule, data):
        positions = np.array([p for _, p in (r or (0, 0) for r in rows)], np.int32)
        targets = np.array([row_of(*r) if r else -1 for r in rows], np.int32)
        seq = np.array([r[0] if r else 0 for r in rows], np.int32)
        lengths = np.array([r[1] + 1 if r else 0 for r in rows], np.int32)
        feeds.append((positions, targets, seq, lengths, tables.copy()))
    # float64 expectation: rope, then attention over each sequence's rows so far
    caches: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {0: [], 1: []}
    expected = []
    for (_, rows), (q, k, v), (positions, _, _, _, _) in zip(schedule, data, feeds):
        q, k = rope_float64(q, positions), rope_float64(k, positions)
        for n, r in enumerate(rows):
            if r:
                stored = (k[n].astype(np.float32), v[n])
                if pool_dtype == np.float16:
                    stored = tuple(a.astype(np.float16) for a in stored)
                caches[r[0]].append(stored)
        out = np.zeros(q.shape)
        for n, r in enumerate(rows):
            if r:
                keys = np.stack([c[0] for c in caches[r[0]][: r[1] + 1]])
                values = np.stack([c[1] for c in caches[r[0]][: r[1] + 1]])
                out[n] = attention_rows_float64(q[n : n + 1], [keys], [values], [0], [r[1] + 1])[0]
        expected.append(out)
    for device in (gpu, ref):
        pools = [device.tensor(np.zeros((12 * block_size, kv_heads, head_dim), pool_dtype)) for _ in range(2)]
        steps = {}
        for name, size in (("prefill", 4), ("decode", 3)):
            batch = bg.GpuCommandBatch(device, name=name)
            inputs = {
                "q": batch.upload(np.zeros((size, heads, head_dim), np.float32)),
                "k": batch.upload(np.zeros((size, kv_heads, head_dim), np.float32)),
                "v": batch.upload(np.zeros((size, kv_heads, head_dim), np.float32)),
                "positions": batch.upload(np.zeros(size, np.int32)),
                "kv_rows": batch.upload(np.zeros(size, np.int32)),
                "seq": batch.upload(np.zeros(size, np.int32)),
                "lengths": batch.upload(np.zeros(size, np.int32)),
                "tables": batch.upload(np.zeros((2, max_blocks), np.int32)),
            }
            q = batch.rope(inputs["q"], inputs["positions"])
            k = batch.rope(inputs["k"], inputs["positions"])
            v = inputs["v"]
            if pool_dtype == np.float16:
                k, v = batch.cast(k, pool_dtype), batch.cast(v, pool_dtype)
            batch.scatter_rows(pools[0], inputs["kv_rows"], k)
            batch.scatter_rows(pools[1], inputs["kv_rows"], v)
            args = (inputs["tables"], inputs["seq"], inputs["lengths"])
            out = batch.paged_attention(q, pools[0], pools[1], *args, block_size=block_size)
            batch.outputs(out)
            steps[name] = (batch, inputs, out)
        for step, ((name, _), (q, k, v), feed) in enumerate(zip(schedule, data, feeds)):
            batch, inputs, out = steps[name]
            names = ("q", "k", "v", "positions", "kv_rows", "seq", "lengths", "tables")
            batch.execute({inputs[key]: value for key, value in zip(names, (q, k, v, *feed))})
            tolerance = np.float16 if pool_dtype == np.float16 else np.float32
            assert_close(batch.read(out), expected[step].astype(np.float32), tolerance, scale=10)
