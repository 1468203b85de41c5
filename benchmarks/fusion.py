"""Elementwise fusion: chains of elementwise ops executed fused and unfused, interleaved in one run (each
first in every other round): dispatches and ms per execute. ``gelu-style``: a GELU-style activation
with bias and residual, and a cast round trip; ``where``: a leaky ReLU and a clamp written with
comparisons and ``where`` (both with declared outputs); ``add/mul x1000``: a plain chain of 1,000
alternating ``add(t, 0.001)`` / ``mul(t, 0.999)`` with no outputs declared (fused by default, its
constants in the kernels' params) against ``fusion=False``, over ``--chain-elements`` elements.

``--rounding``: instead, the forms of rounding a float32 value to float16 inside a kernel (a fused
kernel's float16 intermediate), as custom wgpu kernels applying one form 128 times per element, interleaved:
ms per execute and the ratio to the kernel without rounding. ``conversion pair`` is ``f32(f16(v))``, which
NVIDIA's Vulkan compiler folds to nothing; ``pack/unpack`` (``unpack2x16float(pack2x16float(...))``, whose
result WGSL leaves indeterminate past float16's range and NaN, handled by selects) and ``bits + round`` /
``bits only`` (integer arithmetic on the bits; float16 subnormals by WGSL's exact ``round`` of v * 2^24, or
by shifts) give numpy's result on every driver; ``round_f16`` of ``shaders/wgsl/lib/half.wgsl`` is
``bits + round``.

    python benchmarks/fusion.py [--device wgpu,reference] [--elements 1048576] [--chain-elements 65536]
        [--repeat 20] [--rounding]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone

import numpy as np

import batchgpu as bg
from batchgpu import Tensor
from batchgpu.shaders import shader_root


def gelu_style(batch: bg.GpuCommandBatch, t: Tensor, b: Tensor) -> Tensor:
    h = batch.add(t, b)  # bias, broadcast over rows
    h = batch.mul(batch.tanh(batch.mul(h, 0.79788456)), 0.5)
    h = batch.add(batch.mul(h, t), t)  # a gate and the residual
    h = batch.cast(batch.cast(h, np.float16), np.float32)
    return batch.maximum(batch.neg(h), -4.0)


def where_chain(batch: bg.GpuCommandBatch, t: Tensor, b: Tensor) -> Tensor:
    h = batch.where(t > b, t, 0.1 * t)  # a leaky ReLU around a per-column threshold
    return batch.where(h < 1.5, h, 1.5)


def add_mul_chain(batch: bg.GpuCommandBatch, t: Tensor, b: Tensor) -> Tensor:
    """1,000 alternating ``add(t, 0.001)`` / ``mul(t, 0.999)``: a Python constant per op."""
    for k in range(1000):
        t = batch.add(t, 0.001) if k % 2 == 0 else batch.mul(t, 0.999)
    return t


CHAINS: dict[str, Callable[[bg.GpuCommandBatch, Tensor, Tensor], Tensor]] = {
    "gelu-style": gelu_style,
    "where": where_chain,
    "add/mul x1000": add_mul_chain,
}

PLAIN = {"add/mul x1000"}
"""Chains recorded as a user would without declaring outputs: fused by default."""


ROUNDINGS: dict[str, str] = {
    "none": "fn rounded(v: f32) -> f32 { return v; }",
    "conversion pair": "fn rounded(v: f32) -> f32 { return f32(f16(v)); }",
    "pack/unpack": """fn rounded(v: f32) -> f32 {
    let bits = bitcast<u32>(v);
    let magnitude = bits & 0x7fffffffu;
    let packed = unpack2x16float(pack2x16float(vec2<f32>(bitcast<f32>(min(magnitude, 0x477fe000u)), 0.0))).x;
    var r = bitcast<u32>(packed);
    if magnitude >= 0x477ff000u { r = 0x7f800000u; }
    if magnitude > 0x7f800000u { r = magnitude; }
    return bitcast<f32>((bits & 0x80000000u) | r);
}""",
    "bits + round": (shader_root() / "wgsl" / "lib" / "half.wgsl").read_text().replace("fn round_f16", "fn rounded"),
    "bits only": """fn rounded(v: f32) -> f32 {
    let bits = bitcast<u32>(v);
    let magnitude = bits & 0x7fffffffu;
    var r = (magnitude + 0xfffu + ((magnitude >> 13u) & 1u)) & 0xffffe000u;
    let shift = min(126u - min(magnitude >> 23u, 112u), 31u);
    let significand = (magnitude & 0x7fffffu) | 0x800000u;
    let q = (significand + (1u << (shift - 1u)) - 1u + ((significand >> shift) & 1u)) >> shift;
    if magnitude < 0x38800000u { r = select(0u, bitcast<u32>(f32(q)) - (24u << 23u), q != 0u); }
    if magnitude >= 0x477ff000u { r = 0x7f800000u; }
    if magnitude > 0x7f800000u { r = magnitude; }
    return bitcast<f32>((bits & 0x80000000u) | r);
}""",
}
"""Forms of rounding a float32 value to float16, kept as float32 (see the module doc)."""

ROUNDING_KERNEL = """struct P { n: u32 }
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<uniform> p: P;
FORM
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    if id.x >= p.n { return; }
    var v = x[id.x];
    for (var k = 0u; k < 128u; k++) { v = rounded(v * 1.125 + 0.5); }
    y[id.x] = v;
}"""


def rounding_forms(device: bg.Device, x: np.ndarray, repeat: int) -> None:
    """The table of ``--rounding``: each form's kernel over ``x``, interleaved (the order rotates)."""
    n = x.size
    runs = {}
    for form, text in ROUNDINGS.items():
        if "f16(" in text and "shader-f16" not in device.features:
            continue
        batch = bg.GpuCommandBatch(device)
        out = batch.upload(np.zeros(n, np.float32))
        source = ("enable f16;\n" if "f16(" in text else "") + ROUNDING_KERNEL.replace("FORM", text)
        kernel = bg.Kernel(wgsl=source, entry="main")
        batch.launch(kernel, grid=(n + 255) // 256, buffers=[batch.upload(x.ravel()), out], scalars=[n])
        runs[form] = (batch, out)
    times: dict[str, list[float]] = {form: [] for form in runs}
    forms = list(runs)
    for round_ in range(repeat + 1):
        for form in forms[round_ % len(forms) :] + forms[: round_ % len(forms)]:
            batch, out = runs[form]
            started = time.perf_counter()
            batch.execute()
            batch.read(out)
            if round_:  # the first round compiles and warms up
                times[form].append(time.perf_counter() - started)
    want = runs["bits + round"][0].read(runs["bits + round"][1])
    for form in ("pack/unpack", "bits only"):
        np.testing.assert_array_equal(runs[form][0].read(runs[form][1]), want)
    base = statistics.median(times["none"])
    pair = statistics.median(times["conversion pair"]) if "conversion pair" in times else float("nan")
    print("| device | form | ms | / none | / conversion pair |")
    print("|---|---|---:|---:|---:|")
    for form, spans in times.items():
        ms = statistics.median(spans)
        print(f"| {device.name} | {form} | {ms * 1e3:.2f} | {ms / base:.2f} | {ms / pair:.2f} |")


def check(fused: np.ndarray, unfused: np.ndarray, chain: str) -> None:
    """Fused equals unfused, except that a driver may fuse a multiply and an add of two ops into one
    rounding (WGSL and NVRTC allow it), which can move a value across a float16 rounding boundary: at most
    one element in a thousand may differ, by one float16 ulp; the 1,000-op chain, by one float32 rounding
    per op at most."""
    if chain == "add/mul x1000":
        bound = 1000 * np.spacing(np.float32(np.abs(unfused).max() + 1))
        np.testing.assert_allclose(fused, unfused, rtol=0, atol=bound)
        return
    got, want = fused.ravel(), unfused.ravel()
    differ = np.flatnonzero(got != want)
    ulp = np.spacing(np.abs(want[differ]).astype(np.float16)).astype(np.float32)
    within = np.abs(got[differ] - want[differ]) <= ulp
    assert differ.size <= fused.size // 1000 and within.all(), (
        f"fused differs from unfused at {differ.size} of {fused.size} elements, {np.sum(~within)} by more than "
        "a float16 ulp"
    )


def record(
    device: bg.Device, x: np.ndarray, bias: np.ndarray, chain: str, fusion: bool
) -> tuple[bg.GpuCommandBatch, Tensor]:
    batch = bg.GpuCommandBatch(device, fusion=fusion)
    out = CHAINS[chain](batch, batch.upload(x), batch.upload(bias))
    if chain not in PLAIN:
        batch.outputs(out)
    return batch, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="wgpu,reference")
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--chain-elements", type=int, default=1 << 16, help="elements of the 1,000-op chain")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounding", action="store_true", help="time the float16 rounding forms (wgpu)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    width = 1024
    x = rng.standard_normal((args.elements // width, width), dtype=np.float32)
    bias = rng.standard_normal(width, dtype=np.float32)
    print(f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}; {x.size} float32 elements\n")
    if args.rounding:
        rounding_forms(bg.Device("wgpu"), x, args.repeat)
        return
    print("| device | chain | dispatches unfused | dispatches fused | ms unfused | ms fused | fused / unfused |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, chain in [(kind, chain) for kind in args.device.split(",") for chain in CHAINS]:
        device = bg.Device(kind)
        data = x.reshape(-1)[: args.chain_elements].reshape(-1, width) if chain in PLAIN else x
        runs = {fusion: record(device, data, bias, chain, fusion) for fusion in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        dispatches = {}
        for fusion, (batch, out) in runs.items():
            batch.execute()
            batch.read(out)
            before = device.stats.dispatches
            batch.execute()
            batch.read(out)
            dispatches[fusion] = device.stats.dispatches - before
        for round_ in range(args.repeat):  # which runs first alternates: the second of a pair ran slower
            for fusion in (False, True) if round_ % 2 == 0 else (True, False):
                batch, out = runs[fusion]
                started = time.perf_counter()
                batch.execute()
                batch.read(out)
                times[fusion].append(time.perf_counter() - started)
        check(runs[True][0].read(runs[True][1]), runs[False][0].read(runs[False][1]), chain)
        plain, fused = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        counts = f"{dispatches[False]} | {dispatches[True]}"
        print(f"| {device.name} | {chain} | {counts} | {plain:.2f} | {fused:.2f} | {fused / plain:.2f} |")


if __name__ == "__main__":
    main()
