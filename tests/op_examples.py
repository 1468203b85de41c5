"""Example recordings of every op of the op table (``batchgpu.ops.OPS``), for the tests that enumerate it:
every CUDA specialization compiles (tests/test_cuda_compile.py), the browser runs every built-in kernel
(tests/test_export.py), every op has a twin on every executor (tests/test_twins.py).

Elementwise ops get their examples from the op-expression table (a new row needs nothing here); every
other op needs an entry in :data:`EXAMPLES` that records it in each form its lowering distinguishes
(kernel entries, broadcast modes, axes, native and GPU forms), and ``tests/test_twins.py`` fails while
one is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

import batchgpu as bg
from batchgpu import quant
from batchgpu.ops import OPS, bounds
from batchgpu.ops.elementwise import EXPRESSIONS
from batchgpu.scalars import Scalar
from batchgpu.tensor import QuantTensor, Tensor

NOT_BUILTIN = {"launch": "custom kernels carry their own sources (tests/test_custom_kernels.py)"}
"""Ops of the table that run no built-in kernel family."""

QUANT_K = {name: 2 * fmt.weights if fmt.weights > 32 else 64 for name, fmt in quant.FORMATS.items()}
"""K of each block format's examples: two blocks (super-blocks for the K-quants)."""


class Inputs:
    """Input tensors of the examples recorded into ``batch`` for one ``dtype``: all ones (``rng`` None:
    compile coverage, where only the specializations matter) or random values (``rng``: results
    checked against the reference). ``dtypes`` are those of the whole run (cast targets)."""

    def __init__(
        self,
        batch: bg.GpuCommandBatch,
        dtype: type | np.dtype,
        dtypes: tuple[type, ...],
        rng: np.random.Generator | None = None,
    ) -> None:
        self.batch = batch
        self.dtype = np.dtype(dtype)
        self.dtypes = dtypes
        self.rng = rng
        self.scalars: dict[str, int] = {}  # per-execute scalars created, with the value to run them at

    def data(self, *shape: int, positive: bool = False, dtype: type | np.dtype | None = None) -> np.ndarray:
        dtype = np.dtype(dtype or self.dtype)
        if self.rng is None:
            return np.ones(shape, dtype)
        if dtype.kind == "f":
            values = self.rng.uniform(0.5, 2.0, shape) if positive else self.rng.standard_normal(shape)
        elif dtype.kind == "u" or positive:
            values = self.rng.integers(1, 50, shape)
        else:
            values = self.rng.integers(-50, 50, shape)
        return values.astype(dtype)

    def tensor(self, *shape: int, positive: bool = False, dtype: type | np.dtype | None = None) -> Tensor:
        return self.batch.upload(self.data(*shape, positive=positive, dtype=dtype))

    def ids(self, *values: int) -> Tensor:
        return self.batch.upload(np.array(values, np.int32))

    def position(self, op: str, value: int) -> Scalar:
        """A u32 per-execute position scalar, run at ``value``."""
        name = f"{op}_pos_{self.dtype.name}"
        self.scalars[name] = value
        return self.batch.scalar(name)

    def quantized(self, qtype: str, rows: int) -> QuantTensor | None:
        """Quantized (rows, QUANT_K[qtype]) weights: zero blocks for compile coverage; with random values,
        GGUF blocks made by the ``gguf`` package (None without it; zero blocks for the formats it cannot
        quantize, the K-quants)."""
        device = self.batch.device
        fmt, k = quant.FORMATS[qtype], QUANT_K[qtype]
        zeros = np.zeros(rows * k // fmt.weights * fmt.gguf_bytes, np.uint8)
        if self.rng is None:
            return device.quantized(zeros, qtype, (rows, k))
        try:
            from gguf import quants
        except ImportError:
            return None
        kind = getattr(quants.GGMLQuantizationType, qtype.upper())
        weights = self.rng.standard_normal((rows, k)).astype(np.float32)
        try:
            blocks = np.asarray(quants.quantize(weights, kind)).view(np.uint8)
        except NotImplementedError:
            blocks = zeros
        return device.quantized(blocks, qtype, (rows, k), name=qtype)


Example = Callable[[Inputs], list[Tensor]]


def _unary(op: str) -> Example:
    positive = EXPRESSIONS[op].domain == "positive"

    def record(inputs: Inputs) -> list[Tensor]:
        return [getattr(inputs.batch, op)(inputs.tensor(4, 8, positive=positive))]

    return record


def _binary(op: str) -> Example:
    def record(inputs: Inputs) -> list[Tensor]:
        method = getattr(inputs.batch, op)
        x, row = inputs.tensor(4, 8), inputs.tensor(8, positive=True)
        one, col = inputs.tensor(1, positive=True), inputs.tensor(4, 1)
        contiguous = method(x, inputs.tensor(4, 8, positive=True))
        return [contiguous, method(x, row), method(one, x), method(col, row)]  # strided, scalar, both strided

    return record


def _cast(inputs: Inputs) -> list[Tensor]:
    x = inputs.tensor(4, 8, positive=True)  # float to unsigned is undefined for negative values in numpy
    return [inputs.batch.cast(x, target) for target in inputs.dtypes]


def _where(inputs: Inputs) -> list[Tensor]:
    b, x, y = inputs.batch, inputs.tensor(4, 8), inputs.tensor(8)
    flags = inputs.tensor(4, 1, dtype=np.int32)  # any dtype's non-zero is true (random: some zero, some not)
    return [b.where(b.greater(x, y), x, y), b.where(flags, x, 2), b.where(b.less(y, x), 3, y)]


def _reshape(inputs: Inputs) -> list[Tensor]:
    return [inputs.batch.reshape(inputs.tensor(4, 8), (2, 16))]


def _permute(inputs: Inputs) -> list[Tensor]:
    b = inputs.batch
    return [b.transpose(inputs.tensor(4, 8)), b.permute(inputs.tensor(2, 3, 8), (2, 0, 1))]


def _slice(inputs: Inputs) -> list[Tensor]:
    return [inputs.tensor(6, 8)[1:5, ::3]]


def _concat(inputs: Inputs) -> list[Tensor]:
    return [inputs.batch.concat([inputs.tensor(4, 8), inputs.tensor(4, 3)], axis=1)]


def _matmul(inputs: Inputs) -> list[Tensor]:
    b, t = inputs.batch, inputs.tensor
    outs = [
        b.matmul(t(4, 8), t(8, 3)),  # skinny
        b.matmul(t(2, 16, 8), t(8, 5), bias=t(5)),  # tiled, batched, bias
        b.matmul(t(16, 8), t(16, 8), transpose_a=True),
        b.matmul(t(4, 8), t(3, 8), transpose_b=True),  # GPU form: a warp per column
        b.matmul(t(32, 129, 9), t(9, 130)),  # native form: 128 x 128 tiles
    ]
    if inputs.dtype == np.float32:
        for qtype, k in QUANT_K.items():
            w = inputs.quantized(qtype, 6)
            if w is not None:
                outs += [b.matmul(t(3, k), w, transpose_b=True), b.matmul(t(3, k), w, transpose_b=True, bias=t(6))]
                outs.append(b.matmul(t(3, k), w, transpose_b=True, epilogue="swiglu"))  # in the store
                outs.append(b.matmul(t(3, k), w, transpose_b=True, bias=t(6), activation="silu"))
    act = "gelu" if np.dtype(inputs.dtype).kind == "f" else "relu"  # in each form's store
    outs += [
        b.matmul(t(4, 8), t(8, 3), activation=act),
        b.matmul(t(2, 16, 8), t(8, 5), bias=t(5), activation=act),
        b.matmul(t(4, 8), t(3, 8), transpose_b=True, activation=act),
        b.matmul(t(32, 129, 9), t(9, 130), activation=act),
    ]
    if inputs.dtype in (np.float32, np.float16):
        outs.append(b.matmul(t(4, 8), t(6, 8), transpose_b=True, epilogue="swiglu"))  # a second pass
    return outs


def _reduction(op: str) -> Example:
    def record(inputs: Inputs) -> list[Tensor]:
        method, x = getattr(inputs.batch, op), inputs.tensor(4, 8)
        return [method(x), method(x, axis=0), method(x, axis=1), method(inputs.tensor(2, 3, 4), axis=(0, 2))]

    return record


def _softmax(inputs: Inputs) -> list[Tensor]:
    x = inputs.tensor(4, 8)
    return [inputs.batch.softmax(x), inputs.batch.softmax(x, axis=0)]


def _rms_norm(inputs: Inputs) -> list[Tensor]:
    return [inputs.batch.rms_norm(inputs.tensor(4, 8), inputs.tensor(8))]


def _swiglu(inputs: Inputs) -> list[Tensor]:
    return [inputs.batch.swiglu(inputs.tensor(3, 10))]


def _add_rms_norm(inputs: Inputs) -> list[Tensor]:
    return list(inputs.batch.add_rms_norm(inputs.tensor(4, 8), inputs.tensor(4, 8), inputs.tensor(8)))


def _layer_norm(inputs: Inputs) -> list[Tensor]:
    return [inputs.batch.layer_norm(inputs.tensor(4, 8), inputs.tensor(8), inputs.tensor(8))]


def _rope(inputs: Inputs) -> list[Tensor]:
    b, q = inputs.batch, inputs.tensor(2, 4, 8)
    scaled = b.rope(q, inputs.ids(5, 0), 500.0, factors=[1.0, 2.5, 8.0, 3.0])  # Llama 3-style frequency divisors
    return [b.rope(q, inputs.position("rope", 3)), b.rope(q, 1), b.rope(q, inputs.ids(5, 0)), scaled]


def _kv_write(inputs: Inputs) -> list[Tensor]:
    cache = inputs.tensor(16, 2, 8)
    return [inputs.batch.kv_write(cache, inputs.tensor(2, 2, 8), inputs.position("kv_write", 5))]


def _rope_kv_write(inputs: Inputs) -> list[Tensor]:
    b, qkv = inputs.batch, inputs.tensor(3, 8, 6)  # 4 q heads, then 2 k and 2 v heads
    k_cache, v_cache = inputs.tensor(9, 2, 6), inputs.tensor(9, 2, 6)
    q = b.rope_kv_write(qkv, k_cache, v_cache, inputs.position("rope_kv_write", 4))
    pool_k, pool_v = inputs.tensor(7, 2, 6), inputs.tensor(7, 2, 6)  # a paged pool: rows per token, -1 skipped
    factors = [4.0, 1.5, 1.0]
    paged = b.rope_kv_write(qkv, pool_k, pool_v, inputs.ids(9, 0, 3), 500.0, rows=inputs.ids(6, -1, 2), factors=factors)
    return [q, k_cache, v_cache, paged, pool_k, pool_v]


def _attention(inputs: Inputs) -> list[Tensor]:
    b, q, cache = inputs.batch, inputs.tensor(2, 4, 8), inputs.tensor(16, 2, 8)
    long_cache = inputs.tensor(200, 2, 8)  # split into blocks under shrunk bounds
    pos = inputs.position("attention", 6)
    return [
        b.attention(q, cache, cache, pos=pos),
        b.attention(q, cache, cache, pos=1, causal=False),
        b.attention(q, long_cache, long_cache, pos=pos),
    ]


def _scatter_rows(inputs: Inputs) -> list[Tensor]:
    b = inputs.batch
    table, rows = inputs.tensor(6, 2, 4), inputs.ids(4, -1, 0, 6)  # -1 and 6: skipped
    vector = b.scatter_rows(inputs.tensor(5), rows, inputs.tensor(4))
    return [b.scatter_rows(table, rows, inputs.tensor(4, 2, 4)), vector]


def _paged_attention(inputs: Inputs) -> list[Tensor]:
    """One pass over 3 blocks of 4 positions (a block outside the pool, a sequence outside the table); 30 blocks
    of 7 positions in a pool of 211 rows, split over blocks of positions with merge passes under shrunk bounds.
    The float16 run has float32 queries over float16 pools (the mixed form) and float16 over float16."""
    b = inputs.batch
    half = inputs.dtype == np.float16
    q = inputs.tensor(3, 4, 8, dtype=np.float32 if half else None)
    k, v = inputs.tensor(40, 2, 8), inputs.tensor(40, 2, 8)
    tables = b.upload(np.array([[2, 9, 0], [5, -1, 7]], np.int32))
    outs = [b.paged_attention(q, k, v, tables, inputs.ids(0, 1, 5), inputs.ids(12, 11, 4), block_size=4)]
    order = np.random.default_rng(5).permutation(31).astype(np.int32)
    tables = b.upload(np.stack([order[:30], order[1:]]))
    k, v = inputs.tensor(211, 2, 8), inputs.tensor(211, 2, 8)
    seq, lengths = inputs.ids(0, 1, 1), inputs.ids(210, 100, 0)
    outs.append(b.paged_attention(inputs.tensor(3, 4, 8), k, v, tables, seq, lengths, block_size=7))
    return outs


def _embedding(inputs: Inputs) -> list[Tensor]:
    b = inputs.batch
    outs = [b.embedding(inputs.ids(3, 0, 5, 9, 1), inputs.tensor(8, 16))]
    if inputs.dtype == np.float32:
        for qtype in QUANT_K:
            table = inputs.quantized(qtype, 6)
            if table is not None:
                outs.append(b.embedding(inputs.ids(5, 0, 3), table))
    return outs


def _argmax(inputs: Inputs) -> list[Tensor]:
    x = inputs.tensor(4, 8)
    return [inputs.batch.argmax(x), inputs.batch.argmax(x, axis=0)]


def _penalize(inputs: Inputs) -> list[Tensor]:
    b = inputs.batch
    seen, generated = (inputs.tensor(4, 9, dtype=np.int32) for _ in range(2))  # some > 0, some not
    return [b.penalize(inputs.tensor(4, 9), seen, generated, inputs.tensor(4, 3, positive=True, dtype=np.float32))]


def _sample(inputs: Inputs) -> list[Tensor]:
    """Greedy, plain, top_k, top_p and min_p rows in one launch; then with an allowed-token bitmask, every
    row but the plain one masked (params[:, 3]), the last with no token allowed (id -1)."""
    b = inputs.batch
    params = [
        [0.0, 1.0, 0.0, 1.0],
        [1.0, 1.0, 0.0, 0.0],
        [0.8, 0.9, 0.0, 1.0],
        [1.2, 1.0, 0.1, 1.0],
        [1.0, 0.7, 0.05, 1.0],
    ]
    top_k, keys = inputs.ids(0, 0, 5, 0, 40), [[7, i] for i in range(5)]
    settings, seeds = b.upload(np.array(params, np.float32)), b.upload(np.array(keys, np.uint32))
    logits = inputs.tensor(5, 33)
    bits = np.random.default_rng(5).integers(0, 2**32, (5, 2), dtype=np.uint64).astype(np.uint32)
    bits[4] = 0
    allowed = b.upload(bits)
    return [b.sample(logits, settings, top_k, seeds), b.sample(logits, settings, top_k, seeds, allowed)]


def _logprobs(inputs: Inputs) -> list[Tensor]:
    """Rows skipped, asking for no top ids, some, and more than the row has."""
    b = inputs.batch
    return [b.logprobs(inputs.tensor(4, 9), inputs.ids(0, 8, 3, 20), inputs.ids(-1, 0, 3, 20))]


def _count_tokens(inputs: Inputs) -> list[Tensor]:
    if inputs.dtype != np.int32:  # int32 counts only: recorded once per run
        return []
    counts = inputs.tensor(3, 11, positive=True)
    slots, ids = inputs.ids(0, 2, 2, -1, 5, 1, 2), inputs.ids(4, 10, 10, 3, 1, 11, -1)  # duplicates and skips
    return [inputs.batch.count_tokens(counts, slots, ids, inputs.ids(0, 1, 0))]


EXAMPLES: dict[str, Example] = {
    **{op: _unary(op) if row.arity == 1 else _binary(op) for op, row in EXPRESSIONS.items()},
    "cast": _cast,
    "where": _where,
    "reshape": _reshape,
    "permute": _permute,
    "slice": _slice,
    "concat": _concat,
    "matmul": _matmul,
    "sum": _reduction("sum"),
    "max": _reduction("max"),
    "mean": _reduction("mean"),
    "softmax": _softmax,
    "rms_norm": _rms_norm,
    "swiglu": _swiglu,
    "add_rms_norm": _add_rms_norm,
    "layer_norm": _layer_norm,
    "rope": _rope,
    "kv_write": _kv_write,
    "rope_kv_write": _rope_kv_write,
    "attention": _attention,
    "scatter_rows": _scatter_rows,
    "paged_attention": _paged_attention,
    "embedding": _embedding,
    "argmax": _argmax,
    "penalize": _penalize,
    "sample": _sample,
    "logprobs": _logprobs,
    "count_tokens": _count_tokens,
}
"""How to record each built-in op (by op name)."""


def accepts(op: str, dtype: type | np.dtype) -> bool:
    """Whether ``op`` takes inputs of ``dtype``: its spec's dtype class (neg refuses uint32)."""
    dtype = np.dtype(dtype)
    spec = OPS[op]
    if op == "neg" and dtype == np.uint32:
        return False
    return {"all": True, "float": dtype.kind == "f", "signed": dtype.kind in "fi"}[spec.dtypes]


def record_all(
    batch: bg.GpuCommandBatch, dtypes: tuple[type, ...], rng: np.random.Generator | None = None
) -> tuple[list[Tensor], dict[str, int]]:
    """Every built-in op over every dtype of ``dtypes`` it accepts; returns the outputs and the per-execute
    scalars with the values to run them at. A built-in op without an example raises KeyError."""
    outputs: list[Tensor] = []
    scalars: dict[str, int] = {}
    for dtype in dtypes:
        for op in OPS:
            if op in NOT_BUILTIN or not accepts(op, dtype):
                continue
            inputs = Inputs(batch, dtype, dtypes, rng)
            outputs += EXAMPLES[op](inputs)
            scalars.update(inputs.scalars)
    return outputs, scalars


@contextlib.contextmanager
def shrunk_bounds() -> Iterator[None]:
    """Tiny per-invocation work bounds (batchgpu/ops/bounds.py), so that the small shapes of the examples
    take the chunked paths: row pieces, split-K, attention over blocks of rows with merge passes."""
    tiny = {"LOOP_BUDGET": 1, "ROW_CHUNK": 3, "COLUMN_LIMIT": 2, "MATMUL_K_CHUNK": 16, "QUANT_BLOCK_CHUNK": 1}
    saved = {name: getattr(bounds, name) for name in tiny}
    for name, value in tiny.items():
        setattr(bounds, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(bounds, name, value)


def record_fusable_chains(batch: bg.GpuCommandBatch, x: Tensor, y: Tensor) -> list[Tensor]:
    """For every elementwise op accepting ``x``'s dtype, a chain holding it (an op before it, one after: a
    comparison's uint32 mask goes into ``where``; a broadcast ``y`` (x's last axis) as its second operand,
    log's inputs kept positive): what a fused kernel runs, one output per chain (declare them with
    ``batch.outputs`` for them to fuse)."""
    outputs = []
    floats = x.dtype.kind == "f"
    positive_y = batch.add(batch.abs(y), 0.5) if floats else y
    for op, row in EXPRESSIONS.items():
        if not accepts(op, x.dtype):
            continue
        first = batch.add(batch.abs(x), 0.5) if floats else batch.copy(x)
        if row.arity == 1:
            value = getattr(batch, op)(first)
        else:
            value = getattr(batch, op)(first, positive_y if op == "div" else y)
        if row.mask:
            outputs.append(batch.where(value, x, first))
            continue
        outputs.append(batch.add(value, x) if op != "copy" else batch.neg(value) if x.dtype != np.uint32 else value)
    through_half = batch.cast(batch.cast(batch.add(x, x), np.float16), np.float32)  # an intermediate rounded
    outputs.append(batch.cast(through_half, x.dtype) if x.dtype != np.float32 else batch.mul(through_half, 3.0))
    return outputs
