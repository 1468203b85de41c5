"""Every op has a twin on every executor, and every kernel interface is declared once.

The op table (``batchgpu.ops.OPS``) is enumerated, not listed by hand: each built-in op has an example
(tests/op_examples.py), a numpy reference (the reference executor runs them all), and every launch its
examples record names a WGSL entry (wgpu, the browser export; its GPU form too) and a CUDA kernel (its
native form) of its family; every elementwise op has an expression in both languages. The families'
declarations (batchgpu/ops/interface.py) are the only ``Params``/binding declarations, and a C++
compiler lays the CUDA ``Params`` out at the offsets WGSL's uniform layout rules give the WGSL one.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import quant, shaders
from batchgpu.ops import OPS, fused
from batchgpu.ops.elementwise import EXPRESSIONS
from batchgpu.ops.interface import ELEMENTWISE, FAMILIES, Family

from .op_examples import EXAMPLES, NOT_BUILTIN, record_all, shrunk_bounds

DTYPES = (np.float32, np.float16, np.int32, np.uint32)

_WGSL_ENTRY = re.compile(r"@compute[^\n]*\n\s*fn\s+(\w+)")
_CUDA_KERNEL = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)')


def wgsl_entries(family: str) -> set[str]:
    return set(_WGSL_ENTRY.findall(shaders.family_source("wgsl", family)))


def cuda_kernels(family: str) -> dict[str, str]:
    """Kernel name: parameter list, of the family's CUDA source."""
    return dict(_CUDA_KERNEL.findall(shaders.family_source("cuda", family)))


def test_every_op_has_an_example_and_a_reference():
    assert set(EXAMPLES) == set(OPS) - set(NOT_BUILTIN), "add the op to tests/op_examples.py's EXAMPLES"
    for name, spec in OPS.items():
        assert callable(spec.reference), f"{name}: no numpy reference"
        assert spec.view or spec.lower is not None, f"{name}: neither a view nor lowered to launches"


def test_every_elementwise_op_has_both_expressions_and_a_batch_method():
    plain = re.compile(r"[\sxyC()+\-*/]*")  # valid WGSL and CUDA alike: no calls, no float literals
    for op, row in EXPRESSIONS.items():
        assert row.wgsl.strip() and row.text("cuda").strip(), op
        assert row.cuda or plain.fullmatch(row.wgsl), (
            f"{op}: {row.wgsl!r} needs a CUDA column (calls differ, and unsuffixed float literals are double)"
        )
        assert row.cuda != row.wgsl, f"{op}: give the CUDA column only where it differs"
        assert callable(getattr(bg.GpuCommandBatch, op, None)), f"{op}: no batch method"
        assert OPS[op].dtypes == row.dtypes and OPS[op].doc == row.doc


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_wgsl_entries_and_cuda_kernels_are_twins(family):
    declared = FAMILIES[family]
    kernels = cuda_kernels(family)
    assert set(kernels) == wgsl_entries(family) | declared.native_only
    assert not declared.native_only & wgsl_entries(family)
    for name, parameters in kernels.items():  # argument i is binding slot i: the declared list
        assert parameters == "BG_ARGS", f"{family}.cu: {name}({parameters}) does not take BG_ARGS"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_sources_declare_no_interface_by_hand(family):
    root = shaders.shader_root()
    wgsl = (root / "wgsl" / f"{family}.wgsl").read_text()
    cuda = (root / "cuda" / f"{family}.cu").read_text()
    for text in (wgsl, cuda):
        assert text.count("//!interface\n") == 1
        assert "struct Params" not in text
    assert "@binding(" not in wgsl and "override WG" not in wgsl
    assert not re.search(r"^#define (?:TILE|TK|ROWS|BIG|BIG_K|MMA_PAD|PARTIAL_HEADER|NO_SLOT)\b", cuda, re.M)


def _launches() -> list[bg.kernels.Launch]:
    launches = []
    for shrunk in (False, True):
        batch = bg.GpuCommandBatch(bg.Device("reference"))
        if shrunk:
            with shrunk_bounds():
                record_all(batch, DTYPES)
        else:
            record_all(batch, DTYPES)
        launches += [launch for node in batch.nodes for launch in node.launches]
    return launches


def test_every_launch_has_a_wgsl_and_a_cuda_twin():
    """wgpu runs a launch (and its GPU form), native executors its native form: each names an entry both
    sources of its family have (or a declared native-only one), binds declared slots with the declared
    kinds, packs the declared Params and sets only override constants."""
    lib_overrides = set(re.findall(r"override (\w+)", "".join(p.read_text() for p in _lib_files())))
    for launch in _launches():
        declared = FAMILIES[launch.family]
        overrides = {c.name for c in declared.constants if c.override} | lib_overrides
        where = f"{launch.label}: {launch.family}.{launch.entry}"
        for form in (launch, launch.for_gpu()):
            assert form.entry in wgsl_entries(form.family), where
        assert launch.for_native().entry in cuda_kernels(launch.family), where
        assert len(launch.params) == declared.params_bytes, where
        for binding in launch.bindings:
            assert binding.kind == declared.bindings[binding.slot].kind, f"{where}: slot {binding.slot}"
        assert {name for name, _ in launch.constants} <= overrides, where
        for placeholder, value in launch.snippets:  # ${PLACEHOLDER}s of the family's source: ops or a format
            assert "${" + placeholder + "}" in shaders.family_source("wgsl", launch.family), where
            assert _known_snippet(launch.family, placeholder, value), where


def _known_snippet(family: str, placeholder: str, value: str) -> bool:
    """A snippet value is a block format, an op of the expression table, or (the fused family) a program of
    loads and known ops."""
    if placeholder == shaders.FORMAT_SNIPPET:
        return value in quant.FORMATS
    if placeholder in shaders.STATEMENT_SNIPPETS.get(family, ()):
        ops = {i.op for i in fused.parse(value) if isinstance(i, fused.Apply)}
        return ops <= set(EXPRESSIONS) | set(fused.SELECTS) | {fused.CAST}
    return value in EXPRESSIONS


def _lib_files() -> list[Path]:
    return sorted((shaders.shader_root() / "wgsl" / "lib").glob("*.wgsl"))


def test_reference_runs_every_example():
    rng = np.random.default_rng(3)
    batch = bg.GpuCommandBatch(bg.Device("reference"))
    outputs, scalars = record_all(batch, DTYPES, rng)
    with np.errstate(all="ignore"):
        batch.execute(scalars=scalars)
    assert all(batch.read(t).shape == t.shape for t in outputs)


# the interface declarations ---------------------------------------------------------------------

_WGSL_SIZE_ALIGN = {
    "u32": (4, 4),
    "i32": (4, 4),
    "f32": (4, 4),
    "vec4<u32>": (16, 16),
    "array<vec4<u32>, 2>": (32, 16),
    "array<vec4<i32>, 2>": (32, 16),
    "array<vec4<u32>, 12>": (192, 16),
    "array<vec4<u32>, 64>": (1024, 16),
}


def wgsl_params_layout(family: Family) -> tuple[dict[str, int], int]:
    """Offsets of the rendered WGSL Params members and the struct size, by WGSL's layout rules for the
    uniform address space (members aligned to their type, arrays of vec4 to 16; size rounded to the
    struct's alignment)."""
    body = re.search(r"struct Params \{\n(.*?)\n\}", family.wgsl(), re.S)
    assert body is not None
    offsets, offset, largest = {}, 0, 4
    for line in body.group(1).splitlines():
        name, kind = re.match(r"\s*(\w+): ([^,]+(?:, \d+>)?),", line).groups()
        size, align = _WGSL_SIZE_ALIGN[kind]
        offset = -(-offset // align) * align
        offsets[name] = offset
        offset += size
        largest = max(largest, align)
    return offsets, -(-offset // largest) * largest


def test_params_layouts_are_uniform_compatible():
    for family in FAMILIES.values():
        offsets, size = wgsl_params_layout(family)
        assert size == family.params_bytes and size % 16 == 0, family.name
        assert list(offsets) == [f.name for f in family.layout], family.name


def test_cuda_params_have_the_wgsl_offsets(tmp_path):
    """g++ lays out each family's CUDA Params (the text NVRTC compiles) at the WGSL offsets."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    program = [
        "#include <cstddef>",
        "#include <cstdio>",
        "typedef float A, B, O, C;",
        "struct float4 { float x, y, z, w; };",
    ]
    checks = []
    for family in FAMILIES.values():
        program += [f"namespace {family.name}_ns {{", family.cuda(), "}", "#undef BG_ARGS"]
        offsets, size = wgsl_params_layout(family)
        checks.append(f'std::printf("{family.name} size %zu {size}\\n", sizeof({family.name}_ns::Params));')
        for name, offset in offsets.items():
            checks.append(
                f'std::printf("{family.name}.{name} %zu {offset}\\n", offsetof({family.name}_ns::Params, {name}));'
            )
    program += ["int main() {", *checks, "}"]
    source = tmp_path / "layout.cpp"
    source.write_text("\n".join(program))
    subprocess.run([compiler, "-std=c++17", "-w", str(source), "-o", str(tmp_path / "layout")], check=True)
    lines = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split("\n")
    mismatches = [line for line in lines if line and line.split()[-2] != line.split()[-1]]
    assert len(lines) > len(FAMILIES) and not mismatches


def test_pack_by_field_name():
    packed = ELEMENTWISE.pack(n=5, ndim=2, b_base=7, shape=(3, 4), a_strides=(4, -1), b_strides=())
    expected = struct.pack("<4I", 5, 2, 7, 0) + struct.pack("<8I", 3, 4, *[0] * 6)
    expected += struct.pack("<8I", 4, 0xFFFFFFFF, *[0] * 6) + bytes(32)
    assert packed == expected and len(packed) == ELEMENTWISE.params_bytes
    with pytest.raises(TypeError, match=r"missing Params fields \['b_strides'\], unknown \['c'\]"):
        ELEMENTWISE.pack(n=5, ndim=2, b_base=0, shape=(), a_strides=(), c=1)
    with pytest.raises(ValueError, match="shape holds at most 8 values"):
        ELEMENTWISE.pack(n=5, ndim=9, b_base=0, shape=range(9), a_strides=(), b_strides=())
    with pytest.raises(struct.error):
        ELEMENTWISE.pack(n=-1, ndim=0, b_base=0, shape=(), a_strides=(), b_strides=())


def test_bind_by_name():
    batch = bg.GpuCommandBatch(bg.Device("reference"))
    x = batch.upload(np.ones(4, np.float32))
    params = ELEMENTWISE.pack(n=4, ndim=0, b_base=0, shape=(), a_strides=(), b_strides=())
    bindings = ELEMENTWISE.bind(params, out=x, a=x)
    assert [(b.slot, b.kind, b.nbytes) for b in bindings] == [(0, "read", 16), (2, "write", 16), (3, "uniform", 112)]
    with pytest.raises(TypeError, match=r"no bindings \['nope'\]"):
        ELEMENTWISE.bind(params, nope=x)
