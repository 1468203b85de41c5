"""Elementwise fusion (batchgpu/fusion.py): chains of elementwise ops run as one generated kernel on every
executor, within the per-dtype tolerances of the unfused graph and of the reference; what must stay
unfused stays unfused; profiles name the ops inside a fused kernel; a flag turns fusion off.

The contract between a fused kernel and the unfused graph on one device: integer results are equal;
float results agree within the dtype's tolerance, not bit for bit, because WGSL lets an implementation
fuse a multiply and an add (and reassociate) and NVRTC contracts them by default, so a float32
intermediate inside one kernel may skip the rounding the unfused graph's store gives it; a matmul's
folded epilogue keeps product, bias and activation in float32 (no float16 rounding between them). An
intermediate's float16 rounding is exact everywhere: numpy's, bit for bit (tested on its own below)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import BatchError
from batchgpu.ops.elementwise import EXPRESSIONS
from batchgpu.ops.fused import Apply, Load, program_text, render
from batchgpu.ops.interface import CONTIGUOUS, MAX_FUSED_OPS, SCALAR, STRIDED
from batchgpu.shaders import shader_root

from .conftest import assert_close, random_array
from .op_examples import accepts, record_fusable_chains

Build = Callable[..., Sequence[bg.Tensor]]


def run(
    device: bg.Device, arrays: Sequence[np.ndarray], build: Build, *, fusion: bool = True
) -> tuple[list[np.ndarray], list[str]]:
    """Outputs of ``build`` (declared with batch.outputs) and the ops of each dispatch, one execute."""
    batch = bg.GpuCommandBatch(device, fusion=fusion)
    outputs = list(build(batch, *[batch.upload(a) for a in arrays]))
    batch.outputs(*outputs)
    batch.execute(profile=True)
    return [batch.read(t) for t in outputs], [row.op for row in batch.profile().rows]


def check_fused(
    gpu: bg.Device,
    ref: bg.Device,
    arrays: Sequence[np.ndarray],
    build: Build,
    scale: float = 1.0,
    tolerance: np.dtype | None = None,
) -> list[str]:
    """Fused on ``gpu`` == unfused on ``gpu`` == the reference: integers exactly, floats within the dtype's
    tolerance (the module doc's contract; ``scale`` widens it for sums; ``tolerance``: the float results'
    tolerance is this dtype's instead); returns the fused run's ops."""
    fused, ops = run(gpu, arrays, build)
    unfused, unfused_ops = run(gpu, arrays, build, fusion=False)
    expected, _ = run(ref, arrays, build, fusion=False)
    assert not any(op.startswith("fused(") for op in unfused_ops)
    for got, plain, want in zip(fused, unfused, expected):
        dtype = tolerance if tolerance is not None and want.dtype.kind == "f" else None
        assert_close(got, plain, dtype, scale=scale)
        assert_close(got, want, dtype, scale=scale)
    return ops


# every op of the op-expression table inside a fused kernel, per dtype -----------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.uint32], ids=lambda d: np.dtype(d).name)
def test_every_elementwise_op_inside_a_fused_kernel(gpu, ref, dtype):
    rng = np.random.default_rng(1)
    arrays = [random_array(rng, (3, 37), dtype), random_array(rng, (37,), dtype)]
    ops = check_fused(gpu, ref, arrays, lambda b, x, y: record_fusable_chains(b, x, y))
    wanted = [*sorted(op for op in EXPRESSIONS if accepts(op, dtype)), "where"]
    inside = {name for op in ops if op.startswith("fused(") for name in op[6:-1].split("+")}
    assert set(wanted) <= inside, f"not fused: {set(wanted) - inside}"


# float16 rounding of an intermediate -----------------------------------------------------------------


FLOAT16_SPECIAL_BITS = """0 1 2 3 4 7fffff 400000 c000000 32ffffff 33000000 33000001 477fefff 477ff000 477ff001
47800000 4f000000 7f7fffff 7f800000 7f800001 7f801fff 7f802000 7fa00000 7fc00000 7fffffff"""
"""float32 bit patterns (magnitudes) rounding to float16 in special ways: subnormals, the tie at 2^-25 (to 0),
the tie at 65520 (to inf), far past it, inf, NaNs (0x7f800001: a payload float16 cannot hold)."""


def float16_rounding_cases() -> np.ndarray:
    """float32 values around every boundary of rounding to float16, both signs: each float16 value and
    each midpoint between neighbours (ties, to even), from 2 float32 ulps below to 2 above (subnormals,
    the smallest normal, every binade, 65504 .. the tie at 65520 that rounds to inf), float32 subnormals,
    values far below 2^-25 and far above 65520, inf, NaNs of several payloads, and random bit patterns."""
    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # every finite >= 0
    neighbours = np.append(halves[1:], 65536.0)  # past 65504, the next value would be 2^16
    anchors = np.concatenate([halves, (halves + neighbours) / 2]).astype(np.float32).view(np.uint32)
    near = (anchors[:, None].astype(np.int64) + np.arange(-2, 3)).ravel()
    specials = [int(bits, 16) for bits in FLOAT16_SPECIAL_BITS.split()]
    random = np.random.default_rng(11).integers(0, 1 << 31, 100_000)
    magnitudes = np.concatenate([near[near >= 0], specials, random]).astype(np.uint32)
    return np.concatenate([magnitudes, magnitudes | np.uint32(0x80000000)]).view(np.float32)


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bit patterns (the sign of zero included); where numpy gives NaN, any NaN."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"{what}: NaN where numpy has none, or none")
    bits, expected = got.view(f"u{got.itemsize}")[~nan], want.view(f"u{want.itemsize}")[~nan]
    wrong = np.flatnonzero(bits != expected)
    assert not wrong.size, (
        f"{what}: {wrong.size} of {bits.size} differ, e.g. {[hex(b) for b in bits[wrong[:4]]]} where numpy has "
        f"{[hex(b) for b in expected[wrong[:4]]]}"
    )


def test_float16_rounding_inside_a_fused_kernel_is_numpys_bit_for_bit(gpu, ref):
    """An intermediate float16 inside a fused kernel holds what numpy's ``astype(np.float16)`` gives, bit
    for bit, for every float32 input: ties to even, subnormals, overflow to inf from 65520 up, -0.0 and
    the signs; NaN stays NaN (its payload is not specified). A float16 output stores that value."""
    x = float16_rounding_cases()
    with np.errstate(over="ignore"):  # numpy warns of the casts to inf
        half = x.astype(np.float16)
        for device in (gpu, ref):
            (through_half, negated), ops = run(
                device, [x], lambda b, t: [b.cast(b.cast(t, np.float16), np.float32), b.neg(b.cast(t, np.float16))]
            )
            assert ops == ["fused(cast+cast)", "fused(cast+neg)"], ops
            assert_bits_equal(through_half, half.astype(np.float32), f"{device.kind}: float32 -> float16 -> float32")
            assert_bits_equal(negated, -half, f"{device.kind}: -(float32 -> float16)")


def test_an_intermediates_float16_rounding_is_no_conversion_pair_a_compiler_may_fold():
    """Contract of the generated code: rounding an intermediate to float16 never relies on converting to
    float16 and back, which a compiler may fold to nothing (NVIDIA's Vulkan compiler does: WGSL leaves
    the rounding direction of a conversion to the implementation, and lets it compute more precisely).
    WGSL rounds with ``round_f16`` (shaders/wgsl/lib/half.wgsl: integer arithmetic on the float32 bits,
    which no compiler may change); CUDA with ``bg_round_f16`` (shaders/cuda/prelude.cuh: PTX's explicit
    ``cvt.rn.f16.f32`` in inline assembly, or a C cast to ``_Float16`` on HIP, which C requires to round).
    The generated text holds no float16 conversion at all; the output's store is the kernel's own."""
    f16_ops = [
        [Load(0, "f32", CONTIGUOUS), Apply("cast", (0,), "f32", "f16"), Apply("cast", (1,), "f32", "f32")],
        [
            Load(0, "f32", CONTIGUOUS),
            Load(1, "f32", SCALAR),
            Apply("add", (0, 1), "f32", "f16"),
            Apply("tanh", (2,), "f32", "f16"),
            Apply("neg", (3,), "f32", "f16"),
        ],
        [
            Load(0, "u32", CONTIGUOUS),
            Load(1, "f32", STRIDED),
            Apply("where_u32", (0, 1, 1), "f32", "f16"),
            Apply("cast", (2,), "i32", "i32"),
        ],
    ]
    for program in f16_ops:
        text = program_text(program)
        wgsl = render("FUNCTIONS", text, "wgsl") + render("BODY", text, "wgsl")
        cuda = render("FUNCTIONS", text, "cuda") + render("BODY", text, "cuda")
        rounded = sum(isinstance(i, Apply) and i.stype == "f16" for i in program[:-1])
        assert re.search(r"(?<!\w)f16\b", wgsl) is None, wgsl
        assert "bg_half" not in cuda, cuda
        assert wgsl.count("round_f16(") == rounded and cuda.count("bg_round_f16(") == rounded, (wgsl, cuda)
    library = (shader_root() / "wgsl" / "lib" / "half.wgsl").read_text()
    assert re.search(r"(?<!\w)f16\b", re.sub(r"//.*", "", library)) is None  # no float16 type or conversion
    prelude = (shader_root() / "cuda" / "prelude.cuh").read_text()
    assert re.search(r"bg_round_f16\(float \w+\) \{ return bg_h2f\(bg_f2h\(", prelude), "bg_round_f16 changed"
    assert 'asm("cvt.rn.f16.f32' in prelude


# random graphs ------------------------------------------------------------------------------------

FLOAT_OPS = ["neg", "abs", "tanh", "sigmoid", "relu", "gelu", "gelu_tanh", "silu", "copy"]
FLOAT_BINARY = ["add", "sub", "mul", "maximum", "minimum", "silu_mul"]
INT_OPS = ["abs", "relu", "copy", "neg"]
INT_BINARY = ["add", "sub", "mul", "maximum", "minimum"]
EXACT = {"neg", "abs", "relu", "copy", "add", "sub", "maximum", "minimum"}  # no rounding beyond the dtype's
SHAPES = [(1,), (7,), (3, 5), (2, 3, 11), (257,), (4, 1, 67), (5, 131)]


def random_graph(seed: int) -> tuple[list[np.ndarray], Build, bool]:
    """Random inputs and a random graph of elementwise ops over them: broadcast operands, Python scalars,
    casts between dtypes, comparisons into ``where``, values read twice, a declared intermediate; and
    whether the graph rounds an inexactly computed float32 value to float16 (which can land one float16
    ulp apart where that value differs in its last bits: a driver fusing a multiply and an add, the
    reference's tanh): such graphs compare with float16's tolerance."""
    rng = np.random.default_rng(seed)
    shape = SHAPES[rng.integers(len(SHAPES))]
    dtype = np.dtype([np.float32, np.float32, np.float16, np.int32, np.uint32][rng.integers(5)])
    broadcast = tuple(1 if rng.random() < 0.5 else s for s in shape)[int(rng.integers(len(shape))) :] or (1,)
    arrays = [random_array(rng, shape, dtype), random_array(rng, broadcast, dtype), random_array(rng, shape, dtype)]
    choices = rng.random(64).tolist()
    picks = rng.integers(0, 1 << 30, 64).tolist()
    through_half = []  # one entry per inexact float32 value cast to float16

    def build(batch: bg.GpuCommandBatch, *inputs: bg.Tensor) -> list[bg.Tensor]:
        through_half.clear()
        pool: list[tuple[bg.Tensor, bool]] = [(t, True) for t in inputs]  # (tensor, exact so far)
        kept: list[bg.Tensor] = []
        for step in range(int(4 + picks[0] % 9)):
            roll, pick = choices[step], picks[step + 1]
            x, exact = pool[-1] if roll < 0.6 else pool[pick % len(pool)]
            floats = x.dtype.kind == "f"
            if roll > 0.9:  # a cast, and back where the dtype's ops need it
                pool.append(_cast(batch, x, exact))
                if x.dtype == np.float32 and not exact:
                    through_half.append(x)
                continue
            unary = (FLOAT_OPS if floats else INT_OPS) if (pick >> 3) % 2 else None
            if x.dtype == np.uint32 and unary:
                unary = [op for op in unary if op != "neg"]
            if unary:
                op = unary[(pick >> 5) % len(unary)]
                pool.append((getattr(batch, op)(x), exact and op in EXACT))
                continue
            binary = FLOAT_BINARY if floats else INT_BINARY
            op = binary[(pick >> 5) % len(binary)]
            partners = [(t, e) for t, e in pool if t.dtype == x.dtype and t.ndim <= x.ndim + 1]
            y, y_exact = partners[(pick >> 9) % len(partners)] if (pick >> 7) % 4 else (3 if not floats else 0.5, True)
            if roll > 0.8:  # a comparison's mask into where: the larger of the two (continuous where they flip)
                pool.append((batch.where(x > y, x, y), exact and y_exact))
                continue
            result = getattr(batch, op)(x, y)
            pool.append((result, exact and y_exact and op in EXACT))
            if (pick >> 13) % 7 == 0:
                kept.append(result)
        return [pool[-1][0], *kept]

    recording = bg.GpuCommandBatch(bg.Device("reference"))
    build(recording, *[recording.upload(a) for a in arrays])  # records only: what the graph holds
    return arrays, build, bool(through_half)


def _cast(batch: bg.GpuCommandBatch, x: bg.Tensor, exact: bool) -> tuple[bg.Tensor, bool]:
    if x.dtype == np.float32:
        if exact:  # truncating an exactly computed float gives the same integer everywhere
            return batch.cast(batch.cast(x, np.int32), np.float32), True
        return batch.cast(x, np.float16), exact
    if x.dtype == np.float16:
        return batch.cast(x, np.float32), exact
    return batch.cast(batch.cast(x, np.float32), x.dtype), exact


@pytest.mark.parametrize("seed", range(16))
def test_random_graphs_fused_unfused_and_reference_agree(gpu, ref, seed):
    arrays, build, through_half = random_graph(seed)
    check_fused(gpu, ref, arrays, build, tolerance=np.dtype(np.float16) if through_half else None)


def test_random_graphs_do_fuse(ref):
    """Most random graphs hold a chain: the property tests above exercise fused kernels."""
    fused = sum(any(op.startswith("fused(") for op in run(ref, *random_graph(seed)[:2])[1]) for seed in range(16))
    assert fused >= 12


# what fuses and what does not ------------------------------------------------------------------------


def _chain(batch: bg.GpuCommandBatch, x: bg.Tensor, y: bg.Tensor) -> list[bg.Tensor]:
    return [batch.maximum(batch.neg(batch.silu(batch.add(batch.mul(x, y), 2.0))), x)]


def test_a_chain_is_one_dispatch_named_after_its_ops(gpu, tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((3, 5), dtype=np.float32), rng.standard_normal(5, dtype=np.float32)
    for fusion, dispatches in ((True, 1), (False, 5)):
        batch = bg.GpuCommandBatch(gpu, fusion=fusion)
        (out,) = _chain(batch, batch.upload(x), batch.upload(y))
        batch.outputs(out)
        batch.execute()
        before = gpu.stats.dispatches
        batch.execute(profile=True)
        assert gpu.stats.dispatches - before == dispatches
        expected = np.maximum(-((x * y + 2) / (1 + np.exp(-(x * y + 2)))), x)
        np.testing.assert_allclose(batch.read(out), expected, rtol=1e-5, atol=1e-6)
    batch = bg.GpuCommandBatch(gpu)
    (out,) = _chain(batch, batch.upload(x), batch.upload(y))
    batch.outputs(out)
    batch.execute(profile=True)
    profile = batch.profile()
    (row,) = profile.rows
    assert row.op == "fused(mul+add+silu+neg+maximum)" and row.kernel == "fused.fused"
    if profile.gpu_spans or profile.op_host_spans:  # the trace's op track (not on the CUDA CPU harness)
        trace = json.loads(batch.save_trace(tmp_path / "trace.json").read_text())
        assert any("fused(mul+add+silu+neg+maximum)" in json.dumps(event) for event in trace["traceEvents"])


def test_the_environment_turns_fusion_off(gpu, monkeypatch):
    monkeypatch.setenv("BATCHGPU_FUSION", "off")
    x = np.arange(1, 16, dtype=np.float32).reshape(3, 5)
    _, ops = run(gpu, [x, x[0]], _chain)
    assert ops == ["mul", "add", "silu", "neg", "maximum"]


def test_without_declared_outputs_every_tensor_stays_readable(gpu):
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5)
    batch = bg.GpuCommandBatch(gpu)
    t = batch.mul(batch.upload(x), 3.0)
    out = batch.relu(batch.add(t, 1.0))
    batch.execute()
    np.testing.assert_allclose(batch.read(t), x * 3)
    np.testing.assert_allclose(batch.read(out), np.maximum(x * 3 + 1, 0))


def test_a_fused_intermediate_is_not_readable_and_a_declared_one_is(gpu):
    x = np.linspace(-2, 2, 15, dtype=np.float32).reshape(3, 5)
    batch = bg.GpuCommandBatch(gpu)
    a = batch.mul(batch.upload(x), 3.0)
    b = batch.add(a, 1.0)
    kept = batch.neg(b)
    out = batch.relu(batch.sub(kept, 0.5))
    batch.outputs(out, kept)
    batch.execute(profile=True)
    assert [row.op for row in batch.profile().rows] == ["fused(mul+add+neg)", "fused(sub+relu)"]
    np.testing.assert_allclose(batch.read(kept), -(x * 3 + 1), rtol=1e-6)
    np.testing.assert_allclose(batch.read(out), np.maximum(-(x * 3 + 1) - 0.5, 0), rtol=1e-6)
    with pytest.raises(BatchError, match=r"read: .*add\d+.* is an intermediate .*runs fused"):
        batch.read(b)
    np.testing.assert_allclose(batch.read(out), np.maximum(-(x * 3 + 1) - 0.5, 0), rtol=1e-6)  # still works


def test_a_value_read_twice_or_broadcast_is_not_absorbed(gpu, ref):
    rng = np.random.default_rng(3)
    x, row = rng.standard_normal((4, 6), dtype=np.float32), rng.standard_normal(6, dtype=np.float32)

    def build(batch, x, row):
        shared = batch.tanh(x)  # read by two ops: computed once
        small = batch.add(row, 1.0)  # (6,) read broadcast by a (4, 6) op: stays its own kernel
        return [batch.add(batch.mul(shared, small), batch.sigmoid(shared))]

    ops = check_fused(gpu, ref, [x, row], build)
    assert ops.count("tanh") == 1 and "add" in ops and len(ops) == 3, ops


def test_an_input_written_in_place_between_a_chains_ops_stops_the_chain(gpu, ref):
    """mul reads the cache before kv_write overwrites it: running mul inside the later add would read
    the new rows."""
    rng = np.random.default_rng(4)
    old, new = rng.standard_normal((4, 2, 8), dtype=np.float32), rng.standard_normal((4, 2, 8), dtype=np.float32)
    for device in (gpu, ref):
        cache = device.tensor(old)
        batch = bg.GpuCommandBatch(device)
        doubled = batch.mul(cache, 2.0)
        batch.kv_write(cache, batch.upload(new), 0)
        out = batch.add(doubled, 1.0)
        batch.outputs(out)
        batch.execute()
        np.testing.assert_allclose(batch.read(out), old * 2 + 1, rtol=1e-6)


def test_a_chain_over_more_inputs_than_one_kernel_binds_is_split(gpu, ref):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(33, dtype=np.float32) for _ in range(9)]

    def build(batch, *inputs):
        total = inputs[0]
        for t in inputs[1:]:
            total = batch.add(total, t)
        return [batch.relu(total)]

    ops = check_fused(gpu, ref, arrays, build)
    assert len(ops) == 2 and all(op.startswith("fused(") for op in ops), ops


@pytest.mark.slow
def test_fused_chain_above_one_dispatch_limit(gpu):
    """Fused kernels with more workgroups than one grid dimension allows, with a broadcast input: an
    elementwise chain, and ``where`` over a comparison."""
    n = gpu.limits.max_compute_workgroups_per_dimension * 256 + 999
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n // 3, 3), dtype=np.float32)
    w = rng.standard_normal(3, dtype=np.float32)
    (out, picked), ops = run(
        gpu, [x, w], lambda b, x, w: [b.add(b.relu(b.mul(x, w)), 1.5), b.where(x > w, x, b.mul(w, 2.0))]
    )
    assert ops == ["fused(mul+relu+add)", "mul", "fused(greater+where)"], ops
    np.testing.assert_array_equal(out, np.maximum(x * w, 0) + np.float32(1.5))
    np.testing.assert_array_equal(picked, np.where(x > w, x, w * np.float32(2.0)))


# matmul epilogues ---------------------------------------------------------------------------------

MATMUL_SHAPES = {
    "gemv": ((1, 40), (33, 40), True),  # b stored (N, K): GPUs run a warp per output
    "skinny": ((5, 37), (37, 29), False),
    "tiled": ((70, 24), (24, 130), False),
    "batched": ((2, 9, 40), (40, 33), False),
}


@pytest.mark.parametrize("form", sorted(MATMUL_SHAPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32], ids=lambda d: np.dtype(d).name)
def test_bias_and_activation_fold_into_the_matmul(gpu, ref, form, dtype):
    """The folded epilogue against the unfused matmul, add and activation: integers equal, floats within ten
    times the dtype's tolerance (sums of 24 to 40 products; the epilogue keeps product, bias and activation
    in float32, where the unfused graph stores a float16 product and sum)."""
    a_shape, b_shape, transpose_b = MATMUL_SHAPES[form]
    rng = np.random.default_rng(7)
    n = b_shape[0] if transpose_b else b_shape[-1]
    arrays = [random_array(rng, a_shape, dtype), random_array(rng, b_shape, dtype), random_array(rng, (n,), dtype)]
    if dtype == np.int32:
        arrays = [np.clip(x, -20, 20) for x in arrays]  # no int32 overflow in the products
    activation = "gelu" if np.dtype(dtype).kind == "f" else "relu"

    def build(batch, a, b, bias):
        product = batch.matmul(a, b, transpose_b=transpose_b)
        first = getattr(batch, activation)(batch.add(bias, product))  # the bias on either side of the add
        second = batch.neg(batch.matmul(a, b, transpose_b=transpose_b))
        return [first, second]

    ops = check_fused(gpu, ref, arrays, build, scale=10)  # sums of 24 to 40 products
    assert ops == [f"fused(matmul+add+{activation})", "fused(matmul+neg)"], ops


def test_bias_and_activation_fold_into_a_quantized_gemv(gpu, ref):
    quants = pytest.importorskip("gguf.quants", reason="the gguf package makes the blocks")
    blocks = quants.quantize(
        np.random.default_rng(10).standard_normal((6, 64)).astype(np.float32), quants.GGMLQuantizationType.Q8_0
    )
    rng = np.random.default_rng(8)
    x, bias = rng.standard_normal((3, 64), dtype=np.float32), rng.standard_normal(6, dtype=np.float32)
    results = {}
    for device in (gpu, ref):
        w = device.quantized(blocks, "q8_0", (6, 64))
        for fusion in (True, False):
            batch = bg.GpuCommandBatch(device, fusion=fusion)
            y = batch.silu(batch.add(batch.matmul(batch.upload(x), w, transpose_b=True), batch.upload(bias)))
            batch.outputs(y)
            batch.execute(profile=True)
            results[device.kind, fusion] = batch.read(y)
            first = batch.profile().rows[0].op
            assert first == ("fused(matmul+add+silu)" if fusion else "matmul")
    for value in results.values():
        assert_close(value, results["reference", False], scale=10)


def test_what_keeps_a_matmul_epilogue_out(gpu, ref, small_bounds):
    """Split-K (two launches), a bias computed after the matmul, a product read twice: nothing folds into
    the matmul (the elementwise ops still fuse among themselves), and the numbers hold."""
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((3, 100), dtype=np.float32), rng.standard_normal((100, 7), dtype=np.float32)
    small = rng.standard_normal((3, 20), dtype=np.float32)
    row = rng.standard_normal(7, dtype=np.float32)

    def build(batch, a, b, small, row):
        split = batch.relu(batch.add(batch.matmul(a, b), row))  # K=100 over MATMUL_K_CHUNK=32: split-K
        product = batch.matmul(small, batch.slice(b, (slice(0, 20),)))
        late = batch.mul(row, 2.0)  # recorded after the product: the matmul may not read it
        after = batch.add(product, late)
        twice = batch.matmul(small, batch.slice(b, (slice(20, 40),)))
        return [split, after, batch.add(batch.tanh(twice), twice)]

    ops = check_fused(gpu, ref, [a, b, small, row], build, scale=10)
    assert "fused(add+relu)" in ops and not any(op.startswith("fused(matmul") for op in ops), ops


# Python constants inside a fused kernel ----------------------------------------------------------------


def dispatches_per_execute(device: bg.Device, batch: bg.GpuCommandBatch, feeds=None) -> int:
    """Dispatches of one execute of ``batch`` (planned and compiled by an execute before)."""
    batch.execute(feeds)
    before = device.stats.dispatches
    batch.execute(feeds)
    return device.stats.dispatches - before


def add_mul_chain(batch: bg.GpuCommandBatch, t: bg.Tensor, ops: int) -> bg.Tensor:
    """``ops`` alternating ``add(t, 0.001)`` / ``mul(t, 0.999)``: a Python constant per op."""
    for k in range(ops):
        t = batch.add(t, 0.001) if k % 2 == 0 else batch.mul(t, 0.999)
    return t


def add_mul_numpy(x: np.ndarray, ops: int) -> np.ndarray:
    """numpy's float32 sequence of :func:`add_mul_chain`: each op rounded to float32."""
    for k in range(ops):
        x = x + np.float32(0.001) if k % 2 == 0 else x * np.float32(0.999)
    return x


def test_a_thousand_op_chain_with_constants_runs_in_at_most_four_dispatches(gpu, ref):
    """No outputs declared: the chain fuses by default, and its 1000 constants live in the kernels' params
    (at most 256 a kernel), not in input buffers (6 a kernel). The reference computes member by member
    in numpy: exactly numpy's sequence. A GPU rounds each f32 add and multiply correctly, but WGSL (section
    15.7.2: an implementation may fuse and reassociate operations) and NVRTC (contraction by default) may
    turn a multiply and the add after it into one rounding: there the contract is one float32 ulp per op of
    the chain, at most, of the largest value (the chain's map shrinks differences: it multiplies by 0.999)."""
    rng = np.random.default_rng(20)
    x = rng.standard_normal((3, 129), dtype=np.float32)
    want = add_mul_numpy(x, 1000)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        out = add_mul_chain(batch, batch.upload(x), 1000)
        dispatches = dispatches_per_execute(device, batch)
        assert dispatches <= 4, f"{device.kind}: {dispatches} dispatches"
        got = batch.read(out)
        if device is ref:
            np.testing.assert_array_equal(got, want)
        else:
            bound = 1000 * np.spacing(np.float32(np.abs(want).max() + 1))
            np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    unfused = bg.GpuCommandBatch(ref, fusion=False)
    add_mul_chain(unfused, unfused.upload(x), 1000)
    assert dispatches_per_execute(ref, unfused) == 1000


SPECIAL_CONSTANTS = {
    "float32": [np.nan, np.inf, -np.inf, -0.0, 1e-40, -1e-45, 0.1, 3.4e38, 2.5],
    "float16": [np.nan, np.inf, -np.inf, -0.0, 6e-8, -3e-5, 0.1, 65504.0, 2.5],
    "int32": [-(2**31), 2**31 - 1, -1, 0, 7],
    "uint32": [0, 1, 2**31, 2**32 - 1, 7],
}
"""Constants whose bits a fused kernel must keep: NaN, infinities, -0.0, subnormals of float32 (1e-40,
-1e-45) and of float16 (6e-8, -3e-5), values float16 or float32 round (0.1, 3.4e38), the integer types'
extremes."""


@pytest.mark.parametrize("dtype", sorted(SPECIAL_CONSTANTS))
def test_constants_of_every_dtype_inside_a_fused_kernel(gpu, ref, dtype):
    """``where(x > t, x, c)`` (greater + where: one kernel reading the constants t and c from its params)
    gives numpy's result bit for bit, on every executor: the constant reaches the kernel as the bits the
    unfused op reads from its buffer (float16 as numpy rounds the Python number, NaN any NaN). Arithmetic
    with the small finite ones agrees with the reference within the dtype's tolerance (WGSL does not specify
    arithmetic that overflows or meets infinities and NaNs; a GPU may flush a subnormal operand of an add
    or multiply to zero, which the tolerance covers)."""
    rng = np.random.default_rng(21)
    x = random_array(rng, (4, 33), dtype)
    threshold = np.asarray(x.flat[5], dtype)  # about half the elements pick the constant
    for c in SPECIAL_CONSTANTS[dtype]:
        for device in (gpu, ref):
            batch = bg.GpuCommandBatch(device)
            t = batch.upload(x)
            picked = batch.where(batch.greater(t, threshold.item()), t, c)
            small = dtype[0] != "f" or (np.isfinite(c) and abs(c) <= 100)  # integers wrap, as numpy's
            mixed = batch.sub(batch.mul(batch.add(t, c), 3), c) if small else None
            batch.execute(profile=True)
            assert batch.profile().rows[0].op == "fused(greater+where)"
            want = np.where(x > threshold, x, np.asarray(c, dtype))
            assert_bits_equal(batch.read(picked), want, f"{device.kind} where(x > t, x, {c!r})")
            if mixed is not None:
                constant, three = np.asarray(c, dtype), np.asarray(3, dtype)
                expected = ((x + constant).astype(dtype) * three).astype(dtype) - constant
                assert_close(batch.read(mixed), expected.astype(dtype))


def test_distinct_constants_share_one_pipeline(gpu):
    """A chain's program names its constants' slots, never their values: a chain recorded again with other
    constants compiles nothing."""
    x = np.random.default_rng(22).standard_normal((2, 17), dtype=np.float32)
    compiled = []
    for k in [0.5, 3.0, -0.0, np.nan, 1e-40, 7.25]:
        batch = bg.GpuCommandBatch(gpu)
        out = batch.maximum(batch.add(batch.mul(batch.upload(x), k), 1.0), -1.0)
        batch.execute()
        with np.errstate(invalid="ignore"):
            want = np.maximum(x * np.float32(k) + np.float32(1.0), np.float32(-1.0))
        assert_bits_equal(batch.read(out), want.astype(np.float32), f"k = {k}")
        compiled.append(gpu.stats.pipelines_compiled)
    assert compiled[1:] == compiled[:1] * (len(compiled) - 1), compiled


def test_constants_do_not_count_as_a_kernels_inputs(gpu, ref):
    """Six tensors and a constant per op: one kernel (constants are params, the six its input buffers);
    seven tensors: two."""
    rng = np.random.default_rng(23)
    arrays = [rng.standard_normal(41, dtype=np.float32) for _ in range(7)]

    def build(count):
        def chain(batch, *inputs):
            total = batch.mul(inputs[0], 0.5)
            for k, t in enumerate(inputs[1:count]):
                total = batch.add(batch.mul(total, 1.0 + k / 8), t)
            return [batch.sub(total, 0.25)]

        return chain

    one = "fused(" + "+".join(["mul"] + ["mul", "add"] * 5 + ["sub"]) + ")"
    assert check_fused(gpu, ref, arrays[:6], build(6)) == [one]
    assert len(check_fused(gpu, ref, arrays, build(7))) == 2


def test_a_constant_an_op_writes_stays_a_buffer(gpu, ref):
    """A size-1 constant written in place (scatter_rows) before the chain reads it: the chain reads the
    written value from its buffer, not the recorded one."""
    x = np.random.default_rng(28).standard_normal((3, 11), dtype=np.float32)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        table = batch.full((1,), 2.0)
        batch.scatter_rows(table, batch.upload(np.zeros(1, np.int32)), batch.upload(np.full(1, 5.0, np.float32)))
        out = batch.mul(batch.add(batch.upload(x), table), 3.0)
        batch.outputs(out)
        batch.execute(profile=True)
        assert [row.op for row in batch.profile().rows] == ["scatter_rows", "fused(add+mul)"]
        np.testing.assert_allclose(batch.read(out), (x + 5) * 3, rtol=1e-6)


def test_a_chain_past_the_ops_bound_is_split(ref):
    batch = bg.GpuCommandBatch(ref)
    x = np.random.default_rng(29).standard_normal(7, dtype=np.float32)
    t = batch.upload(x)
    for _ in range(MAX_FUSED_OPS + 3):
        t = batch.neg(t)
    batch.execute(profile=True)
    assert [len(row.op.split("+")) for row in batch.profile().rows] == [MAX_FUSED_OPS, 3]
    np.testing.assert_array_equal(batch.read(t), -x)


# fusion and buffer sharing by default ---------------------------------------------------------------------


def two_chains(batch: bg.GpuCommandBatch, x: bg.Tensor, y: bg.Tensor) -> dict[str, bg.Tensor]:
    """Two sinks, each the end of a chain; ``middle`` an intermediate of the first."""
    middle = batch.add(batch.exp(batch.mul(x, 0.5)), y)
    first = batch.neg(batch.tanh(middle))
    second = batch.relu(batch.sub(x, y))
    return {"middle": middle, "first": first, "second": second}


def two_chains_numpy(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    middle = np.exp(x * np.float32(0.5)) + y
    return {"middle": middle, "first": -np.tanh(middle), "second": np.maximum(x - y, 0)}


def test_without_declared_outputs_chains_fuse_and_every_sink_is_readable(gpu, ref):
    rng = np.random.default_rng(24)
    x, y = rng.standard_normal((5, 19), dtype=np.float32), rng.standard_normal(19, dtype=np.float32)
    want = two_chains_numpy(x, y)
    for device in (gpu, ref):
        for fusion in (True, False):
            batch = bg.GpuCommandBatch(device, fusion=fusion)
            got = two_chains(batch, batch.upload(x), batch.upload(y))
            assert dispatches_per_execute(device, batch) == (2 if fusion else 7)
            for name in ("first", "second"):
                assert_close(batch.read(got[name]), want[name])


def test_without_declared_outputs_intermediates_share_buffers(gpu, ref):
    """Softmaxes (no fusion): their intermediates share buffers, and one read after the execute still gives its
    value (the execute runs again keeping it); fusion=False keeps a buffer per tensor."""
    x = np.random.default_rng(27).standard_normal((6, 31), dtype=np.float32)
    steps = [x]
    for _ in range(4):
        e = np.exp(steps[-1] - steps[-1].max(axis=-1, keepdims=True))
        steps.append(e / e.sum(axis=-1, keepdims=True))
    for device in (gpu, ref):
        for fusion in (True, False):
            batch = bg.GpuCommandBatch(device, fusion=fusion)
            tensors = [batch.upload(x)]
            for _ in range(4):
                tensors.append(batch.softmax(tensors[-1]))
            batch.execute()
            memory = batch.memory()
            assert (memory["planned"] < memory["unshared"]) == fusion, memory
            assert_close(batch.read(tensors[4]), steps[4])
            assert_close(batch.read(tensors[2]), steps[2])


def test_reading_a_fused_away_intermediate_replans_keeping_it(gpu, ref, caplog):
    """Read after the latest execute, an intermediate that execute fused away is computed again: the batch
    is planned anew keeping it, and the latest execute (its inputs and scalars) runs again, once, with a
    debug log; later executes keep it."""
    rng = np.random.default_rng(25)
    x1, x2, y = (rng.standard_normal(shape, dtype=np.float32) for shape in ((5, 19), (5, 19), (19,)))
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        x = batch.upload(x1)
        got = two_chains(batch, x, batch.upload(y))
        first = batch.execute({x: x1})
        batch.execute({x: x2})
        assert dispatches_per_execute(device, batch, {x: x2}) == 2
        with caplog.at_level(logging.DEBUG, logger="batchgpu"):
            assert_close(batch.read(got["middle"]), two_chains_numpy(x2, y)["middle"])
            assert_close(batch.read(got["middle"]), two_chains_numpy(x2, y)["middle"])
            assert_close(batch.read(got["first"]), two_chains_numpy(x2, y)["first"])
            assert_close(first.read(got["first"]), two_chains_numpy(x1, y)["first"])  # its own execute's value
            assert dispatches_per_execute(device, batch, {x: x1}) == 3  # middle is stored now
            assert_close(asyncio.run(batch.read_async(got["middle"])), two_chains_numpy(x1, y)["middle"])
        replans = [r for r in caplog.records if "fused away" in r.getMessage()]
        assert len(replans) == 1 and "add" in replans[0].getMessage(), [r.getMessage() for r in replans]
        caplog.clear()


def test_a_fused_away_intermediate_read_after_recording_more_waits_for_the_next_execute(gpu):
    """The latest execute cannot run again once the batch recorded more: the read says so, and the next
    execute keeps the tensor."""
    rng = np.random.default_rng(26)
    x, y = rng.standard_normal((5, 19), dtype=np.float32), rng.standard_normal(19, dtype=np.float32)
    batch = bg.GpuCommandBatch(gpu)
    got = two_chains(batch, batch.upload(x), batch.upload(y))
    batch.execute()
    later = batch.exp(got["second"])
    with pytest.raises(BatchError, match=r"read: .*add\d+.* fused away .*recorded .* execute again"):
        batch.read(got["middle"])
    assert_close(batch.read(got["first"]), two_chains_numpy(x, y)["first"])  # the batch still works
    batch.execute()
    assert_close(batch.read(got["middle"]), two_chains_numpy(x, y)["middle"])
    assert_close(batch.read(later), np.exp(two_chains_numpy(x, y)["second"]))


def test_a_batch_holding_state_keeps_every_tensor_without_declared_outputs(gpu, ref):
    """Running an execute again would count twice: a batch that writes a tensor in place (here
    count_tokens) keeps every tensor readable, unfused, unless it declares its outputs."""
    ids = np.array([3, 1, 3], np.int32)
    for device in (gpu, ref):
        batch = bg.GpuCommandBatch(device)
        counts = batch.upload(np.zeros((1, 5), np.int32))
        doubled = batch.mul(batch.upload(ids), 2)
        shifted = batch.add(doubled, -1)
        batch.count_tokens(counts, batch.upload(np.zeros(3, np.int32)), batch.upload(ids))
        assert dispatches_per_execute(device, batch) == 3  # mul, add, count_tokens: nothing fused
        np.testing.assert_array_equal(batch.read(doubled), ids * 2)
        np.testing.assert_array_equal(batch.read(shifted), ids * 2 - 1)
        np.testing.assert_array_equal(batch.read(counts), [[0, 2, 0, 4, 0]])  # two executes, two counts each


def test_a_fused_away_intermediate_read_after_declaring_outputs_names_them(gpu):
    rng = np.random.default_rng(30)
    x, y = rng.standard_normal((5, 19), dtype=np.float32), rng.standard_normal(19, dtype=np.float32)
    batch = bg.GpuCommandBatch(gpu)
    got = two_chains(batch, batch.upload(x), batch.upload(y))
    batch.execute()
    batch.outputs(got["first"])
    with pytest.raises(BatchError, match=r"read: .*add\d+.* declares its outputs now .*add it to them"):
        batch.read(got["middle"])
    batch.execute()
    assert_close(batch.read(got["first"]), two_chains_numpy(x, y)["first"])
