"""On-device token sampling (batchgpu/ops/sampling.py): penalize against a float64 formula, count_tokens
(duplicates, skips, resets, state across executes), sample (greedy = argmax with its NaN rule, reproducible
draws, top_k / top_p / min_p sets checked against an independent float64 definition by sorting, chi-square
tests of the drawn distribution) on wgpu and the reference; tests taking ``gpu`` also run on the CUDA kernels
(tests/test_cuda_kernels_cpu.py) and native GPUs through conftest.DEVICE_SUITES."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import ArgumentError, DTypeError, LimitError, ShapeError
from batchgpu.ops import sampling

from .conftest import TOLERANCES

VOCABS = [1, 7, 1000, 1009, 49152]  # 1009: prime; 49152: SmolLM2


def run_sample(device, logits, params, top_k, keys) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    arrays = (logits, np.asarray(params, np.float32), np.asarray(top_k, np.int32), np.asarray(keys, np.uint32))
    out = batch.sample(*(batch.upload(a) for a in arrays))
    batch.execute()
    return batch.read(out)


def settings(rows: int, temperature=1.0, top_p=1.0, min_p=0.0) -> np.ndarray:
    return np.tile(np.array([temperature, top_p, min_p, 0.0], np.float32), (rows, 1))


def counters(rows: int, seed: int = 1, first: int = 0) -> np.ndarray:
    return np.stack([np.full(rows, seed), np.arange(first, first + rows)], axis=1).astype(np.uint32)


def allowed_set(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The allowed set of one row of z by the definition, in vLLM's order, with sorting and float64 masses
    (independent of the kernels' search): min_p and top_k on softmax(z), then top_p on the distribution
    they leave, renormalized; and softmax(z) in float64."""
    z64 = z.astype(np.float64)
    p = np.exp(z64 - z64.max())
    p /= p.sum()
    allowed = np.ones(z.size, bool)
    if min_p > 0:
        allowed &= p >= min_p * p.max()
    if 0 < top_k < z.size:
        allowed &= z >= np.sort(z)[::-1][top_k - 1]
    allowed |= z == z.max()
    if top_p < 1:
        kept = np.where(allowed, p, 0.0)
        order = np.argsort(-z64, kind="stable")
        last = min(int(np.searchsorted(np.cumsum(kept[order]) / kept.sum(), top_p)), z.size - 1)
        allowed &= z >= z[order[last]]
    return allowed, p


def intersection_set(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The allowed set of the intersection rule (top_p measured on the whole softmax, then intersected
    with top_k and min_p): what the sampler drew from before it followed vLLM's order."""
    by_p, _ = allowed_set(z, 0, top_p, 0.0)
    by_k_and_min_p, _ = allowed_set(z, top_k, 1.0, min_p)
    return by_p & by_k_and_min_p


def top_p_margin(z: np.ndarray, top_p: float, top_k: int = 0, min_p: float = 0.0) -> float:
    """How far top_p is from the cumulative masses of the sorted row left by top_k and min_p, renormalized
    (a draw set is only well defined across float32 executors when top_p is not at one of them)."""
    kept, p = allowed_set(z, top_k, 1.0, min_p)
    masses = np.sort(p[kept])[::-1]
    return float(np.min(np.abs(np.cumsum(masses / masses.sum()) - top_p)))


# penalize --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sampling_penalize_matches_float64_formula(gpu, ref, vocab, dtype):
    rng = np.random.default_rng(vocab)
    rows = 3
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(dtype)
    seen = rng.integers(0, 3, (rows, vocab)).astype(np.int32)
    generated = np.minimum(seen, rng.integers(0, 3, (rows, vocab))).astype(np.int32)
    penalties = np.stack(
        [rng.uniform(0.5, 2.0, rows), rng.uniform(-1, 1, rows), rng.uniform(-0.5, 0.5, rows)], axis=1
    ).astype(np.float32)
    penalties[0] = (1.0, 0.0, 0.0)  # no penalty: unchanged logits
    x = logits.astype(np.float64)
    r, presence, frequency = (penalties[:, j : j + 1].astype(np.float64) for j in range(3))
    expected = np.where(seen > 0, np.where(x > 0, x / r, x * r), x)
    expected -= presence * (generated > 0) + frequency * generated
    arrays = (logits, seen, generated, penalties)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        out = batch.penalize(*(batch.upload(a) for a in arrays))
        batch.execute()
        result = batch.read(out)
        assert result.dtype == dtype and result.shape == (rows, vocab)
        np.testing.assert_allclose(result.astype(np.float64), expected, **TOLERANCES[np.dtype(dtype)])
        np.testing.assert_array_equal(result[0], logits[0])


# count_tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 7, 1000])
def test_sampling_count_tokens_duplicates_skips_resets_and_state(gpu, vocab):
    """A resident counts tensor shared by two batches (a prompt batch with resets, a decode batch):
    duplicates add up, out-of-range slots and ids are skipped, resets zero their rows first, and the
    counts carry from one execute to the next."""
    rng = np.random.default_rng(vocab + 5)
    rows, n = 5, 23
    expected = rng.integers(0, 4, (rows, vocab)).astype(np.int32)
    counts = gpu.tensor(expected.copy())
    prompt, decode = bg.GpuCommandBatch(gpu, name="prompt"), bg.GpuCommandBatch(gpu, name="decode")
    feeds = {}
    for batch, size in ((prompt, n), (decode, rows)):
        slots, ids = batch.upload(np.zeros(size, np.int32)), batch.upload(np.zeros(size, np.int32))
        reset = batch.upload(np.zeros(rows, np.int32))
        assert batch.count_tokens(counts, slots, ids, reset) is counts
        feeds[batch] = (slots, ids, reset)
    for step in range(4):
        batch = prompt if step % 2 == 0 else decode
        slots_t, ids_t, reset_t = feeds[batch]
        size = slots_t.shape[0]
        slots = rng.integers(-1, rows + 1, size).astype(np.int32)
        ids = rng.integers(-1, vocab + 1, size).astype(np.int32)
        ids[: size // 2] = ids[0]  # duplicates
        slots[: size // 2] = slots[1] if slots[1] >= 0 else 0
        reset = (rng.random(rows) < 0.4).astype(np.int32) * (step + 1) if batch is prompt else np.zeros(rows, np.int32)
        batch.execute({slots_t: slots, ids_t: ids, reset_t: reset})
        expected[reset != 0] = 0
        valid = (slots >= 0) & (slots < rows) & (ids >= 0) & (ids < vocab)
        np.add.at(expected, (slots[valid], ids[valid]), 1)
        np.testing.assert_array_equal(gpu.read(counts), expected)


def test_sampling_count_tokens_without_reset_only_adds(gpu, ref):
    rng = np.random.default_rng(8)
    start = rng.integers(1, 9, (3, 517)).astype(np.int32)
    slots, ids = rng.integers(-1, 4, 41).astype(np.int32), rng.integers(-3, 520, 41).astype(np.int32)
    expected = start.copy()
    valid = (slots >= 0) & (slots < 3) & (ids >= 0) & (ids < 517)
    np.add.at(expected, (slots[valid], ids[valid]), 1)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        counts = device.tensor(start)
        batch.count_tokens(counts, batch.upload(slots), batch.upload(ids))
        batch.execute()
        np.testing.assert_array_equal(device.read(counts), expected)


def test_sampling_count_tokens_on_a_batch_tensor(gpu, ref):
    rng = np.random.default_rng(6)
    start = rng.integers(0, 9, (4, 1009)).astype(np.int32)
    slots, ids = rng.integers(-2, 6, 300).astype(np.int32), rng.integers(-5, 1015, 300).astype(np.int32)
    reset = np.array([1, 0, 0, 1], np.int32)
    results = []
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        counts = batch.upload(start)
        batch.count_tokens(counts, *(batch.upload(a) for a in (slots, ids, reset)))
        batch.execute()
        batch.execute()  # the batch tensor keeps its device value: counted twice, rows 0 and 3 reset each time
        results.append(batch.read(counts))
    expected = start.copy()
    valid = (slots >= 0) & (slots < 4) & (ids >= 0) & (ids < 1009)
    for _ in range(2):
        expected[reset != 0] = 0
        np.add.at(expected, (slots[valid], ids[valid]), 1)
    np.testing.assert_array_equal(results[0], expected)
    np.testing.assert_array_equal(results[1], expected)


# sample: greedy and the reference --------------------------------------------------------------


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sample_greedy_is_argmax_nan_first(gpu, ref, vocab, dtype):
    """Temperature <= 0 (and NaN) is argmax's rule: the first maximum, the first NaN where there is one;
    sampling rows whose maximum is not finite (NaN, +inf, all -inf) take the greedy id too."""
    rng = np.random.default_rng(vocab + 11)
    rows = 8
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(dtype)
    logits[1, vocab // 2 :] = logits[1].max()  # ties: the first maximum
    logits[2, vocab // 3] = np.nan
    logits[2, -1] = np.nan
    logits[3, vocab // 2] = np.inf
    logits[4] = -np.inf
    logits[5, -1] = np.nan
    params = settings(rows, temperature=0.0)
    params[1, 0], params[6, 0], params[7, 0] = -1.0, np.nan, 0.0
    params[2:6, 0] = 1.0  # sampling rows whose maximum is not finite
    top_k = rng.integers(-1, 3, rows)
    expected = np.argmax(logits.astype(np.float32), axis=1)
    for device in (gpu, ref):
        ids = run_sample(device, logits, params, top_k, counters(rows))
        assert ids.dtype == np.int32
        np.testing.assert_array_equal(ids, expected)


@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_matches_the_reference(gpu, ref, vocab):
    """Mixed rows (temperatures, top_k, top_p, min_p, greedy) draw the same ids as the numpy reference
    (random logits: float32 near-ties between executors have a negligible chance), and the drawn ids lie
    in the allowed sets."""
    rng = np.random.default_rng(vocab + 17)
    rows = 12
    logits = (rng.standard_normal((rows, vocab)) * 2.5).astype(np.float32)
    params = np.stack(
        [rng.uniform(0.3, 1.8, rows), rng.choice([1.0, 0.95, 0.8, 0.5], rows), rng.choice([0.0, 0.02, 0.2], rows)],
        axis=1,
    )
    params = np.concatenate([params, np.zeros((rows, 1))], axis=1).astype(np.float32)
    params[0, 0] = 0.0
    top_k = rng.choice([0, 1, 3, 40, vocab, vocab + 5, -1], rows).astype(np.int32)
    keys = counters(rows, seed=vocab)
    expected = sampling.sample_reference(logits, params, top_k, keys)
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_sample(device, logits, params, top_k, keys), expected)
    for row in range(1, rows):
        z = logits[row] / params[row, 0]
        allowed, _ = allowed_set(z, int(top_k[row]), float(params[row, 1]), float(params[row, 2]))
        assert allowed[expected[row]], row


def test_sample_float16_logits(gpu, ref):
    rng = np.random.default_rng(19)
    logits = (rng.standard_normal((6, 333)) * 3).astype(np.float16)
    params, top_k, keys = settings(6, 0.9, 0.9, 0.01), np.array([0, 5, 0, 50, 0, 2], np.int32), counters(6)
    expected = sampling.sample_reference(logits.astype(np.float32), params, top_k, keys)
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_sample(device, logits, params, top_k, keys), expected)


def test_sample_largest_vocab(gpu, ref):
    """Rows of MAX_VOCAB tokens, one workgroup each: every pass stays within the loop budget (the last row
    runs both searches, top_k's then top_p's)."""
    rng = np.random.default_rng(23)
    logits = (rng.standard_normal((2, sampling.MAX_VOCAB)) * 2).astype(np.float32)
    params = np.array([[0.0, 1.0, 0.0, 0.0], [1.0, 0.9, 0.01, 0.0], [1.0, 0.5, 0.0, 0.0]], np.float32)
    logits = np.concatenate([logits, logits[1:]])
    top_k, keys = np.array([0, 100, 20000], np.int32), counters(3)
    expected = sampling.sample_reference(logits, params, top_k, keys)
    assert expected[0] == np.argmax(logits[0])
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_sample(device, logits, params, top_k, keys), expected)


# sample: reproducibility and the filters -------------------------------------------------------


def test_sample_draws_are_reproducible_and_keyed(gpu):
    """The same (seed, counter) draws the same id, in this batch, a re-execute and another batch; other
    counters or seeds draw independently (flat logits: 1000 equally likely ids)."""
    rows = 64
    logits = np.zeros((rows, 1000), np.float32)
    keys = np.tile(np.array([[5, 9]], np.uint32), (rows, 1))
    same = run_sample(gpu, logits, settings(rows), np.zeros(rows, np.int32), keys)
    assert (same == same[0]).all()
    first = run_sample(gpu, logits, settings(rows), np.zeros(rows, np.int32), counters(rows, seed=5))
    again = run_sample(gpu, logits, settings(rows), np.zeros(rows, np.int32), counters(rows, seed=5))
    other_seed = run_sample(gpu, logits, settings(rows), np.zeros(rows, np.int32), counters(rows, seed=6))
    np.testing.assert_array_equal(first, again)
    assert first[9] == same[0]
    assert len(set(first.tolist())) > 50 and (first != other_seed).mean() > 0.9
    batch = bg.GpuCommandBatch(gpu)
    key_t = batch.upload(counters(rows, seed=5))
    out = batch.sample(
        batch.upload(logits), batch.upload(settings(rows)), batch.upload(np.zeros(rows, np.int32)), key_t
    )
    draws = []
    for first_counter in (0, rows, 0):
        batch.execute({key_t: counters(rows, seed=5, first=first_counter)})
        draws.append(batch.read(out))
    np.testing.assert_array_equal(draws[0], first)
    np.testing.assert_array_equal(draws[2], first)
    assert (draws[1] != draws[0]).mean() > 0.9


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_sample_filters_that_keep_only_the_maximum(gpu, vocab):
    """top_k = 1, a tiny top_p (and top_p <= 0) and min_p = 1 leave only the maximum: greedy draws."""
    rng = np.random.default_rng(vocab + 29)
    rows = 16
    logits = rng.permutation(np.linspace(-6, 6, vocab)).astype(np.float32)[None, :].repeat(rows, 0)
    logits += rng.standard_normal((rows, 1)).astype(np.float32)
    greedy = np.argmax(logits, axis=1)
    cases = [
        (settings(rows, 1.5), np.ones(rows)),
        (settings(rows, 1.0, top_p=1e-6), np.zeros(rows)),
        (settings(rows, 2.0, top_p=0.0), np.zeros(rows)),
        (settings(rows, 0.8, min_p=1.0), np.zeros(rows)),
    ]
    for params, top_k in cases:
        ids = run_sample(gpu, logits, params, top_k, counters(rows, seed=vocab))
        np.testing.assert_array_equal(ids, greedy)


def test_sample_top_k_includes_ties_with_the_kth(gpu, ref):
    """Logits 5, 4, 4, 4, then lower: top_k = 2 allows the maximum and every 4 (ties with the 2nd)."""
    rows = 400
    logits = np.array([[1.0, 4.0, 0.0, 5.0, 4.0, 2.0, 4.0, -1.0, 3.0]] * rows, np.float32)
    for device in (gpu, ref):
        ids = run_sample(device, logits, settings(rows), np.full(rows, 2, np.int32), counters(rows, seed=3))
        assert set(ids.tolist()) == {1, 3, 4, 6}


@pytest.mark.parametrize("vocab", [7, 1000, 1009])
def test_sample_draws_stay_in_the_allowed_set(gpu, vocab):
    """Many draws (rows x executes, other counters each time) under top_k, top_p and min_p never leave
    the allowed set of the definition (sorting, float64), and reach more than one element of it (where
    it has more)."""
    rng = np.random.default_rng(vocab + 31)
    z = rng.permutation(np.linspace(-4, 4, vocab)).astype(np.float32)  # well apart: no near-ties
    configs = [(0, 0.7, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.3), (12, 0.9, 0.05)]
    rows = 100
    draws = 1000 if gpu.kind != "cuda-cpu" else 300
    for top_k, top_p, min_p in configs:
        assert top_p == 1 or top_p_margin(z, top_p, top_k, min_p) > 1e-4
        allowed, _ = allowed_set(z, top_k, top_p, min_p)
        batch = bg.GpuCommandBatch(gpu)
        keys = batch.upload(counters(rows, seed=vocab))
        params = batch.upload(settings(rows, 1.0, top_p, min_p))
        out = batch.sample(
            batch.upload(np.tile(z, (rows, 1))), params, batch.upload(np.full(rows, top_k, np.int32)), keys
        )
        seen = np.zeros(vocab, np.int64)
        for first in range(0, draws, rows):
            batch.execute({keys: counters(rows, seed=vocab, first=first)})
            np.add.at(seen, batch.read(out), 1)
        assert seen[~allowed].sum() == 0, (top_k, top_p, min_p, np.flatnonzero(seen * ~allowed))
        assert (seen > 0).sum() >= min(2, allowed.sum())


VLLM_ORDER_CASES = {  # (top_k, top_p, min_p): masses 0.3, 0.2, 0.1 then 0.4 spread over the rest of the row
    "top_k then top_p": (3, 0.7, 0.0),
    "min_p then top_p": (0, 0.7, 0.3),
    "min_p, top_k, then top_p": (3, 0.7, 0.3),
}


@pytest.mark.parametrize("case", sorted(VLLM_ORDER_CASES))
def test_sample_top_p_is_measured_after_top_k_and_min_p(gpu, ref, case):
    """vLLM's order: min_p and top_k leave 0.3, 0.2, 0.1 of the mass (ids 0, 1, 2), renormalized to 1/2,
    1/3, 1/6, then top_p = 0.7 keeps ids 0 and 1 (1/2 + 1/3 >= 0.7). Measured on the whole row, top_p would
    need far more than three tokens and its intersection with them would keep id 2 too (drawn 1/6 of the
    time): it is never drawn, and 0 and 1 are drawn in about their 3:2 ratio."""
    top_k, top_p, min_p = VLLM_ORDER_CASES[case]
    vocab = 1009
    rest = np.random.default_rng(53).uniform(0.5, 1.5, vocab - 3)
    probabilities = np.concatenate([[0.3, 0.2, 0.1], 0.4 * rest / rest.sum()])
    z = np.log(probabilities).astype(np.float32)
    allowed, _ = allowed_set(z, top_k, top_p, min_p)
    assert np.flatnonzero(allowed).tolist() == [0, 1]
    assert intersection_set(z, top_k, top_p, min_p)[2]  # the rule the sampler left
    rows = 600
    logits, params = np.tile(z, (rows, 1)), settings(rows, 1.0, top_p, min_p)
    keys, top_ks = counters(rows, seed=71), np.full(rows, top_k, np.int32)
    expected = sampling.sample_reference(logits, params, top_ks, keys)
    drawn = np.bincount(expected, minlength=vocab)
    assert drawn[2:].sum() == 0 and 0.5 < drawn[1] / drawn[0] < 0.85, drawn[:3]
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_sample(device, logits, params, top_ks, keys), expected)


@pytest.mark.parametrize("vocab", [11, 1009, 65537])  # 65537: one past a 256 x 256 row chunk
def test_sample_random_rows_where_the_orders_differ(gpu, ref, vocab):
    """Random logits, each row with a top_k and a top_p between the renormalized masses of the top_k set's
    last two prefixes (and a min_p on some rows), where top_p after top_k keeps one token less than the
    intersection would. The executors draw the reference's ids, every id in vLLM's set. Exact on every
    executor: top_p is over 1e-4 from the renormalized cumulative masses (asserted), far more than float32
    exp and division can differ between drivers (a few ulp), and random logits have no near-ties."""
    rng = np.random.default_rng(vocab + 59)
    rows = 24
    logits = (rng.standard_normal((rows, vocab)) * 1.5).astype(np.float32)
    temperature = rng.uniform(0.6, 1.4, rows).astype(np.float32)
    min_ps = rng.choice([0.0, 1e-4], rows).astype(np.float32)
    top_k, top_ps = np.zeros(rows, np.int32), np.zeros(rows, np.float32)
    for row in range(rows):
        z = logits[row] / temperature[row]
        p = np.sort(np.exp(z.astype(np.float64) - z.max()))[::-1]
        for k in range(3, min(vocab, 64)):
            kept = np.cumsum(p[:k]) / p[:k].sum()
            top_k[row], top_ps[row] = k, (kept[k - 3] + kept[k - 2]) / 2
            allowed, _ = allowed_set(z, k, float(top_ps[row]), float(min_ps[row]))
            if (allowed < intersection_set(z, k, float(top_ps[row]), float(min_ps[row]))).any():
                break
        else:
            raise AssertionError(f"row {row}: no top_k where the orders differ")
        assert top_p_margin(z, float(top_ps[row]), k, float(min_ps[row])) > 1e-4
    params = np.stack([temperature, top_ps, min_ps, np.zeros(rows)], axis=1).astype(np.float32)
    repeats = 4 if vocab < 65536 else 1  # each row drawn with other counters too
    logits, params, top_k = np.tile(logits, (repeats, 1)), np.tile(params, (repeats, 1)), np.tile(top_k, repeats)
    keys = counters(rows * repeats, seed=vocab)
    expected = sampling.sample_reference(logits, params, top_k, keys)
    for row in range(rows * repeats):
        z = logits[row] / params[row, 0]
        allowed, _ = allowed_set(z, int(top_k[row]), float(params[row, 1]), float(params[row, 2]))
        assert allowed[expected[row]], row
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_sample(device, logits, params, top_k, keys), expected)


# sample: the drawn distribution ----------------------------------------------------------------

DISTRIBUTION_LOGITS = np.log(np.random.default_rng(37).permutation(np.linspace(1.0, 8.0, 20))).astype(np.float32)
DISTRIBUTIONS = {  # (temperature, top_k, top_p, min_p)
    "plain": (1.0, 0, 1.0, 0.0),
    "temperature": (0.7, 0, 1.0, 0.0),
    "top_k": (1.0, 6, 1.0, 0.0),
    "top_p": (1.0, 0, 0.6, 0.0),
    "min_p": (1.0, 0, 1.0, 0.4),
    "combined": (1.3, 12, 0.8, 0.2),
}


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of Pearson's statistic (Wilson-Hilferty's normal approximation of chi-square)."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    if df == 0:
        return 1.0
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_distribution(device: bg.Device, name: str, draws: int) -> None:
    """``draws`` draws (counters 0 .. draws - 1: rows x executes) from one logit row pass a chi-square
    test against softmax(z) restricted to the allowed set and renormalized; nothing outside the set."""
    temperature, top_k, top_p, min_p = DISTRIBUTIONS[name]
    z = DISTRIBUTION_LOGITS / np.float32(temperature)
    assert top_p == 1 or top_p_margin(z, top_p, top_k, min_p) > 1e-3
    allowed, p = allowed_set(z, top_k, top_p, min_p)
    rows = min(draws, 1000)
    batch = bg.GpuCommandBatch(device)
    keys = batch.upload(counters(rows, seed=2024))
    logits = batch.upload(np.tile(DISTRIBUTION_LOGITS, (rows, 1)))
    params = batch.upload(settings(rows, temperature, top_p, min_p))
    out = batch.sample(logits, params, batch.upload(np.full(rows, top_k, np.int32)), keys)
    observed = np.zeros(z.size, np.int64)
    for first in range(0, draws, rows):
        batch.execute({keys: counters(rows, seed=2024, first=first)})
        np.add.at(observed, batch.read(out), 1)
    assert observed[~allowed].sum() == 0
    expected = p[allowed] / p[allowed].sum() * draws
    assert expected.min() > 20  # the chi-square approximation holds
    p_value = chi_square_p_value(observed[allowed], expected)
    assert p_value > 1e-4, (name, p_value, observed[allowed], expected.round(1))


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_sample_distribution_chi_square(gpu, name):
    check_distribution(gpu, name, 20000 if gpu.kind != "cuda-cpu" else 6000)  # coroutine threads there


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_sample_distribution_chi_square_on_the_reference(ref, name):
    check_distribution(ref, name, 20000)


def test_sample_reference_search_finds_the_sorted_thresholds():
    """The kernels' many-ary search (its numpy twin) gives the k-th largest key and the top_p key that
    sorting gives, on rows with ties, negative values, -0.0 and -inf."""
    rng = np.random.default_rng(41)
    for _ in range(20):
        z = np.round(rng.standard_normal(300) * 3, 1).astype(np.float32)
        z[:5] = (-0.0, 0.0, -np.inf, -np.inf, z[10])
        keys = sampling.order_keys(z)
        assert (np.argsort(keys, kind="stable") == np.argsort(np.where(z == 0, 0, z), kind="stable")).all()
        k = int(rng.integers(1, 300))
        (found,) = sampling.kth_largest_keys(keys[None], np.array([k]))
        assert found == np.sort(keys)[::-1][k - 1]
        e = np.exp(z - z.max()).astype(np.float32)
        top_p = np.float32(rng.uniform(0.05, 0.99))
        (found,) = sampling.top_p_keys(keys[None], e[None], np.array([top_p]))
        order = np.argsort(-keys.astype(np.int64), kind="stable")
        tails = np.cumsum(e[order].astype(np.float64))
        assert found == keys[order[np.searchsorted(tails, top_p * tails[-1])]]


def test_sample_gumbel_noise_is_standard_gumbel():
    """The hash's uniforms and the noise: moments of a standard Gumbel (mean: Euler's gamma, variance
    pi^2 / 6), u never 0 or 1, and the series branch continuous with -log(u)."""
    noise = sampling.gumbel(3, 4, np.arange(1 << 20, dtype=np.uint32)).astype(np.float64)
    assert abs(noise.mean() - 0.5772157) < 0.005 and abs(noise.var() - math.pi**2 / 6) < 0.01
    u = sampling.hash_uniform(np.array([0, 0xFFFFFFFF], np.uint32))
    assert 0 < u[0] < 1e-6 and 1 - 1e-6 < u[1] < 1
    w = np.float32(0.0625) - np.float32(2**-23)  # the series just below the switch, log just above
    series = w * (1 + w * (0.5 + w * (1 / 3 + w * (0.25 + w * (0.2 + w / 6)))))
    assert abs(series / -math.log1p(-float(w)) - 1) < 3e-7  # float32: 2 ulp


# logprobs --------------------------------------------------------------------------------------


def run_logprobs(device, logits, targets, top_n) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    arrays = (logits, np.asarray(targets, np.int32), np.asarray(top_n, np.int32))
    out = batch.logprobs(*(batch.upload(a) for a in arrays))
    batch.execute()
    return batch.read(out)


def float64_log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


LOGPROB_ATOL = 3e-5
"""|logprob - float64 log-softmax| allowed, plus 1e-6 x |logprob|: the row's sum of exponentials adds
ceil(V / 256) float32 terms per invocation and a 256-leaf tree (relative error under 1.2e-5 at V = 49,152),
exp and log are within a few ulp on GPUs (WGSL: exp 3 + 2|x| ulp, log 2^-21 absolute near 1), and the
difference l - lse rounds once (|l - lse| < 64 here: under 4e-6)."""


def check_logprobs(got: np.ndarray, logits: np.ndarray, targets: np.ndarray, top_n: np.ndarray) -> None:
    """Ids exactly as the reference (argmax's order over the same float32 values); logprobs within
    LOGPROB_ATOL of the float64 log-softmax; NaN and -1 exactly where the reference has them."""
    expected = sampling.logprobs_reference(logits, targets, top_n)
    top = slice(1, 1 + sampling.MAX_TOP)
    np.testing.assert_array_equal(got[:, top], expected[:, top])
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    exact = float64_log_softmax(logits.astype(np.float32))
    for row in range(logits.shape[0]):
        ranks = int((expected[row, top] >= 0).sum())
        ids = expected[row, top][:ranks].astype(int)
        want = [exact[row, int(targets[row])]] if not np.isnan(expected[row, 0]) else []
        have = got[row, [0] if want else []]
        want += list(exact[row, ids])
        have = np.concatenate([have, got[row, 1 + sampling.MAX_TOP : 1 + sampling.MAX_TOP + ranks]])
        np.testing.assert_allclose(have, want, rtol=1e-6, atol=LOGPROB_ATOL, err_msg=f"row {row}")


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_logprobs_match_float64_log_softmax(gpu, ref, vocab, dtype):
    """Rows asking for 0, 1, 5, 20 and more than 20 top ids, rows skipped (top_n < 0), targets inside and
    outside [0, V); ties among the top ids come in index order."""
    rng = np.random.default_rng(vocab + 29)
    rows = 7
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(dtype)
    logits[1, vocab // 2 :] = logits[1].max()  # ties with the maximum: lowest index first
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[3], targets[4] = -1, vocab
    top_n = np.array([0, 20, -1, 1, 5, 25, 3], np.int32)
    for device in (gpu, ref):
        got = run_logprobs(device, logits, targets, top_n)
        assert got.shape == (rows, sampling.LOGPROB_WIDTH) and got.dtype == np.float32
        check_logprobs(got, logits.astype(np.float32), targets, top_n)
    assert np.isnan(got[2]).sum() == 1 + sampling.MAX_TOP and (got[2, 1 : 1 + sampling.MAX_TOP] == -1).all()


def test_logprobs_nan_rows(gpu, ref):
    """A row holding NaN: the NaNs rank first (by index), then argmax's order; every logprob is NaN."""
    rng = np.random.default_rng(31)
    logits = (rng.standard_normal((2, 1009)) * 2).astype(np.float32)
    logits[0, [700, 5]] = np.nan
    targets, top_n = np.array([3, 4], np.int32), np.array([4, 4], np.int32)
    for device in (gpu, ref):
        got = run_logprobs(device, logits, targets, top_n)
        finite_order = np.argsort(-np.where(np.isnan(logits[0]), -np.inf, logits[0]), kind="stable")
        assert got[0, 1:5].tolist() == [5, 700, *finite_order[:2]]
        assert np.isnan(got[0, [0, 21, 22, 23, 24]]).all()
        check_logprobs(got, logits, targets, top_n)


def test_logprobs_largest_vocab(gpu, ref):
    """Rows of MAX_LOGPROB_VOCAB tokens with 20 top ids, one workgroup each: every pass stays within the
    loop budget."""
    rng = np.random.default_rng(37)
    logits = (rng.standard_normal((2, sampling.MAX_LOGPROB_VOCAB)) * 2).astype(np.float32)
    targets, top_n = np.array([0, sampling.MAX_LOGPROB_VOCAB - 1], np.int32), np.array([20, 2], np.int32)
    for device in (gpu, ref):
        check_logprobs(run_logprobs(device, logits, targets, top_n), logits, targets, top_n)


def test_logprobs_refuse_bad_operands(ref):
    batch = bg.GpuCommandBatch(ref)
    logits, ids = batch.upload(np.ones((2, 5), np.float32)), batch.upload(np.zeros(2, np.int32))
    with pytest.raises(DTypeError, match=r"logprobs: targets .* has dtype float32; expected int32"):
        batch.logprobs(logits, batch.upload(np.zeros(2, np.float32)), ids)
    with pytest.raises(ShapeError, match=r"logprobs: top_n .* must have shape \(2,\), got \(3,\)"):
        batch.logprobs(logits, ids, batch.upload(np.zeros(3, np.int32)))
    with pytest.raises(DTypeError, match=r"logprobs: logits .* expected float32 or float16"):
        batch.logprobs(batch.upload(np.ones((2, 5), np.int32)), ids, ids)
    with pytest.raises(LimitError, match=rf"logprobs: .* at most {sampling.MAX_LOGPROB_VOCAB}"):
        batch.logprobs(batch.upload(np.ones((2, sampling.MAX_LOGPROB_VOCAB + 1), np.float32)), ids, ids)
    assert len(batch) == 0
    out = batch.logprobs(logits, ids, ids)  # the batch still records and runs
    batch.execute()
    assert batch.read(out).shape == (2, sampling.LOGPROB_WIDTH)


# sample: the allowed-token bitmask ------------------------------------------------------------

MASK_VOCABS = [1, 31, 33, 1009, 49152]  # one word, a word's width -1 and +1, a prime, SmolLM2


def run_masked(device, logits, params, top_k, keys, allowed) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    arrays = (logits, np.asarray(params, np.float32), np.asarray(top_k, np.int32), np.asarray(keys, np.uint32))
    out = batch.sample(*(batch.upload(a) for a in arrays), batch.upload(np.asarray(allowed, np.uint32)))
    batch.execute()
    return batch.read(out)


def pack_mask(allowed: np.ndarray) -> np.ndarray:
    """(rows, V) booleans as the (rows, ceil(V / 32)) uint32 bitmask, LSB first, packed independently of
    sampling.allowed_bits (numpy's packbits, little bit order)."""
    rows, width = allowed.shape
    padded = np.zeros((rows, 32 * -(-width // 32)), bool)
    padded[:, :width] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4").astype(np.uint32)


def mixed_rows(rng: np.random.Generator, rows: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Params (greedy, temperature only, top_k, top_p, min_p, all three; flag column 0) and top_k."""
    params = np.stack(
        [
            np.where(np.arange(rows) % 6 == 0, 0.0, rng.uniform(0.4, 1.6, rows)),
            np.choose(np.arange(rows) % 6, [1.0, 1.0, 1.0, 0.8, 1.0, 0.9]),
            np.choose(np.arange(rows) % 6, [0.0, 0.0, 0.0, 0.0, 0.1, 0.02]),
            np.zeros(rows),
        ],
        axis=1,
    ).astype(np.float32)
    top_k = np.choose(np.arange(rows) % 6, [0, 0, 7, 0, 0, 40]).astype(np.int32)
    return params, np.minimum(top_k, vocab)


@pytest.mark.parametrize("vocab", MASK_VOCABS)
def test_sample_masked_rows_equal_the_reference_on_masked_logits(gpu, ref, vocab):
    """Masked rows (greedy, temperature, top_k, top_p, min_p; dense and sparse random masks) draw what the
    sampler draws from where(mask, logits, -inf): the mask applies before every step. Exact: the
    executors run the reference's float32 steps (random logits make near-ties between float32
    roundings negligible), and every id lies in the mask."""
    rng = np.random.default_rng(vocab + 29)
    rows = 12
    logits = (rng.standard_normal((rows, vocab)) * 2.5).astype(np.float32)
    params, top_k = mixed_rows(rng, rows, vocab)
    mask = rng.random((rows, vocab)) < np.where(np.arange(rows) < 6, 0.5, 0.02)[:, None]
    mask[np.arange(rows), rng.integers(0, vocab, rows)] = True  # at least one allowed token per row
    keys = counters(rows, seed=vocab)
    expected = sampling.sample_reference(np.where(mask, logits, -np.inf), params, top_k, keys)
    assert mask[np.arange(rows), expected].all()
    flagged = params.copy()
    flagged[:, 3] = 1.0
    np.testing.assert_array_equal(sampling.sample_reference(logits, flagged, top_k, keys, pack_mask(mask)), expected)
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_masked(device, logits, flagged, top_k, keys, pack_mask(mask)), expected)


@pytest.mark.parametrize("vocab", MASK_VOCABS)
def test_sample_masked_row_with_one_allowed_token_always_takes_it(gpu, ref, vocab):
    """A mask with one allowed token gives that token at every setting, over many draws, even where its
    logit is the row's smallest, -inf or NaN, and where disallowed logits are NaN or +inf."""
    rng = np.random.default_rng(vocab + 31)
    rows = 24
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    token = rng.integers(0, vocab, rows)
    logits[0, token[0]] = logits[0].min() - 5
    logits[1, token[1]] = -np.inf
    logits[2, token[2]] = np.nan
    if vocab > 1:
        logits[3, (token[3] + 1) % vocab] = np.nan  # disallowed NaN and +inf: never the greedy id
        logits[4, (token[4] + 1) % vocab] = np.inf
    params, top_k = mixed_rows(rng, rows, vocab)
    params[:, 3] = 1.0
    params[7, 1], top_k[8] = 0.0, 1  # top_p 0 and top_k 1 keep only the maximum: the token
    mask = np.zeros((rows, vocab), bool)
    mask[np.arange(rows), token] = True
    for device in (gpu, ref):
        for first in (0, 1000):
            ids = run_masked(device, logits, params, top_k, counters(rows, seed=3, first=first), pack_mask(mask))
            np.testing.assert_array_equal(ids, token)


@pytest.mark.parametrize("vocab", [1, 33, 1009])
def test_sample_masked_row_with_no_allowed_token_gives_minus_one(gpu, ref, vocab):
    """A masked row whose mask allows no token gives id -1 (greedy or not, NaN logits included); the rows
    around it draw as they would alone."""
    rng = np.random.default_rng(vocab + 37)
    rows = 4
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[1, 0] = np.nan
    params = settings(rows, temperature=0.9, top_p=0.9)
    params[0, 0] = 0.0
    params[:, 3] = [1.0, 1.0, 0.0, 1.0]
    mask = rng.random((rows, vocab)) < 0.5
    mask[:2] = False
    mask[3, -1] = True
    keys, top_k = counters(rows), np.array([0, 3, 0, 0], np.int32)
    alone = sampling.sample_reference(logits[2:], params[2:], top_k[2:], keys[2:], pack_mask(mask[2:]))
    for device in (gpu, ref):
        ids = run_masked(device, logits, params, top_k, keys, pack_mask(mask))
        np.testing.assert_array_equal(ids[:2], [-1, -1])
        np.testing.assert_array_equal(ids[2:], alone)


@pytest.mark.parametrize("vocab", [33, 49152])
def test_sample_unmasked_rows_are_identical_with_and_without_the_mask(gpu, ref, vocab):
    """In one call, rows without the flag draw exactly what the call without a mask draws (the mask they
    never read is random, and its rows are all zeros for some); masked rows stay in their masks; without
    ``allowed`` the flag column is ignored."""
    rng = np.random.default_rng(vocab + 41)
    rows = 12
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    params, top_k = mixed_rows(rng, rows, vocab)
    keys = counters(rows, seed=11)
    flagged = params.copy()
    flagged[::2, 3] = 1.0
    mask = rng.random((rows, vocab)) < 0.3
    mask[np.arange(rows), rng.integers(0, vocab, rows)] = True
    mask[1::4] = False
    for device in (gpu, ref):
        plain = run_sample(device, logits, params, top_k, keys)
        np.testing.assert_array_equal(run_sample(device, logits, flagged, top_k, keys), plain)
        ids = run_masked(device, logits, flagged, top_k, keys, pack_mask(mask))
        np.testing.assert_array_equal(ids[1::2], plain[1::2])
        assert mask[np.arange(0, rows, 2), ids[::2]].all()


def test_sample_masked_float16_logits(gpu, ref):
    rng = np.random.default_rng(43)
    logits = (rng.standard_normal((6, 333)) * 3).astype(np.float16)
    params, top_k, keys = settings(6, 0.9, 0.9, 0.01), np.array([0, 5, 0, 50, 0, 2], np.int32), counters(6)
    params[:, 3] = 1.0
    mask = rng.random((6, 333)) < 0.2
    expected = sampling.sample_reference(np.where(mask, logits.astype(np.float32), -np.inf), params, top_k, keys)
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_masked(device, logits, params, top_k, keys, pack_mask(mask)), expected)


def test_sample_masked_largest_vocab(gpu, ref):
    """Masked rows of MAX_VOCAB tokens: the masked entry's passes stay within the loop budget (one read of
    the mask per element, in the first pass) and its per-invocation bits cover the row."""
    rng = np.random.default_rng(47)
    width = sampling.MAX_VOCAB
    logits = (rng.standard_normal((3, width)) * 2).astype(np.float32)
    params = np.array([[0.0, 1.0, 0.0, 1.0], [1.0, 0.9, 0.01, 1.0], [1.0, 0.5, 0.0, 1.0]], np.float32)
    mask = rng.random((3, width)) < 0.1
    mask[0, -1] = True
    logits[0, -1] = logits[0].max() + 1  # the last element decides the greedy row: its bit is the last one read
    top_k, keys = np.array([0, 100, 20000], np.int32), counters(3)
    expected = sampling.sample_reference(np.where(mask, logits, -np.inf), params, top_k, keys)
    assert expected[0] == width - 1
    for device in (gpu, ref):
        np.testing.assert_array_equal(run_masked(device, logits, params, top_k, keys, pack_mask(mask)), expected)


def test_sample_mask_layout_is_lsb_first():
    """sampling.allowed_bits reads token t at bit t & 31 of word t >> 5 (llguidance's int32 masks too)."""
    mask = np.array([[1 | 1 << 31, 1 << 2]], np.uint32)
    assert np.flatnonzero(sampling.allowed_bits(mask, 35)).tolist() == [0, 31, 34]
    assert np.flatnonzero(sampling.allowed_bits(mask.view(np.int32), 35)).tolist() == [0, 31, 34]


def test_sample_without_a_mask_records_the_plain_launch(ref):
    """Without ``allowed`` the launch is the plain ``sample`` entry with its bindings of before (no slot
    for the mask); with it, the ``sample_masked`` entry binds the mask too."""
    batch = bg.GpuCommandBatch(ref)
    logits, params = batch.upload(np.ones((2, 40), np.float32)), batch.upload(settings(2))
    top_k, keys = batch.upload(np.zeros(2, np.int32)), batch.upload(counters(2))
    batch.sample(logits, params, top_k, keys)
    batch.sample(logits, params, top_k, keys, batch.upload(np.ones((2, 2), np.uint32)))
    (plain,), (masked,) = (node.launches for node in batch.nodes[-2:])
    assert plain.entry == "sample" and masked.entry == "sample_masked"
    assert [b.slot for b in plain.bindings] == [0, 4, 5, 6, 7, 12]  # logits, settings, top_k, keys, out, Params
    assert [b.slot for b in masked.bindings] == [0, 4, 5, 6, 7, 12, 13]


# validation ------------------------------------------------------------------------------------


def test_sampling_ops_refuse_bad_operands(ref):
    batch = bg.GpuCommandBatch(ref)
    logits, params = batch.upload(np.ones((2, 5), np.float32)), batch.upload(settings(2))
    top_k, keys = batch.upload(np.zeros(2, np.int32)), batch.upload(counters(2))
    counts, slots = batch.upload(np.zeros((2, 5), np.int32)), batch.upload(np.zeros(3, np.int32))
    with pytest.raises(DTypeError, match=r"sample: keys .* has dtype int32; expected uint32"):
        batch.sample(logits, params, top_k, batch.upload(np.zeros((2, 2), np.int32)))
    with pytest.raises(ShapeError, match=r"sample: params .* must have shape \(2, 4\), got \(2, 3\)"):
        batch.sample(logits, batch.upload(np.ones((2, 3), np.float32)), top_k, keys)
    with pytest.raises(DTypeError, match=r"sample: logits .* expected float32 or float16"):
        batch.sample(counts, params, top_k, keys)
    with pytest.raises(ShapeError, match=r"sample: logits .* must be 2-D"):
        batch.sample(batch.upload(np.ones(5, np.float32)), params, top_k, keys)
    with pytest.raises(LimitError, match=rf"at most {sampling.MAX_VOCAB}"):
        wide = batch.upload(np.ones((2, sampling.MAX_VOCAB + 1), np.float32))
        batch.sample(wide, params, top_k, keys)
    with pytest.raises(ShapeError, match=r"penalize: seen .* must have shape \(2, 5\), got \(2, 4\)"):
        batch.penalize(
            logits, batch.upload(np.zeros((2, 4), np.int32)), counts, batch.upload(np.ones((2, 3), np.float32))
        )
    with pytest.raises(DTypeError, match=r"penalize: penalties .* expected float32"):
        batch.penalize(logits, counts, counts, batch.upload(np.ones((2, 3), np.float16)))
    with pytest.raises(ShapeError, match=r"count_tokens: ids .* must have shape \(3,\), got \(2,\)"):
        batch.count_tokens(counts, slots, top_k, top_k)
    with pytest.raises(ShapeError, match=r"count_tokens: reset .* must have shape \(2,\), got \(3,\)"):
        batch.count_tokens(counts, slots, slots, slots)
    with pytest.raises(DTypeError, match=r"count_tokens: counts .* expected int32"):
        batch.count_tokens(logits, slots, slots, top_k)
    with pytest.raises(ArgumentError, match=r"count_tokens: .* must be a Tensor"):
        batch.count_tokens(counts, slots, slots, 0)
    assert len(batch) == 0  # nothing recorded by the refused calls


def test_sample_refuses_a_bad_mask_before_recording(gpu):
    """A mask of the wrong dtype or shape is refused before anything is recorded, naming expected and
    actual; the batch then records and runs a masked sample."""
    batch = bg.GpuCommandBatch(gpu)
    logits, params = batch.upload(np.ones((3, 33), np.float32)), batch.upload(settings(3))
    top_k, keys = batch.upload(np.zeros(3, np.int32)), batch.upload(counters(3))
    with pytest.raises(DTypeError, match=r"sample: allowed .* has dtype int32; expected uint32"):
        batch.sample(logits, params, top_k, keys, batch.upload(np.ones((3, 2), np.int32)))
    with pytest.raises(DTypeError, match=r"sample: allowed .* has dtype float32; expected uint32"):
        batch.sample(logits, params, top_k, keys, batch.upload(np.ones((3, 2), np.float32)))
    for shape in ((3, 1), (3, 3), (2, 2), (6,), (3, 2, 1)):
        bad = batch.upload(np.ones(shape, np.uint32))
        with pytest.raises(
            ShapeError, match=rf"sample: allowed .* must have shape \(3, 2\), got {re.escape(str(shape))}"
        ):
            batch.sample(logits, params, top_k, keys, bad)
    with pytest.raises(ArgumentError):
        batch.sample(logits, params, top_k, keys, np.ones((3, 2), np.uint32))
    with pytest.raises(LimitError, match=rf"at most {sampling.MAX_VOCAB}"):
        wide = batch.upload(np.ones((3, sampling.MAX_VOCAB + 1), np.float32))
        batch.sample(wide, params, top_k, keys, batch.upload(np.ones((3, sampling.MAX_VOCAB // 32 + 1), np.uint32)))
    assert len(batch) == 0
    flagged = np.ones((3, 4), np.float32)
    flagged[:, 0] = 0.0
    out = batch.sample(logits, batch.upload(flagged), top_k, keys, batch.upload(np.full((3, 2), 1 << 5, np.uint32)))
    batch.execute()
    np.testing.assert_array_equal(batch.read(out), [5, 5, 5])
