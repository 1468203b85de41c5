"""Every CUDA kernel specialization the op table produces compiles with NVRTC for sm_90 and with hipRTC
for AMD's gfx90a (CDNA2, wave64); one source per kernel entry compiles for sm_80 and gfx1030 (RDNA2,
wave32).

Needs no GPU, only NVRTC (the ``nvidia-cuda-nvrtc`` wheel, in the ``test`` extra) and hipRTC (Debian's
``libamdhip64-5``, ROCm 5.2, with ``libhiprtc-builtins5`` and ``rocm-device-libs``). Launches are
collected by recording ops on the numpy reference device, so the sources are exactly what the native
executors would compile for those ops.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import cuda_source
from batchgpu.errors import CompileError, UnsupportedError
from batchgpu.fusion import fuse
from batchgpu.limits import Limits
from batchgpu.nvrtc import Hiprtc, ModuleCache, Nvrtc
from batchgpu.ops.interface import FAMILIES

from .conftest import random_array
from .op_examples import record_all, record_fusable_chains, shrunk_bounds

ARCHS = ("sm_80", "sm_90")
EVERY_SPECIALIZATION = ("sm_90",) if os.environ.get("BATCHGPU_TEST_EVERY_SPECIALIZATION") else ()
"""Targets every specialization compiles for: with ``BATCHGPU_TEST_EVERY_SPECIALIZATION=1``, sm_90 (the GPUs the
suite runs on)."""
EVERY_SHAPE = ("sm_90", "gfx90a")
"""Targets every specialization compiles for up to its numbers: sources that differ only in numeric constants (the
loop budgets of the shrunk bounds, sizes baked in) compile alike, so one of each shape compiles (297 of 531
sources), for NVIDIA and for AMD's wave64; the other targets compile one source per kernel entry, to keep CI
short."""
NUMBER = re.compile(r"\b\d+(\.\d+)?[uUfF]?\b")
HIP_ARCHS = ("gfx90a", "gfx1030")
DTYPES = (np.float32, np.float16, np.int32, np.uint32)


@pytest.fixture(scope="module")
def nvrtc(tmp_path_factory) -> Nvrtc:
    try:
        return Nvrtc(ModuleCache(tmp_path_factory.mktemp("kernels")))
    except UnsupportedError as exc:
        pytest.skip(f"NVRTC cannot be loaded (pip install nvidia-cuda-nvrtc): {exc}")


@pytest.fixture(scope="module")
def hiprtc(tmp_path_factory) -> Hiprtc:
    try:
        return Hiprtc(ModuleCache(tmp_path_factory.mktemp("hip-kernels")))
    except UnsupportedError as exc:
        pytest.skip(f"hipRTC cannot be loaded (apt-get install libamdhip64-5 libhiprtc-builtins5): {exc}")


def _record_everything() -> list[bg.kernels.Launch]:
    """Record every op of the op table over every dtype it accepts (tests/op_examples.py); returns all
    launches."""
    b = bg.GpuCommandBatch(bg.Device("reference"))
    record_all(b, DTYPES)
    return [launch for node in b.nodes for launch in node.launches]


def _fused_launches() -> list[bg.kernels.Launch]:
    """The fused kernels of chains holding every elementwise op and casts, over every dtype."""
    launches = []
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        b = bg.GpuCommandBatch(bg.Device("reference"))
        x, y = b.upload(random_array(rng, (3, 37), dtype)), b.upload(random_array(rng, (37,), dtype))
        outputs = record_fusable_chains(b, x, y)
        fused = fuse(b.nodes, {t.storage for t in outputs}, Limits(), "reference", b.view().host)  # constants too
        launches += [launch for node in fused.nodes for launch in node.launches if launch.family == "fused"]
    return launches


def _sources() -> dict[str, tuple[str, set[str]]]:
    """Each module source with the entries launched from it (WGSL-shaped and native forms), recorded
    with the real bounds and with shrunk ones."""
    sources: dict[str, tuple[str, set[str]]] = {}
    launches = _record_everything()
    with shrunk_bounds():
        launches += _record_everything()
    launches += _fused_launches()
    for recorded in launches:
        for launch in {id(recorded): recorded, id(recorded.for_native()): recorded.for_native()}.values():
            source, name = cuda_source.render(launch)
            sources.setdefault(source, (name, set()))[1].add(launch.entry)
    return sources


SOURCES = _sources()
NATIVE_ONLY_ENTRIES = set().union(*(family.native_only for family in FAMILIES.values()))  # CUDA/HIP-only forms


def test_every_family_and_entry_is_covered():
    families = {name.removesuffix(".cu") for name, _ in SOURCES.values()}
    assert families == set(cuda_source.FAMILIES)
    entries = set().union(*(entries for _, entries in SOURCES.values()))
    wgsl_entries = set()
    for family in cuda_source.FAMILIES:
        text = (bg.shaders.shader_root() / "wgsl" / f"{family}.wgsl").read_text()
        wgsl_entries |= set(re.findall(r"@compute[^\n]*\n\s*fn\s+(\w+)", text))
    assert entries == wgsl_entries | NATIVE_ONLY_ENTRIES


def sources_for(arch: str) -> dict[str, tuple[str, set[str]]]:
    """Every source for the targets of :data:`EVERY_SPECIALIZATION`, one per shape for :data:`EVERY_SHAPE`, else
    one source per kernel entry."""
    if arch in EVERY_SPECIALIZATION:
        return SOURCES
    return _one_source_per_shape() if arch in EVERY_SHAPE else _one_source_per_entry()


def _one_source_per_shape() -> dict[str, tuple[str, set[str]]]:
    """One source per text with its numbers left out (the others differ in constants only)."""
    chosen: dict[str, tuple[str, set[str]]] = {}
    seen: set[str] = set()
    for source, (name, entries) in SOURCES.items():
        shape = NUMBER.sub("N", source)
        if shape not in seen:
            seen.add(shape)
            chosen[source] = (name, entries)
    return chosen


def _one_source_per_entry() -> dict[str, tuple[str, set[str]]]:
    chosen: dict[str, tuple[str, set[str]]] = {}
    seen: set[tuple[str, str]] = set()
    for source, (name, entries) in SOURCES.items():
        fresh = {(name, entry) for entry in entries} - seen
        if fresh:
            chosen[source] = (name, entries)
            seen |= fresh
    return chosen


@pytest.mark.parametrize("arch", ARCHS)
def test_every_specialization_compiles_to_ptx(nvrtc, arch):
    """sm_90: every specialization up to its numbers; sm_80: one source per kernel entry (:func:`sources_for`)."""
    failures = []
    for source, (name, entries) in sources_for(arch).items():
        try:
            ptx = nvrtc.compile(source, name, arch, ["-default-device"], target="ptx").decode(errors="replace")
        except CompileError as exc:
            failures.append(str(exc)[:2000])
            continue
        assert f".target {arch}" in ptx
        for entry in entries:
            assert re.search(rf"\.entry\s+{entry}\s*\(", ptx), f"{name}: no entry {entry} in the PTX"
    assert not failures, "\n\n".join(failures)


ROPE_FORMS = {"rope", "rope_positions", "rope_kv_write", "rope_kv_scatter"}


def test_every_rope_form_spells_out_its_roundings(nvrtc):
    """rope_kv_write / rope_kv_scatter give the bits of rope + kv_write / scatter_rows on CUDA (the contract
    of tests/test_llm_ops.py's fused_and_unfused): the rotation spells out every rounding (mul.rn, div.rn,
    fma.rn), so the PTX of the four rope entries holds no plain f32 add or sub, which ptxas may contract
    with a product into an fma differently in each kernel (it did: rope_kv_write was 1 ulp from rope on an
    H100), and each entry has the same sequence of f32 arithmetic."""
    sequences: dict[tuple[str, ...], set[str]] = {}
    for source, (name, entries) in SOURCES.items():
        if not ROPE_FORMS & entries:
            continue
        ptx = nvrtc.compile(source, name, "sm_90", ["-default-device"], target="ptx").decode(errors="replace")
        for entry in ROPE_FORMS & entries:
            body = re.split(rf"\.entry\s+{entry}\s*\(", ptx)[1].split(".entry")[0]
            ops = tuple(re.findall(r"^\s+((?:add|sub|mul|div|fma|neg)[.\w]*\.f32)\s", body, re.MULTILINE))
            plain = [op for op in ops if op in ("add.f32", "sub.f32")]
            assert not plain, f"{name} {entry}: {plain} may be contracted by ptxas: {' '.join(ops)}"
            sequences.setdefault(ops, set()).add(entry)
    assert len(sequences) == 1 and set().union(*sequences.values()) == ROPE_FORMS, sequences


def test_cubin_for_sm_90_and_disk_cache(tmp_path):
    try:
        first = Nvrtc(ModuleCache(tmp_path))
    except UnsupportedError as exc:
        pytest.skip(f"NVRTC cannot be loaded: {exc}")
    source, (name, _) = next(iter(SOURCES.items()))
    cubin = first.compile(source, name, "sm_90", ["-default-device"], target="cubin")
    assert cubin[:4] == b"\x7fELF"
    assert first.compiled == 1
    second = Nvrtc(ModuleCache(tmp_path))  # as a second process would: same cache directory
    assert second.compile(source, name, "sm_90", ["-default-device"], target="cubin") == cubin
    assert second.compiled == 0
    second.compile(source, name, "sm_80", ["-default-device"], target="cubin")
    assert second.compiled == 1  # the key includes the architecture


def test_compile_errors_carry_the_log(nvrtc):
    with pytest.raises(CompileError, match=r"broken\.cu.*undefined"):
        nvrtc.compile('extern "C" __global__ void k() { undefined_thing(); }', "broken.cu", "sm_90", target="ptx")


def test_custom_kernel_with_cuda_source_compiles(nvrtc):
    wgsl = "@compute @workgroup_size(64) fn main() {}"
    cuda = """
    struct Scalars { float a; unsigned n; };
    extern "C" __global__ void main_kernel(float* x, float* y, const Scalars s) {
        unsigned i = bg_thread_index();
        if (i < s.n) y[i] = s.a * x[i] + y[i];
    }"""
    kernel = bg.Kernel(wgsl=wgsl, entry="main_kernel", cuda=cuda, workgroup_size=(64,))
    dev = bg.Device("reference")
    b = bg.GpuCommandBatch(dev)
    x, y = b.upload(np.ones(8, np.float32)), b.upload(np.ones(8, np.float32))
    b.launch(kernel, 1, [x, y], [2.0, 8])
    (launch,) = b.nodes[-1].launches
    source, name = cuda_source.render(launch)
    ptx = nvrtc.compile(source, name, "sm_90", ["-default-device"], target="ptx").decode()
    assert ".entry main_kernel(" in ptx


def test_custom_kernel_without_cuda_source_is_refused():
    dev = bg.Device("reference")
    b = bg.GpuCommandBatch(dev)
    kernel = bg.Kernel(wgsl="@compute @workgroup_size(1) fn main() {}", name="wgsl_only")
    b.launch(kernel, 1, [b.upload(np.ones(4, np.float32))])
    with pytest.raises(UnsupportedError, match=r"wgsl_only.*no CUDA source"):
        cuda_source.render(b.nodes[-1].launches[0])


# hipRTC ------------------------------------------------------------------------------------------


def hiprtc_compile_all(arch: str, items: list[tuple[str, tuple[str, set[str]]]]) -> list[str]:
    """Compile ``items`` (source, (name, entries)) for ``arch`` with a hipRTC of this process; the failures.
    Run in worker processes by the test below (module-level, so a spawned worker can import it)."""
    compiler = Hiprtc(None)
    failures = []
    for source, (name, entries) in items:
        try:
            code = compiler.compile(source, name, arch, [], target="code")
        except CompileError as exc:
            failures.append(str(exc)[:2000])
            continue
        if code[:4] != b"\x7fELF":
            failures.append(f"{name}: not an AMDGPU code object")
        missing = [entry for entry in entries if f"{entry}.kd".encode() not in code]
        if missing:
            failures.append(f"{name}: no kernel descriptor for {missing} in the {arch} code object")
    return failures


@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_every_specialization_compiles_with_hiprtc(hiprtc, arch):
    """gfx90a: every specialization up to its numbers; gfx1030 (wave32): one source per kernel entry
    (:func:`sources_for`). ROCm 5.2's hipRTC crashes under concurrent compiles in one process (Hiprtc
    serializes them), so the sources are dealt to one spawned process per CPU."""
    items = list(sources_for(arch).items())
    workers = max(1, min(os.cpu_count() or 1, 4, len(items) // 16))
    chunks = [items[k::workers] for k in range(workers)]
    if workers == 1:
        failures = hiprtc_compile_all(arch, items)
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            failures = [f for part in pool.map(hiprtc_compile_all, [arch] * workers, chunks) for f in part]
    assert not failures, "\n\n".join(failures)


def test_hiprtc_errors_carry_the_log_and_modules_are_cached(hiprtc, tmp_path):
    with pytest.raises(CompileError, match=r"hiprtc: broken\.cu failed to compile for gfx90a:\n.*undefined_thing"):
        hiprtc.compile('extern "C" __global__ void k() { undefined_thing(); }', "broken.cu", "gfx90a", target="code")
    source, (name, _) = next(iter(SOURCES.items()))
    first = Hiprtc(ModuleCache(tmp_path))
    code = first.compile(source, name, "gfx90a", [], target="code")
    second = Hiprtc(ModuleCache(tmp_path))  # a second process: same cache directory, compiles nothing
    assert second.compile(source, name, "gfx90a", [], target="code") == code and second.compiled == 0


def test_hiprtc_compiles_are_serialized(hiprtc, tmp_path):
    """Concurrent callers (threads) get correct code objects: ROCm 5.2's hipRTC segfaulted ~1 in 10
    runs of two threads compiling at once before Hiprtc took a lock."""
    compiler = Hiprtc(ModuleCache(tmp_path))
    items = list(SOURCES.items())[:8]
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda item: compiler.compile(item[0], item[1][0], "gfx90a", target="code"), items))
    assert all(code[:4] == b"\x7fELF" for code in codes) and compiler.compiled == len(items)
