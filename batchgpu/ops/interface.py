"""Kernel interfaces: each built-in shader family's bindings, ``Params`` struct and constants, declared once.

A :class:`Family` is everything the WGSL and CUDA twins of ``shaders/<language>/<family>`` and the Python
lowering must agree on. From it:

- WGSL (:meth:`Family.wgsl`): the ``//!interface`` line of ``shaders/wgsl/<family>.wgsl`` becomes the
  family's ``const`` and ``override`` constants (``WG`` and the specializations a launch may set, with
  their defaults), ``struct Params`` and one ``@group(0) @binding(i) var<...>`` per binding;
- CUDA (:meth:`Family.cuda`): the ``//!interface`` line of ``shaders/cuda/<family>.cu`` becomes the same
  constants as ``#define``s (override constants: their defaults, under ``#ifndef``: a launch's values are
  defined in front), the same ``struct Params`` (every member 4 bytes or an array of them, padded as
  WGSL's uniform layout wants, so both languages see one layout) and ``BG_ARGS``, the parameter list of
  every ``extern "C"`` kernel of the family: argument ``i`` is binding slot ``i``;
- Python: :meth:`Family.pack` packs ``Params`` by field name, :meth:`Family.bind` makes a launch's
  :class:`~batchgpu.kernels.Binding` list by binding name, :meth:`Family.launch` both, and the
  lowerings read tile sizes and workgroup sizes from :meth:`Family.value`.

Kernel bodies stay hand-written in the shader files; only these declarations are generated.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..kernels import DEFAULT_WORKGROUP, HALF_ALIAS, MAX_DIMS, Binding, BindingKind, Launch
from ..scalars import MAX_SCALARS, NO_SLOT, SCALAR_BYTES
from ..tensor import Storage, Tensor
from . import bounds

FieldType = Literal[
    "u32",
    "i32",
    "f32",
    "vec4<u32>",
    "array<vec4<u32>, 2>",
    "array<vec4<i32>, 2>",
    "array<vec4<u32>, 12>",
    "array<vec4<u32>, 64>",
]
"""Types of ``Params`` fields: 4-byte scalars, a vec4 of u32, the ``MAX_DIMS``-long dim blocks,
``MAX_FUSED_INPUTS`` of them in a row (the fused kernel's strides) and ``MAX_FUSED_CONSTANTS`` 32-bit
words (the fused kernel's constants)."""

MAX_FUSED_INPUTS = 6
"""Inputs a fused elementwise kernel reads at most (with its output, 7 storage bindings: within WebGPU's
default of 8 per shader stage; :mod:`batchgpu.fusion` lowers it further on devices that allow fewer)."""

MAX_FUSED_CONSTANTS = 256
"""Python constants (scalar operands) a fused kernel holds at most, as 32-bit words of its ``Params`` (1 KiB,
within every device's uniform and kernel-parameter space); a longer chain is split."""

MAX_FUSED_OPS = 256
"""Ops one fused kernel runs at most (bounds the generated source and its compile time); a longer chain is
split."""

ConstantType = Literal["u32", "f32", "bool"]

_FUSED_DIMS = MAX_FUSED_INPUTS * MAX_DIMS
assert _FUSED_DIMS == 4 * 12, "the fused strides' FieldType names 12 vec4s"
assert MAX_FUSED_CONSTANTS == 4 * 64, "the fused constants' FieldType names 64 vec4s"

_FIELD_LAYOUT: dict[str, tuple[int, int, str, str]] = {
    # WGSL type: (size, uniform alignment, struct format (masked to 32 bits for vectors), CUDA declaration)
    "u32": (4, 4, "I", "unsigned {name}"),
    "i32": (4, 4, "i", "int {name}"),
    "f32": (4, 4, "f", "float {name}"),
    "vec4<u32>": (16, 16, "4I", "unsigned {name}[4]"),
    "array<vec4<u32>, 2>": (32, 16, f"{MAX_DIMS}I", f"unsigned {{name}}[{MAX_DIMS}]"),
    "array<vec4<i32>, 2>": (32, 16, f"{MAX_DIMS}I", f"int {{name}}[{MAX_DIMS}]"),
    "array<vec4<u32>, 12>": (192, 16, f"{_FUSED_DIMS}I", f"unsigned {{name}}[{_FUSED_DIMS}]"),
    "array<vec4<u32>, 64>": (1024, 16, f"{MAX_FUSED_CONSTANTS}I", f"unsigned {{name}}[{MAX_FUSED_CONSTANTS}]"),
}

_CUDA_ELEMENT = {"f32": "float", "i32": "int", "u32": "unsigned", "vec4<f32>": "float4"}
"""CUDA type of a binding's fixed element type; type aliases (A, B, O) keep their name (typedefs)."""


@dataclass(frozen=True)
class Field:
    """One ``Params`` member."""

    name: str
    type: FieldType = "u32"
    note: str = ""


@dataclass(frozen=True)
class Slot:
    """One declared binding slot: a storage array (``read`` or ``write``, i.e. read_write), the ``uniform``
    Params or the per-execute ``scalars``. ``element`` is a storage array's WGSL element type: a type alias
    of the launch (``A``, ``B``, ``O``) or a fixed type (``f32``, ``i32``, ``u32``, ``vec4<f32>``)."""

    name: str
    kind: BindingKind
    element: str = ""
    note: str = ""

    def wgsl(self, slot: int) -> str:
        space = {"read": "storage, read", "write": "storage, read_write"}.get(self.kind, "uniform")
        declared = {"uniform": "Params", "scalars": "Scalars"}.get(self.kind, f"array<{self.element}>")
        line = f"@group(0) @binding({slot}) var<{space}> {self.name}: {declared};"
        return f"{line}   // {self.note}" if self.note else line

    def cuda(self) -> str:
        if self.kind == "uniform":
            return f"const Params {self.name}"
        if self.kind == "scalars":
            return f"const unsigned* {self.name}"
        element = _CUDA_ELEMENT.get(self.element, self.element)
        return f"{'const ' if self.kind == 'read' else ''}{element}* {self.name}"


def read(name: str, element: str, note: str = "") -> Slot:
    return Slot(name, "read", element, note)


def write(name: str, element: str, note: str = "") -> Slot:
    return Slot(name, "write", element, note)


PARAMS = Slot("p", "uniform")
SCALARS = Slot("scalars", "scalars")
"""The per-execute scalars (batchgpu/scalars.py): ``MAX_SCALARS`` 4-byte slots."""


@dataclass(frozen=True)
class Constant:
    """A constant both twins and the Python lowering use. ``override``: a WGSL override constant, which a
    launch may set through ``Launch.constants`` (in CUDA a ``#define``, its default under ``#ifndef``);
    else a fixed ``const``. ``runtime``: an override the CUDA kernels take at launch instead (no
    ``#define``). ``cuda_only``: a constant of the native-only kernels."""

    name: str
    value: int | float | bool
    type: ConstantType = "u32"
    override: bool = False
    runtime: bool = False
    cuda_only: bool = False
    note: str = ""

    def wgsl(self) -> str:
        keyword = "override" if self.override else "const"
        line = f"{keyword} {self.name}: {self.type} = {_wgsl_literal(self.value, self.type)};"
        return f"{line}   // {self.note}" if self.note else line

    def cuda(self) -> str:
        if self.override:
            return f"#ifndef {self.name}\n#define {self.name} {cuda_literal(self.value)}\n#endif"
        value = {"u32": _u32_literal(self.value), "f32": f"{float(self.value)!r}f"}.get(self.type)
        value = value or cuda_literal(self.value)
        return f"#define {self.name} {value}" + (f"  // {self.note}" if self.note else "")


def const(
    name: str, value: int | float, type: ConstantType = "u32", note: str = "", cuda_only: bool = False
) -> Constant:
    return Constant(name, value, type, note=note, cuda_only=cuda_only)


def override(
    name: str, default: int | bool, type: ConstantType = "u32", note: str = "", runtime: bool = False
) -> Constant:
    return Constant(name, default, type, override=True, runtime=runtime, note=note)


def _u32_literal(value: int | float | bool) -> str:
    number = int(value)
    return f"{number:#X}u".replace("0X", "0x") if number > 0xFFFF else f"{number}u"


def _wgsl_literal(value: int | float | bool, type: ConstantType) -> str:
    if type == "bool":
        return "true" if value else "false"
    return _u32_literal(value) if type == "u32" else repr(float(value))


def cuda_literal(value: int | float | bool) -> str:
    """A constant as CUDA source text: bools 1/0, integral values as ints, other floats with an f."""
    if isinstance(value, bool):
        return "1" if value else "0"
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number) + "f"


def _padded(fields: Sequence[Field]) -> tuple[Field, ...]:
    """``fields`` with ``padN`` u32 members inserted where WGSL's uniform layout aligns a vec4 or an array
    of vec4 to 16 bytes and at the end (struct size a multiple of 16). Every member is then at the offset
    a C struct of 4-byte members gives it too."""
    out: list[Field] = []
    offset = pads = 0

    def pad_to(alignment: int) -> None:
        nonlocal offset, pads
        while offset % alignment:
            out.append(Field(f"pad{pads}"))
            pads += 1
            offset += 4

    for member in fields:
        size, alignment, _, _ = _FIELD_LAYOUT[member.type]
        pad_to(alignment)
        out.append(member)
        offset += size
    pad_to(16)
    return tuple(out)


@dataclass(frozen=True)
class Family:
    """One shader family's interface: ``bindings`` in slot order, ``params`` (the ``Params`` struct, in
    order; padding is added), ``constants``, and ``workgroup``: the default of the ``WG`` override of
    1-D families (the block size of its launches), None for families without one. ``native_only``:
    entry points only the CUDA source has (forms the native executors launch). ``half``: its WGSL kernels take
    the product type alias ``H`` (``f32`` in every launch; ``f16`` in the half form,
    :meth:`~batchgpu.kernels.Launch.for_half`), and compute under ``if HALF`` what that form does in f16."""

    name: str
    bindings: tuple[Slot, ...]
    params: tuple[Field, ...]
    constants: tuple[Constant, ...] = ()
    workgroup: int | None = None
    native_only: frozenset[str] = frozenset()
    half: bool = False
    layout: tuple[Field, ...] = field(init=False)
    _struct: struct.Struct = field(init=False, repr=False)

    def __post_init__(self) -> None:
        names = [b.name for b in self.bindings] + [f.name for f in self.params] + [c.name for c in self.constants]
        if len(set(names)) != len(names):
            raise ValueError(f"family {self.name}: a name is declared twice in {names}")
        if [b.kind for b in self.bindings].count("uniform") > 1:
            raise ValueError(f"family {self.name}: at most one uniform Params binding")
        layout = _padded(self.params)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_struct", struct.Struct("<" + "".join(_FIELD_LAYOUT[f.type][2] for f in layout)))
        offset = 0
        for member in layout:  # the layout rules, checked (_padded satisfies them by construction)
            size, alignment, _, _ = _FIELD_LAYOUT[member.type]
            assert offset % alignment == 0, f"{self.name}.Params.{member.name} at offset {offset}"
            offset += size
        assert offset % 16 == 0 and offset == self._struct.size

    # Python --------------------------------------------------------------------------------------

    @property
    def params_bytes(self) -> int:
        return self._struct.size

    def value(self, name: str) -> Any:
        """The value of constant ``name`` (an override's default), ``WG`` the family's workgroup size."""
        if name == "WG" and self.workgroup is not None:
            return self.workgroup
        for constant in self.constants:
            if constant.name == name:
                return constant.value
        raise KeyError(f"family {self.name} declares no constant {name!r}")

    def pack(self, **values: Any) -> bytes:
        """The ``Params`` bytes from every field by name (padding is zero): scalars as their type (a value
        out of range raises struct.error), vectors and dim blocks as up to 4 / ``MAX_DIMS`` ints taken
        modulo 2**32 (i32 blocks in two's complement), zero-filled."""
        wanted = {f.name for f in self.params}
        if values.keys() != wanted:
            missing, unknown = sorted(wanted - values.keys()), sorted(values.keys() - wanted)
            raise TypeError(f"{self.name}.pack: missing Params fields {missing}, unknown {unknown}")
        flat: list[int | float] = []
        for member in self.layout:
            if member.name not in values:
                flat.append(0)
                continue
            value = values[member.name]
            if member.type in ("u32", "i32", "f32"):
                flat.append(value)
                continue
            count = _FIELD_LAYOUT[member.type][0] // 4
            if len(value) > count:
                raise ValueError(f"{self.name}.pack: {member.name} holds at most {count} values, got {len(value)}")
            flat += [int(v) & 0xFFFFFFFF for v in value] + [0] * (count - len(value))
        return self._struct.pack(*flat)

    def bind(self, params: bytes | None = None, **buffers: Tensor | Storage | bool) -> tuple[Binding, ...]:
        """The launch's bindings, in slot order: each named storage binding given a Tensor or Storage
        (its kind from the declaration), the uniform Params when ``params`` is given, the per-execute
        scalars when passed ``scalars=True``. Bindings not given are left unbound (kernels that do not
        read them)."""
        bindings = []
        unknown = set(buffers) - {b.name for b in self.bindings}
        if unknown:
            raise TypeError(f"{self.name}.bind: no bindings {sorted(unknown)}")
        for slot, declared in enumerate(self.bindings):
            if declared.kind == "uniform":
                if params is not None:
                    bindings.append(Binding(slot, "uniform", None, len(params)))
                continue
            value = buffers.get(declared.name)
            if value is None or value is False:
                continue
            if declared.kind == "scalars":
                bindings.append(Binding(slot, "scalars", None, SCALAR_BYTES))
                continue
            storage = value.storage if isinstance(value, Tensor) else value
            if not isinstance(storage, Storage):
                raise TypeError(f"{self.name}.bind: {declared.name} needs a Tensor or Storage, got {value!r}")
            bindings.append(Binding(slot, declared.kind, storage, storage.nbytes))
        return tuple(bindings)

    def launch(
        self,
        *,
        params: Mapping[str, Any],
        buffers: Mapping[str, Tensor | Storage | bool],
        workgroup_size: tuple[int, int, int] | None = None,
        **fields: Any,
    ) -> Launch:
        """A :class:`~batchgpu.kernels.Launch` of this family: ``params`` packed by name, ``buffers``
        bound by name, a block of ``workgroup`` invocations unless ``workgroup_size`` is given; other
        ``fields`` (label, entry, groups, types, ...) as Launch takes them."""
        packed = self.pack(**params)
        if workgroup_size is None:
            workgroup_size = (self.workgroup or DEFAULT_WORKGROUP, 1, 1)
        if self.half:
            fields["types"] = (*fields.get("types", ()), (HALF_ALIAS, "f32"))
        return Launch(
            family=self.name,
            params=packed,
            bindings=self.bind(packed, **buffers),
            workgroup_size=workgroup_size,
            **fields,
        )

    # shader declarations ------------------------------------------------------------------------------

    def wgsl(self) -> str:
        """The WGSL declarations ``//!interface`` stands for."""
        lines = [f"// Declared in batchgpu/ops/interface.py ({self.name}): constants, Params and bindings."]
        if self.workgroup is not None:
            lines.append(f"override WG: u32 = {self.workgroup}u;")
        lines += [c.wgsl() for c in self.constants if not c.cuda_only]
        lines += ["", "struct Params {"]
        for member in self.layout:
            line = f"    {member.name}: {member.type},"
            lines.append(f"{line}   // {member.note}" if member.note else line)
        lines += ["}", ""]
        if any(b.kind == "scalars" for b in self.bindings):
            lines += ["struct Scalars {", f"    values: array<vec4<u32>, {MAX_SCALARS // 4}>,", "}", ""]
        lines += [binding.wgsl(slot) for slot, binding in enumerate(self.bindings)]
        return "\n".join(lines)

    def cuda(self) -> str:
        """The CUDA declarations ``//!interface`` stands for; ``WG`` comes from the launch (a #define in
        front of the prelude)."""
        lines = [f"// Declared in batchgpu/ops/interface.py ({self.name}): constants, Params and BG_ARGS."]
        lines += [c.cuda() for c in self.constants if not c.runtime]
        lines += ["", "struct Params {"]
        for member in self.layout:
            line = "    " + _FIELD_LAYOUT[member.type][3].format(name=member.name) + ";"
            lines.append(f"{line}  // {member.note}" if member.note else line)
        lines += ["};", ""]
        arguments = ", ".join(binding.cuda() for binding in self.bindings)
        if len(arguments) > 100:  # one parameter per line
            arguments = "\\\n    " + ", \\\n    ".join(binding.cuda() for binding in self.bindings)
        lines.append(f"#define BG_ARGS {arguments}")
        return "\n".join(lines)


# The families ------------------------------------------------------------------------------------

DIMS_U32: FieldType = "array<vec4<u32>, 2>"
DIMS_I32: FieldType = "array<vec4<i32>, 2>"

CONTIGUOUS, SCALAR, STRIDED = 0, 1, 2
"""How the elementwise kernel reads an input (A_MODE, B_MODE): at the output index, as a broadcast
scalar, or through broadcast strides."""

ELEMENTWISE = Family(
    "elementwise",
    bindings=(read("a", "A"), read("b", "B"), write("out", "O"), PARAMS),
    params=(
        Field("n"),
        Field("ndim"),
        Field("b_base", note="STRIDED b: the element of b at index 0 (swiglu: the second half of a row)"),
        Field("shape", DIMS_U32),
        Field("a_strides", DIMS_U32),
        Field("b_strides", DIMS_U32),
    ),
    constants=(
        const("CONTIGUOUS", CONTIGUOUS),
        const("SCALAR", SCALAR),
        const("STRIDED", STRIDED),
        override("A_MODE", CONTIGUOUS),
        override("B_MODE", CONTIGUOUS),
    ),
    workgroup=DEFAULT_WORKGROUP,
)

COPY = Family(
    "copy",
    bindings=(read("src", "A"), write("dst", "O"), PARAMS),
    params=(
        Field("n"),
        Field("ndim"),
        Field("src_base", "i32"),
        Field("dst_base", "i32"),
        Field("shape", DIMS_U32),
        Field("src_strides", DIMS_I32),
        Field("dst_strides", DIMS_I32),
    ),
    workgroup=DEFAULT_WORKGROUP,
)

_ROWS_PARAMS = (
    Field("outer"),
    Field("r"),
    Field("inner"),
    Field("scale", "f32"),
    Field("chunk", note="row piece length (rows longer than a chunk are cut into pieces)"),
    Field("chunks", note="pieces per row"),
)
"""An (outer, r, inner) view reduced or normalized over r: the Params of reduce and softmax."""

OP_SUM, OP_MAX = 0, 1

REDUCE = Family(
    "reduce",
    bindings=(read("a", "A"), write("out", "O"), PARAMS),
    params=_ROWS_PARAMS,
    constants=(
        const("OP_SUM", OP_SUM),
        const("OP_MAX", OP_MAX),
        override("OP", OP_SUM),
        override("MEAN", False, "bool"),
    ),
    workgroup=DEFAULT_WORKGROUP,
)

SOFTMAX = Family(
    "softmax",
    bindings=(
        read("a", "A"),
        write("out", "O"),
        PARAMS,
        write("partials", "f32", "long rows: (max, sum) per piece"),
    ),
    params=_ROWS_PARAMS,
    workgroup=DEFAULT_WORKGROUP,
)

WARP, WARPS = 32, 8
GEMV = (
    const("WARP", WARP, note="invocations per output in the GPU-form GEMVs"),
    const("WARPS", WARPS, note="outputs per workgroup of the GPU-form GEMVs"),
    const("GEMV_WG", WARP * WARPS, note="WARP * WARPS: the GPU-form GEMV workgroup"),
)
"""The GPU-form GEMV shape (matmul_gemv_t, matmul_q*_warp): a group of WARP invocations per output."""

TILE = 64

MATMUL = Family(
    "matmul",
    bindings=(
        read("a", "A"),
        read("b", "A"),
        write("out", "O"),
        PARAMS,
        read("bias", "A", "per output column, added when HAS_BIAS"),
    ),
    params=(
        Field("m"),
        Field("n"),
        Field("k"),
        Field("batch_ndim"),
        Field("strides", "vec4<u32>", "a_sm, a_sk, b_sk, b_sn"),
        Field("split_k", "vec4<u32>", "k_chunk (a multiple of TK when splits > 1), splits, unused, unused"),
        Field("batch_shape", DIMS_U32),
        Field("a_batch_strides", DIMS_U32),
        Field("b_batch_strides", DIMS_U32),
    ),
    constants=(
        override("HAS_BIAS", False, "bool"),
        const("TILE", TILE, note="output tile edge of the tiled kernel"),
        const("TK", TILE // 4, note="k tile depth of the tiled kernel (its workgroup's y extent stages k)"),
        const("TILE_WG", TILE // 4, note="the tiled kernel's workgroup is TILE_WG x TILE_WG, 4x4 outputs each"),
        const("SKINNY_ROWS", 8, note="rows of a that the skinny and GEMV kernels take at most"),
        const("SKINNY_COLUMNS", 8, note="output columns per invocation of matmul_skinny"),
        const("SKINNY_WG", 64, note="matmul_skinny's workgroup"),
        *GEMV,
        const("BIG", 128, cuda_only=True, note="matmul_128 / matmul_mma_f16 output tile edge"),
        const("BIG_K", 8, cuda_only=True, note="k per shared tile step of matmul_128"),
        const("BIG_WG", 256, cuda_only=True, note="threads per block of matmul_128 / matmul_mma_f16"),
        const("MMA_PAD", 40, cuda_only=True, note="halves per row of a matmul_mma_f16 tile: 32 k + 8 of padding"),
    ),
    native_only=frozenset({"matmul_128", "matmul_mma_f16"}),
)

QMATMUL = Family(
    "qmatmul",
    bindings=(
        read("x", "vec4<f32>"),
        read("w", "u32"),
        write("out", "O"),
        PARAMS,
        read("bias", "A"),
    ),
    params=(
        Field("m"),
        Field("n"),
        Field("k"),
        Field("blocks", note="blocks per row = k / 32"),
        Field("block_chunk", note="blocks per split (split-K)"),
        Field("splits"),
    ),
    constants=(
        override("HAS_BIAS", False, "bool"),
        override("SWIGLU", False, "bool", note="epilogue: out[m, i] = silu(acc[m, 2i]) * acc[m, 2i + 1]"),
        const("ROWS", 8, note="output features per invocation of matmul_q4_1 / matmul_q8_0"),
        const("XROWS", 4, note="rows of x per invocation of matmul_q4_1 / matmul_q8_0 / matmul_blocks"),
        *GEMV,
    ),
    workgroup=64,
    half=True,
)

NORM = Family(
    "norm",
    bindings=(
        read("x", "A"),
        read("w", "A"),
        read("extra", "A", "layer_norm bias, or the residual"),
        write("out", "A"),
        write("summed", "A"),
        PARAMS,
        write("partials", "f32", "long rows: statistics per piece"),
    ),
    params=(Field("rows"), Field("d"), Field("eps", "f32"), Field("chunk", note="piece length of long rows")),
    workgroup=DEFAULT_WORKGROUP,
    half=True,
)

ATTENTION_WG = 64

ATTENTION = Family(
    "attention",
    bindings=(
        read("src", "A", "rope x, kv_write / scatter_rows new rows, attention q"),
        read("table", "f32", "rope inverse frequencies"),
        read("keys", "B", "k cache or pool (B: its dtype, which may differ from q's in paged attention)"),
        read("values", "B"),
        write("dst", "A", "rope/attention output, kv cache, scatter_rows table"),
        PARAMS,
        SCALARS,
        read("partials_in", "f32"),
        write("partials_out", "f32"),
        read("indices", "i32", "rope_positions: positions; scatter_rows: target rows; paged attention: seq"),
        read("lengths", "i32", "paged attention: positions each query row attends over"),
        read("block_tables", "i32", "paged attention: (sequences, max_blocks) pool blocks"),
        write("keys_out", "B", "rope_kv_write: the k cache written (B: the caches' dtype)"),
        write("values_out", "B", "rope_kv_write: the v cache written"),
        read("rows", "i32", "rope_kv_scatter: the cache row of each token (negative: skipped)"),
    ),
    params=(
        Field("tokens"),
        Field("heads"),
        Field("kv_heads"),
        Field("head_dim"),
        Field("cache_len", note="cache / pool rows (scatter_rows: table rows)"),
        Field("pos_slot"),
        Field("pos_literal"),
        Field("causal"),
        Field("scale", "f32"),
        Field("split_rows", note="cache rows (positions) of one *_partial block (scores' length)"),
        Field("splits", note="partials per (token, head): written, or read by merge/combine"),
        Field("fan_in", note="partials attention_merge folds into one"),
        Field("block_size", note="paged attention: pool rows per block"),
        Field("max_blocks", note="paged attention: block-table columns"),
        Field("sequences", note="paged attention: block-table rows"),
        Field("window", note="attention: positions a query sees, its own included (0: all)"),
    ),
    constants=(
        override("SMAX", 1, runtime=True, note="scores' length: cache rows one workgroup takes"),
        override("HEAD_DIM", 1, runtime=True),
        const("NO_SLOT", NO_SLOT, note="pos_slot of a literal position"),
        const("NO_ROW", 0xFFFFFFFF, note="paged attention: a position whose block is not in the pool"),
        const("TWO_PI", 6.283185307179586, "f32"),
        const("TWO_PI_HI", 6.28125, "f32", note="2 pi in two parts (Cody-Waite): k * TWO_PI_HI is exact in f32"),
        const("TWO_PI_LO", 0.0019353071795864769, "f32"),
        const("LOWEST", -3.4028234e38, "f32"),
        const("PARTIAL_HEADER", 2, note="a partial's max and sum, then its head_dim weighted sums"),
        const(
            "ROWS_SHARED",
            bounds.WORKGROUP_BYTES // 4 - ATTENTION_WG,
            cuda_only=True,
            note="floats of the paged kernels' static shared scores + query row (the tree takes WG more)",
        ),
    ),
    workgroup=ATTENTION_WG,
    half=True,
)

GATHER = Family(
    "gather",
    bindings=(
        read("ids", "i32", "embedding: ids; argmax_candidates: candidates"),
        read("table", "A"),
        write("out", "O"),
        PARAMS,
        write("indices", "i32"),
        read("qtable", "u32", "quantized table (batchgpu/quant.py layout)"),
    ),
    params=(
        Field("count", note="embedding: number of ids; argmax: rows"),
        Field("width", note="embedding: row width; argmax: row length"),
        Field("rows", note="embedding: table rows"),
        Field("chunk", note="argmax: piece length (the row length for rows taken whole)"),
    ),
    workgroup=DEFAULT_WORKGROUP,
)

SAMPLING = Family(
    "sampling",
    bindings=(
        read("logits", "A"),
        read("seen", "i32", "penalize: prompt + output token counts"),
        read("generated", "i32", "penalize: output token counts"),
        read("penalties", "f32", "penalize: (repetition, presence, frequency) per row"),
        read("settings", "f32", "sample: (temperature, top_p, min_p, masked) per row (sample_masked: != 0 masks)"),
        read("top_k", "i32", "sample: per row (off: <= 0 or >= width); logprobs: top ids per row (< 0: row skipped)"),
        read("keys", "u32", "sample: (seed, counter) per row"),
        write("out", "O", "penalize: logits; sample: ids; logprobs: (rows, LOGPROB_WIDTH) f32"),
        write("counts", "Counter", "count_*: (rows, width) counts, atomic<i32> (the shaders alias Counter)"),
        read("slots", "i32", "count_add: the counts row of each id (-1: skip)"),
        read("ids", "i32", "count_add: the token ids; logprobs: the target id per row"),
        read("reset", "i32", "count_reset: rows to zero"),
        PARAMS,
        read("allowed", "u32", "sample_masked: (rows, ceil(width / 32)) bitmask, bit t & 31 of word t >> 5"),
    ),
    params=(Field("rows"), Field("width"), Field("count", note="count_add: number of (slot, id) pairs")),
    constants=(
        const("BINS", 16, note="buckets of sample's threshold search per pass"),
        const("BIN_BITS", 4, note="log2(BINS): key bits one search pass settles"),
        const("SEARCH_PASSES", 8, note="32 / BIN_BITS: passes that settle a 32-bit key"),
        const("MAX_TOP", 20, note="logprobs: most top ids per row (OpenAI's top_logprobs limit)"),
        const("LOGPROB_WIDTH", 41, note="logprobs: floats per row: the target's, MAX_TOP ids, MAX_TOP values"),
        const("MASK_WORDS", 32, note="sample_masked: words of an invocation's allowed bits (one per element)"),
        const("NO_INDEX", 0xFFFFFFFF, note="sample_masked: a row with no allowed token (its id: -1)"),
    ),
    workgroup=DEFAULT_WORKGROUP,
)

FUSED = Family(
    "fused",
    bindings=(
        *(read(f"in{k}", f"I{k}") for k in range(MAX_FUSED_INPUTS)),
        write("out", "O"),
        PARAMS,
    ),
    params=(
        Field("n"),
        Field("ndim"),
        Field("shape", DIMS_U32),
        Field("strides", "array<vec4<u32>, 12>", "MAX_DIMS strides per input (read by STRIDED inputs)"),
        Field("constants", "array<vec4<u32>, 64>", "the program's constants, as the bits of their compute type"),
    ),
    constants=(const("MAX_DIMS", MAX_DIMS),),
    workgroup=DEFAULT_WORKGROUP,
)
"""Fused elementwise chains (:mod:`batchgpu.fusion`): a program of op expressions over up to
``MAX_FUSED_INPUTS`` inputs of their own dtypes (aliases I0..I5) and up to ``MAX_FUSED_CONSTANTS``
constants (the Python scalars of the chain's ops, in ``Params``: their values never enter the program
text, so one pipeline serves every value), rendered per launch by :mod:`batchgpu.ops.fused`."""

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (ELEMENTWISE, COPY, REDUCE, SOFTMAX, MATMUL, NORM, ATTENTION, GATHER, QMATMUL, SAMPLING, FUSED)
}
"""Every built-in shader family by name (``Launch.family``)."""
