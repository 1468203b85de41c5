"""Token sampling for LLM decoding, on the device: penalties, sampling and token counts.

- ``penalize(logits, seen, generated, penalties)``: per element, where ``seen > 0`` the repetition penalty
  r of its row (transformers' rule: ``l / r`` for ``l > 0``, else ``l * r``), then
  ``l -= presence * (generated > 0) + frequency * generated`` (OpenAI, vLLM).
- ``sample(logits, params, top_k, keys[, allowed])``: one int32 id per row. ``params`` rows are
  (temperature, top_p, min_p, masked), ``keys`` rows (seed, counter). Temperature <= 0 (or NaN): greedy,
  ``argmax``'s rule (first maximum, NaN first). Otherwise, with z = logit / temperature and p = softmax(z)
  over the whole row, a draw from p restricted to the allowed set and renormalized, the set built in vLLM's
  order: min_p keeps
  ``p_i >= min_p * p_max`` (0: off) and top_k the top_k largest z (every element tied with the k-th largest
  included; off for k <= 0 or k >= V), both measured on the whole row; then top_p keeps, of what they left,
  the smallest prefix in decreasing z whose mass under p renormalized to that set reaches top_p (elements
  tied with its last one included; off for top_p >= 1; top_p <= 0 keeps the maximum and its ties); the
  maximum is always allowed. Rows whose largest z is not finite (a NaN, +inf, all -inf) take the greedy
  id. The draw is Gumbel-max: the first maximum over allowed i of ``z_i + g_i``, ``g_i = -log(-log(u_i))``,
  ``u_i`` from a counter-based hash of (seed, counter, i) (:func:`hash3`, :func:`hash_uniform`), so a
  (seed, counter) pair always draws the same id. With ``allowed``, an (S, ceil(V / 32)) uint32
  allowed-token bitmask (token t allowed iff bit ``t & 31`` of word ``t >> 5`` is set, as llguidance and
  xgrammar fill it), every row whose ``params[:, 3] != 0`` (1.0, say) sees -inf at each token the mask
  leaves out, before every step above (as vLLM applies the grammar bitmask to the logits before its
  sampler); its greedy id is its first allowed maximum (NaN first), and it gives id -1 where the mask
  allows no token (the caller must treat -1 as an error). Other rows never read the mask and draw what
  they draw without it; without ``allowed``, ``params[:, 3]`` is ignored.
- ``logprobs(logits, targets, top_n)``: per row of (S, V) logits, the log-softmax of the raw logits (no
  temperature, penalty or truncation: the model's own distribution, as vLLM reports it) read at the row's
  target id and at its ``top_n`` largest logits (at most ``MAX_TOP``), as (S, ``LOGPROB_WIDTH``) float32 rows
  of [target's logprob, ``MAX_TOP`` ids (as floats: exact below 2**24), ``MAX_TOP`` logprobs]; see
  :func:`logprobs_reference`.
- ``count_tokens(counts, slots, ids, reset)``: in place, rows of counts with ``reset != 0`` are zeroed,
  then ``counts[slots[i], ids[i]] += 1`` for every valid pair (duplicates add up; a slot outside
  ``[0, rows)`` or an id outside ``[0, V)`` is skipped).

The sampler runs one workgroup per row, without sorting: the k-th largest z and the top_p threshold are
found by a many-ary search over the order-preserving u32 image of z (:func:`order_keys`), ``BIN_BITS``
bits per pass (``BINS`` buckets, ``SEARCH_PASSES`` passes), top_k's search first, then top_p's over the
elements top_k and min_p leave (so a row with both takes twice the passes of a row with one). Masses are
summed in 32.32 fixed point: exact, in any order. The numpy reference runs the same steps (the same keys,
search, fixed-point masses, hash and Gumbel noise), so that executors and the reference draw the same ids
unless their float32 division, exp or log round differently at a near-tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import FLOAT16, FLOAT32, INT32, UINT32
from ..errors import DTypeError, LimitError, ShapeError
from ..kernels import Launch, wgsl_aliases
from ..tensor import Tensor
from . import bounds
from .common import groups_for
from .interface import SAMPLING
from .spec import Node, OpSpec

WORKGROUP = SAMPLING.value("WG")
BINS = SAMPLING.value("BINS")
BIN_BITS = SAMPLING.value("BIN_BITS")
SEARCH_PASSES = SAMPLING.value("SEARCH_PASSES")
assert BINS == 1 << BIN_BITS and SEARCH_PASSES * BIN_BITS == 32

ROW_PASSES = 2 * SEARCH_PASSES + 2
"""Passes of the ``sample`` kernel over its row at most: the maximum, top_k's threshold search (rows with
top_k on), top_p's (rows with top_p on), the draw (sampled rows); each runs ceil(V / WG) iterations of
one loop per invocation."""

OTHER_LOOPS = 1536
"""A bound on the other loop iterations of one ``sample`` invocation: two (value, index) trees (8 each)
and per search pass 16 (zeroing its mass buckets, where that is a loop), 16 (merging them into the
workgroup's) and 2 x 16 (invocation 0 sums and picks the buckets): 1,040 in all."""

MASK_WORDS = SAMPLING.value("MASK_WORDS")
"""``sample_masked``: words of allowed bits an invocation keeps, one bit per element it reads."""

MAX_VOCAB = min(WORKGROUP * ((bounds.WHOLE_ROW_BUDGET - OTHER_LOOPS) // ROW_PASSES), 32 * MASK_WORDS * WORKGROUP)
"""The longest row ``sample`` takes (262,144, Gemma 3's vocabulary: the allowed bits ``sample_masked``
keeps; the 32,768-iteration budget alone would allow 444,160): one workgroup per row stays within
``bounds.WHOLE_ROW_BUDGET``. Computed once from the budget: the sampler never cuts rows into pieces, so
tests that shrink the bounds to reach chunked paths leave it as it is."""

WORKGROUP_BYTES = 4 * (2 * WORKGROUP + 3 * BINS + 3)
"""``sample``'s workgroup memory: the (value, index) tree, the key counts and the masses (two words) of the
buckets, the two search intervals and the pass count."""

MAX_TOP = SAMPLING.value("MAX_TOP")
"""The most top ids ``logprobs`` gives per row (OpenAI's ``top_logprobs`` and ``logprobs`` limit, 20)."""

LOGPROB_WIDTH = SAMPLING.value("LOGPROB_WIDTH")
assert LOGPROB_WIDTH == 1 + 2 * MAX_TOP

MAX_LOGPROB_VOCAB = WORKGROUP * ((bounds.WHOLE_ROW_BUDGET - OTHER_LOOPS) // (MAX_TOP + 1))
"""The longest row ``logprobs`` takes (380,672 with the 32,768-iteration budget, past Gemma 3's, Llama 3's
and Qwen's vocabularies): one workgroup per row runs a pass for the maximum (the first top id), one for the sum of
exponentials and one per further top id, each ceil(V / WG) iterations of one loop per invocation, within
``bounds.WHOLE_ROW_BUDGET``; its (value, index) tree and sum tree stay under ``OTHER_LOOPS``. Computed once from
the budget, like :data:`MAX_VOCAB`."""

F32_ONE_THIRD, F32_ONE_SIXTH = np.float32(1 / 3), np.float32(1 / 6)


# the numpy twins of the kernels' helpers ---------------------------------------------------------


def pcg_hash(v: np.ndarray) -> np.ndarray:
    """PCG hash of uint32 values (Jarzynski and Olano 2020), as shaders/wgsl/lib/random.wgsl."""
    v = np.asarray(v, np.uint32)
    with np.errstate(over="ignore"):
        state = v * np.uint32(747796405) + np.uint32(2891336453)
        word = ((state >> ((state >> np.uint32(28)) + np.uint32(4))) ^ state) * np.uint32(277803737)
    return np.asarray((word >> np.uint32(22)) ^ word, np.uint32)


def hash3(seed: Any, counter: Any, index: Any) -> np.ndarray:
    """The 32-bit hash of (seed, counter, index) (broadcast uint32 arrays): nested PCG hashes."""
    seed, counter, index = (np.asarray(a, np.uint32) for a in (seed, counter, index))
    return pcg_hash(seed ^ pcg_hash(counter ^ pcg_hash(index)))


def hash_uniform(h: np.ndarray) -> np.ndarray:
    """(m + 0.5) / 2**23 for the top 23 bits m of ``h``: float32 in (0, 1), exact, never 0 or 1."""
    return ((h >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def gumbel(seed: Any, counter: Any, index: Any) -> np.ndarray:
    """Standard Gumbel noise ``-log(-log(u))`` in float32, as the kernels compute it: for u > 15/16,
    ``-log(u)`` is the series of ``-log(1 - w)`` in ``w = 1 - u`` (exact) up to w**6 / 6."""
    u = hash_uniform(hash3(seed, counter, index))
    w = np.float32(1) - u
    series = w * (
        1 + w * (np.float32(0.5) + w * (F32_ONE_THIRD + w * (np.float32(0.25) + w * (0.2 + w * F32_ONE_SIXTH))))
    )
    exponential = np.where(w < np.float32(0.0625), series.astype(np.float32), -np.log(u))
    return -np.log(exponential)


def order_keys(z: np.ndarray) -> np.ndarray:
    """The order-preserving uint32 image of float32 values: a < b iff key(a) < key(b), -0 == +0."""
    bits = np.ascontiguousarray(z, np.float32).view(np.uint32).copy()
    bits[bits == 0x80000000] = 0
    return np.where(bits >= 0x80000000, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def fixed_point(e: np.ndarray) -> np.ndarray:
    """Masses in [0, 1] (float32) in 32.32 fixed point, as the kernels add them (truncated below 2**-32),
    as float64 (exact: sums of a row stay below 2**53)."""
    e = np.asarray(e, np.float32)
    whole = np.floor(e)
    fraction = np.floor((e - whole) * np.float32(2.0**32)).astype(np.float64)
    return whole.astype(np.float64) * 2.0**32 + fraction


def _search(keys: np.ndarray, weights: np.ndarray, targets: np.ndarray | None, top_p: np.ndarray | None) -> np.ndarray:
    """The kernels' threshold search (see :func:`kth_largest_keys`, :func:`top_p_keys`): counts in exact
    integers (``targets``), or fixed-point masses whose buckets become float32 with float32 tails (``top_p``:
    the target is top_p times the total mass of pass 0, summed over the buckets in order)."""
    rows = keys.shape[0]
    dtype = np.float64 if top_p is None else np.float32
    keys = keys.astype(np.int64)
    first = np.zeros(rows, np.int64)
    above = np.zeros(rows, dtype)
    at = np.arange(rows)
    for level in range(SEARCH_PASSES):
        shift = (SEARCH_PASSES - 1 - level) * BIN_BITS
        offset = keys - first[:, None]
        bucket = np.where(offset >= 0, offset >> shift, BINS)
        inside = bucket < BINS
        slots = (at[:, None] * BINS + bucket)[inside]
        sums = np.bincount(slots, weights=weights[inside], minlength=rows * BINS).reshape(rows, BINS)
        if top_p is None:
            bins = sums
        else:  # as mass_of: high and low words to float32, one rounding
            high = np.floor(sums / 2.0**32)
            bins = high.astype(np.float32) * np.float32(2.0**32) + (sums - high * 2.0**32).astype(np.float32)
            if level == 0:
                total = np.zeros(rows, np.float32)
                for b in range(BINS):
                    total = total + bins[:, b]
                targets = top_p.astype(np.float32) * total
        assert targets is not None
        tails = np.cumsum(bins[:, ::-1], axis=1, dtype=dtype)  # tails[:, j]: buckets BINS - 1 - j .. BINS - 1
        before = np.concatenate([np.zeros((rows, 1), dtype), tails[:, :-1]], axis=1)  # the buckets above
        reached = above[:, None] + tails >= targets[:, None]
        found = reached.any(axis=1)
        j = np.argmax(reached, axis=1)
        pick = np.where(found, BINS - 1 - j, 0)
        above = above + np.where(found, before[at, j], tails[:, -1] - bins[:, 0]).astype(dtype)
        first += pick << shift
    return first.astype(np.uint32)


def kth_largest_keys(keys: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row of ``keys`` (rows, V), the k-th largest key (k >= 1), as the kernel searches it: ``BIN_BITS``
    bits per pass from the top, keeping the highest bucket of the current interval whose tail (the count
    of keys above the interval plus the buckets from the top down to it) reaches k."""
    return _search(keys, np.ones(keys.shape), np.asarray(k, np.float64), None)


def top_p_keys(keys: np.ndarray, e: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row, the largest key whose tail (the masses ``e`` of the keys >= it; 0 for elements top_k or
    min_p removed) reaches top_p of the row's total, as the kernel searches it: masses in 32.32 fixed point
    (:func:`fixed_point`), exact sums per bucket, float32 tails (bucket 0 where rounding leaves the target
    out of reach)."""
    return _search(keys, fixed_point(e), None, np.asarray(top_p, np.float32))


def allowed_bits(allowed: np.ndarray, width: int) -> np.ndarray:
    """The (rows, width) booleans of a (rows, ceil(width / 32)) uint32 bitmask: token t is allowed iff bit
    ``t & 31`` of word ``t >> 5`` is set (least significant bit first; llguidance's and xgrammar's layout)."""
    t = np.arange(width)
    words = np.asarray(allowed).view(np.uint32)[:, t >> 5]
    return ((words >> (t & 31).astype(np.uint32)) & 1).astype(bool)


def sample_reference(
    logits: np.ndarray, params: np.ndarray, top_k: np.ndarray, keys: np.ndarray, allowed: np.ndarray | None = None
) -> np.ndarray:
    """The ids ``sample`` draws, computed with numpy the way the kernel does (float32 z, exp and noise). With
    ``allowed`` (:func:`allowed_bits`' layout), rows whose ``params[:, 3] != 0`` see -inf at every token
    the mask leaves out, before every step; their greedy id is their first allowed maximum (NaN first), -1
    where the mask allows no token."""
    logits = np.asarray(logits, np.float32)
    rows, width = logits.shape
    temperature = params[:, 0].astype(np.float32)
    sampling = temperature > 0
    visible = np.ones((rows, width), bool)
    if allowed is not None:
        visible = ~(params[:, 3] != 0)[:, None] | allowed_bits(allowed, width)
        logits = np.where(visible, logits, np.float32(-np.inf))
    with np.errstate(all="ignore"):
        z = np.where(sampling[:, None], logits / np.where(sampling, temperature, np.float32(1))[:, None], logits)
    greedy = np.argmax(z, axis=1)
    hidden = ~visible[np.arange(rows), greedy]  # every allowed z is -inf: the first allowed, or none (-1)
    greedy[hidden] = np.where(visible[hidden].any(axis=1), np.argmax(visible[hidden], axis=1), -1)
    z_max = np.where(greedy >= 0, z[np.arange(rows), greedy], np.float32(-np.inf))
    with np.errstate(invalid="ignore"):
        random = sampling & np.isfinite(z_max)
    ids = greedy.astype(np.int32)
    if not random.any():
        return ids
    z, z_max, params, top_k, keys = z[random], z_max[random], params[random], top_k[random], keys[random]
    key = order_keys(z)
    key_max = order_keys(z_max)
    with np.errstate(under="ignore"):
        e = np.exp(z - z_max[:, None]).astype(np.float32)
    k_on = (top_k > 0) & (top_k < width)
    top_p, min_p = params[:, 1].astype(np.float32), params[:, 2].astype(np.float32)
    p_on = top_p < 1
    k_threshold = np.where(k_on, np.minimum(kth_largest_keys(key, top_k), key_max), 0)[:, None]
    kept = (key >= k_threshold) & (e >= min_p[:, None]) | (key == key_max[:, None])  # what top_p measures
    p_first = top_p_keys(key, np.where(kept, e, np.float32(0)), top_p)
    p_threshold = np.where(p_on, np.minimum(p_first, key_max), 0)[:, None]
    allowed = kept & (key >= p_threshold) | (key == key_max[:, None])
    noise = gumbel(keys[:, :1], keys[:, 1:], np.arange(width, dtype=np.uint32)[None, :])
    scores = np.where(allowed, z + noise, -np.inf)
    ids[random] = np.argmax(scores, axis=1)
    return ids


def argmax_order(row: np.ndarray) -> np.ndarray:
    """The indices of a float row in ``argmax``'s order (``better`` of shaders/wgsl/lib/best.wgsl): NaNs first
    (by index), then decreasing value, ties by increasing index."""
    nan = np.isnan(row)
    return np.lexsort((np.arange(row.size), -np.where(nan, 0, row), ~nan))


def logprobs_reference(logits: np.ndarray, targets: np.ndarray, top_n: np.ndarray) -> np.ndarray:
    """What ``logprobs`` computes, in float32 as the kernels do (their sum of exponentials adds in another
    order). Per row with ``top_n >= 0``: m = the row's first maximum (NaN first), lse = m + log(sum(exp(l -
    m))), every logprob l - lse (NaN throughout where m is not finite); column 0 the target's (NaN for a
    target outside [0, V)), columns 1.. the first min(top_n, MAX_TOP, V) ids in argmax order, columns
    1 + MAX_TOP.. their logprobs. Entries not computed (rows with ``top_n < 0``, ranks past the row's count)
    are NaN, with id -1."""
    logits = np.asarray(logits, np.float32)
    rows, width = logits.shape
    out = np.full((rows, LOGPROB_WIDTH), np.nan, np.float32)
    out[:, 1 : 1 + MAX_TOP] = -1
    for r in range(rows):
        n = int(top_n[r])
        if n < 0:
            continue
        row = logits[r]
        order = argmax_order(row)
        m = row[order[0]]
        with np.errstate(all="ignore"):
            lse = np.float32(m + np.log(np.exp(row - m, dtype=np.float32).sum(dtype=np.float32), dtype=np.float32))
            values = row - lse if np.isfinite(m) else np.full(width, np.nan, np.float32)
        target = int(targets[r])
        if 0 <= target < width:
            out[r, 0] = values[target]
        ranks = min(n, MAX_TOP, width)
        out[r, 1 : 1 + ranks] = order[:ranks]
        out[r, 1 + MAX_TOP : 1 + MAX_TOP + ranks] = values[order[:ranks]]
    return out


# validation ------------------------------------------------------------------------------------


def _check(op: str, argument: str, tensor: Tensor, shape: tuple[int, ...], dtypes: Sequence[np.dtype]) -> None:
    if tensor.dtype not in dtypes:
        wanted = " or ".join(d.name for d in dtypes)
        raise DTypeError(f"{op}: {argument} {tensor.describe()} has dtype {tensor.dtype.name}; expected {wanted}")
    if tensor.shape != shape:
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must have shape {shape}, got {tensor.shape}")


def _rows_by_vocab(op: str, argument: str, tensor: Tensor, dtypes: Sequence[np.dtype]) -> tuple[int, int]:
    if tensor.dtype not in dtypes:
        wanted = " or ".join(d.name for d in dtypes)
        raise DTypeError(f"{op}: {argument} {tensor.describe()} has dtype {tensor.dtype.name}; expected {wanted}")
    if tensor.ndim != 2:
        raise ShapeError(f"{op}: {argument} {tensor.describe()} must be 2-D (rows, vocab), got shape {tensor.shape}")
    return tensor.shape[0], tensor.shape[1]


FLOAT_TYPES = (FLOAT32, FLOAT16)


# penalize --------------------------------------------------------------------------------------


def _penalize_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    logits, seen, generated, penalties = inputs
    rows, width = _rows_by_vocab("penalize", "logits", logits, FLOAT_TYPES)
    _check("penalize", "seen", seen, (rows, width), (INT32,))
    _check("penalize", "generated", generated, (rows, width), (INT32,))
    _check("penalize", "penalties", penalties, (rows, 3), (FLOAT32,))
    return logits.shape, logits.dtype


def _penalize_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    logits, seen, generated, penalties = arrays
    x = logits.astype(np.float32)
    repetition, presence, frequency = (penalties[:, j : j + 1].astype(np.float32) for j in range(3))
    with np.errstate(all="ignore"):
        x = np.where(seen > 0, np.where(x > 0, x / repetition, x * repetition), x)
        return x - (presence * (generated > 0).astype(np.float32) + frequency * generated.astype(np.float32))


def _penalize_lower(node: Node) -> list[Launch]:
    logits, seen, generated, penalties = node.inputs
    out = node.output
    rows, width = logits.shape
    return [
        SAMPLING.launch(
            label="penalize",
            entry="penalize",
            types=wgsl_aliases(A=logits.dtype, O=out.dtype),
            groups=groups_for(out.size, WORKGROUP),
            params=dict(rows=rows, width=width, count=0),
            buffers=dict(logits=logits, seen=seen, generated=generated, penalties=penalties, out=out),
        )
    ]


PENALIZE = OpSpec(
    name="penalize",
    infer=_penalize_infer,
    reference=_penalize_reference,
    lower=_penalize_lower,
    dtypes="float",
    doc="repetition (where seen > 0), presence and frequency penalties of (S, V) logits, per-row (S, 3) values",
)


# sample ----------------------------------------------------------------------------------------


def mask_words(width: int) -> int:
    """Words of one row of ``sample``'s allowed-token bitmask: ceil(width / 32)."""
    return -(-width // 32)


def _sample_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    logits, settings, top_k, keys = inputs[:4]
    rows, width = _rows_by_vocab("sample", "logits", logits, FLOAT_TYPES)
    _check("sample", "params", settings, (rows, 4), (FLOAT32,))
    _check("sample", "top_k", top_k, (rows,), (INT32,))
    _check("sample", "keys", keys, (rows, 2), (UINT32,))
    if len(inputs) == 5:
        _check("sample", "allowed", inputs[4], (rows, mask_words(width)), (UINT32,))
    if width > MAX_VOCAB:
        raise LimitError(
            f"sample: logits {logits.describe()} has rows of {width} tokens; at most {MAX_VOCAB} are supported "
            f"(one workgroup per row within the loop budget of batchgpu/ops/bounds.py)"
        )
    return (rows,), INT32


def _sample_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    return sample_reference(*arrays)


def _sample_lower(node: Node) -> list[Launch]:
    logits, settings, top_k, keys = node.inputs[:4]
    rows, width = logits.shape
    buffers = dict(logits=logits, settings=settings, top_k=top_k, keys=keys, out=node.output)
    if len(node.inputs) == 5:  # a second entry: the plain one has no binding for the mask
        buffers["allowed"] = node.inputs[4]
    return [
        SAMPLING.launch(
            label="sample",
            entry="sample_masked" if "allowed" in buffers else "sample",
            types=wgsl_aliases(A=logits.dtype, O=INT32),
            constants=(("IS_FLOAT", True),),  # NaN comes first in the greedy argmax (lib/best.wgsl)
            groups=rows,
            params=dict(rows=rows, width=width, count=0),
            buffers=buffers,
            workgroup_bytes=WORKGROUP_BYTES,
        )
    ]


SAMPLE = OpSpec(
    name="sample",
    infer=_sample_infer,
    reference=_sample_reference,
    lower=_sample_lower,
    dtypes="float",
    doc="int32 id per row of (S, V) logits: greedy for temperature <= 0, else a Gumbel-max draw from the "
    "softmax restricted to top_k, top_p and min_p, keyed by (seed, counter); with an (S, ceil(V / 32)) uint32 "
    "allowed-token bitmask, rows with params[:, 3] != 0 see -inf outside it (-1: no token allowed)",
)


# logprobs --------------------------------------------------------------------------------------


def _logprobs_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    logits, targets, top_n = inputs
    rows, width = _rows_by_vocab("logprobs", "logits", logits, FLOAT_TYPES)
    _check("logprobs", "targets", targets, (rows,), (INT32,))
    _check("logprobs", "top_n", top_n, (rows,), (INT32,))
    if width > MAX_LOGPROB_VOCAB:
        raise LimitError(
            f"logprobs: logits {logits.describe()} has rows of {width} tokens; at most {MAX_LOGPROB_VOCAB} are "
            f"supported (one workgroup per row within the loop budget of batchgpu/ops/bounds.py)"
        )
    return (rows, LOGPROB_WIDTH), FLOAT32


def _logprobs_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    return logprobs_reference(*arrays)


def _logprobs_lower(node: Node) -> list[Launch]:
    logits, targets, top_n = node.inputs
    rows, width = logits.shape
    return [
        SAMPLING.launch(
            label="logprobs",
            entry="logprobs",
            types=wgsl_aliases(A=logits.dtype, O=FLOAT32),
            constants=(("IS_FLOAT", True),),  # NaN comes first in argmax's order (lib/best.wgsl)
            groups=rows,
            params=dict(rows=rows, width=width, count=0),
            buffers=dict(logits=logits, ids=targets, top_k=top_n, out=node.output),
            workgroup_bytes=LOGPROBS_WORKGROUP_BYTES,
        )
    ]


LOGPROBS_WORKGROUP_BYTES = 4 * (3 * WORKGROUP + 1)
"""``logprobs``' workgroup memory: the (value, index) tree, the sum tree and the row's rank count."""

LOGPROBS = OpSpec(
    name="logprobs",
    infer=_logprobs_infer,
    reference=_logprobs_reference,
    lower=_logprobs_lower,
    dtypes="float",
    doc="(S, 41) float32 per row of (S, V) logits: the log-softmax at the target id, then the top_n (<= 20) "
    "ids and their log-softmax values (rows with top_n < 0 skipped)",
)


# count_tokens ----------------------------------------------------------------------------------


def _count_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[None, None]:
    counts, slots, ids = inputs[:3]
    rows, _ = _rows_by_vocab("count_tokens", "counts", counts, (INT32,))
    if slots.ndim != 1:
        raise ShapeError(f"count_tokens: slots {slots.describe()} must be 1-D (N,), got shape {slots.shape}")
    _check("count_tokens", "slots", slots, slots.shape, (INT32,))
    _check("count_tokens", "ids", ids, slots.shape, (INT32,))
    if len(inputs) == 4:
        _check("count_tokens", "reset", inputs[3], (rows,), (INT32,))
    return None, None


def _count_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> None:
    counts, slots, ids = arrays[:3]
    rows, width = counts.shape
    if len(arrays) == 4:
        counts[arrays[3] != 0] = 0
    valid = (slots >= 0) & (slots < rows) & (ids >= 0) & (ids < width)
    np.add.at(counts, (slots[valid], ids[valid]), 1)


def _count_lower(node: Node) -> list[Launch]:
    counts, slots, ids = node.inputs[:3]
    rows, width = counts.shape
    params = dict(rows=rows, width=width, count=slots.size)
    types = wgsl_aliases(A=FLOAT32, O=INT32)  # unused by these entries; the module compiles with float logits

    def launch(entry: str, threads: int, **buffers: Tensor) -> Launch:
        groups = groups_for(threads, WORKGROUP)
        return SAMPLING.launch(
            label="count_tokens", entry=entry, types=types, groups=groups, params=params, buffers=buffers
        )

    resets = [launch("count_reset", counts.size, counts=counts, reset=reset) for reset in node.inputs[3:]]
    return [*resets, launch("count_add", slots.size, counts=counts, slots=slots, ids=ids)]


COUNT_TOKENS = OpSpec(
    name="count_tokens",
    infer=_count_infer,
    reference=_count_reference,
    lower=_count_lower,
    inplace=(0,),
    literal_operands=False,  # counts is written in place: a number would silently become a constant
    doc="in place: zero the rows of (S, V) int32 counts where reset != 0 (if given), then add 1 at each valid "
    "(slots, ids)",
)

SPECS: list[OpSpec] = [PENALIZE, SAMPLE, LOGPROBS, COUNT_TOKENS]
