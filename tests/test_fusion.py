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

import json
import re
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import BatchError
from batchgpu.ops.elementwise import EXPRESSIONS
from batchgpu.ops.fused import Apply, Load, program_text, render
from batchgpu.ops.interface import CONTIGUOUS, SCALAR, STRIDED
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
