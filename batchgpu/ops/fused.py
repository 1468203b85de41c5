"""The fused elementwise op: a chain of recorded elementwise ops (and casts) run as one generated kernel.

:mod:`batchgpu.fusion` picks the chains; this module turns one chain into a :class:`Node` that stands for
all of them: a program (loads of the chain's external inputs and constants, then each op in recording
order), its numpy reference (the members' own references, intermediates rounded to their dtypes as the
unfused graph stores them), and one launch of the ``fused`` family whose ``FUNCTIONS`` / ``BODY`` snippets
:func:`render` writes in WGSL or CUDA from the op-expression table. A program's text is the snippet value,
so equal chains share one pipeline. The chain's constants (Python scalar operands) are words of the
launch's ``Params``: the program names their slots, never their values, so a chain recorded with other
constants shares the pipeline too.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from ..dtypes import CUDA_TYPE, FLOAT16, FLOAT32, WGSL_COMPUTE_TYPE, WGSL_TYPE
from ..kernels import MAX_DIMS, Launch
from ..tensor import Storage, Tensor
from .common import broadcast_strides, collapse, groups_for
from .elementwise import EXPRESSIONS, read_mode
from .interface import CONTIGUOUS, FUSED, MAX_FUSED_CONSTANTS, MAX_FUSED_INPUTS, SCALAR, STRIDED
from .spec import Node, OpSpec

PLACEHOLDERS = ("FUNCTIONS", "BODY")
"""The fused family's snippets: each filled with :func:`render` of the launch's program text."""

CAST = "cast"
"""The program's name of a conversion (the ``cast`` op): no expression, the target type's conversion."""

WHERE = "where"
"""The ``where`` op (batchgpu.ops.select): in a program, ``where_<condition's compute type>``."""


@dataclass(frozen=True)
class Load:
    """Input ``slot`` read in compute type ``ctype``, at the output index, as a scalar or strided (``mode``)."""

    slot: int
    ctype: str
    mode: int

    def text(self) -> str:
        return f"in{self.slot}:{self.ctype}:{self.mode}"


@dataclass(frozen=True)
class Const:
    """Constant ``slot`` of the launch's ``Params.constants``: the bits of a value of compute type ``ctype``."""

    slot: int
    ctype: str

    def text(self) -> str:
        return f"c{self.slot}:{self.ctype}"


@dataclass(frozen=True)
class Apply:
    """Op ``op`` (an op-expression table row, or :data:`CAST`) of earlier values ``args``; the result in
    compute type ``ctype``, rounded through storage type ``stype`` where that differs (float16)."""

    op: str
    args: tuple[int, ...]
    ctype: str
    stype: str

    def text(self) -> str:
        return f"{self.op}({','.join(map(str, self.args))}):{self.ctype}:{self.stype}"


Instruction = Load | Const | Apply
_LOAD = re.compile(r"in(\d+):(\w+):(\d)")
_CONST = re.compile(r"c(\d+):(\w+)")
_APPLY = re.compile(r"(\w+)\(([\d,]*)\):(\w+):(\w+)")


def program_text(program: Sequence[Instruction]) -> str:
    """The program as one line (the launch's snippet value): instructions separated by ``;``."""
    return ";".join(instruction.text() for instruction in program)


@functools.cache
def parse(text: str) -> tuple[Instruction, ...]:
    """The program of :func:`program_text`'s line."""
    program: list[Instruction] = []
    for part in text.split(";"):
        if load := _LOAD.fullmatch(part):
            program.append(Load(int(load[1]), load[2], int(load[3])))
        elif constant := _CONST.fullmatch(part):
            program.append(Const(int(constant[1]), constant[2]))
        elif apply := _APPLY.fullmatch(part):
            args = tuple(int(a) for a in apply[2].split(",") if a)
            program.append(Apply(apply[1], args, apply[3], apply[4]))
        else:
            raise ValueError(f"fused program: cannot read instruction {part!r} of {text!r}")
    return tuple(program)


# rendering ----------------------------------------------------------------------------------------

Language = Literal["wgsl", "cuda"]


@functools.cache
def render(placeholder: str, text: str, language: Language) -> str:
    """Placeholder ``FUNCTIONS`` or ``BODY`` of the fused family for program ``text`` in ``language``
    (CUDA: one line, the body of a ``#define``)."""
    program = parse(text)
    if placeholder == "FUNCTIONS":
        ops = sorted({i.op for i in program if isinstance(i, Apply) and i.op != CAST})
        return (" " if language == "cuda" else "\n").join(_function(op, language) for op in ops)
    if placeholder == "BODY":
        last = len(program) - 1
        lines = [_statement(j, program, language, rounded=j < last) for j in range(len(program))]
        lines.append(f"let result = v{last};" if language == "wgsl" else f"auto result = v{last};")
        return (" " if language == "cuda" else "\n    ").join(lines)
    raise KeyError(f"fused family: no placeholder {placeholder!r}")


SELECTS: dict[str, tuple[str, str]] = {
    "where_f32": ("(bitcast<u32>(x) & 0x7fffffffu) != 0u", "(__float_as_uint(x) & 0x7fffffffu) != 0u"),
    "where_i32": ("x != 0", "x != 0"),
    "where_u32": ("x != 0u", "x != 0u"),
}
"""``where(cond, a, b)`` per compute type of the condition: its truth test (non-zero, NaN included, as numpy's
``bool``) in WGSL and CUDA; the values are of the program's compute type ``C``. A float condition is tested
on its bits: WGSL may flush a subnormal to zero and assume no NaN or inf in a comparison."""


def _select_function(op: str, language: Language) -> str:
    ctype = op.rsplit("_", 1)[1]
    test = SELECTS[op][0 if language == "wgsl" else 1]
    if language == "wgsl":
        return f"fn op_{op}(x: {ctype}, y: C, z: C) -> C {{ return select(z, y, {test}); }}"
    return f"__device__ __forceinline__ C op_{op}({CUDA_TYPE[ctype]} x, C y, C z) {{ return ({test}) ? y : z; }}"


def _function(op: str, language: Language) -> str:
    if op in SELECTS:
        return _select_function(op, language)
    row = EXPRESSIONS[op]
    expression = row.text(language)
    if language == "wgsl":
        parameters = "x: C" if row.arity == 1 else "x: C, y: C"
        return f"fn op_{op}({parameters}) -> C {{ return {expression}; }}"
    parameters = "C x" if row.arity == 1 else "C x, C y"
    return f"__device__ __forceinline__ C op_{op}({parameters}) {{ return ({expression}); }}"


ROUND_FLOAT16: dict[Language, str] = {"wgsl": "round_f16", "cuda": "bg_round_f16"}
"""The function rounding an intermediate float32 value to float16 (shaders/wgsl/lib/half.wgsl, the CUDA
prelude) as the unfused op stores it: never a conversion to float16 and back, which a compiler may fold."""


FLOAT_TO_INT = {"i32": "f32_to_i32", "u32": "f32_to_u32"}
"""WGSL's cast of an f32 value to an integer type, as batchgpu's cast defines it (shaders/wgsl/lib/convert.wgsl:
toward zero, saturating, NaN to 0; CUDA's ``CVT`` converts so itself)."""


def _statement(index: int, program: Sequence[Instruction], language: Language, *, rounded: bool) -> str:
    """Value ``index`` of ``program``; an op's result rounded through its storage type where that is float16
    and ``rounded`` (every value but the last, which the kernel's store converts)."""
    instruction = program[index]
    wgsl = language == "wgsl"
    if isinstance(instruction, Load):
        k, mode = instruction.slot, instruction.mode
        at = {CONTIGUOUS: "i", SCALAR: "0u" if wgsl else "0", STRIDED: f"input_offset({'' if wgsl else 'p, '}i, {k})"}
        value = _convert(f"in{k}[{at[mode]}]", instruction.ctype, language)
        return _let(index, instruction.ctype, value, language)
    if isinstance(instruction, Const):
        return _let(index, instruction.ctype, _constant(instruction, language), language)
    args = ", ".join(f"v{a}" for a in instruction.args)
    value = f"op_{instruction.op}({args})"
    if instruction.op == CAST:
        to_int = wgsl and program[instruction.args[0]].ctype == "f32" and instruction.ctype in FLOAT_TO_INT
        value = f"{FLOAT_TO_INT[instruction.ctype]}({args})" if to_int else _convert(args, instruction.ctype, language)
    if rounded and instruction.stype != instruction.ctype:  # float16 (computed in f32): as the unfused op stores it
        value = f"{ROUND_FLOAT16[language]}({value})"
    return _let(index, instruction.ctype, value, language)


CONSTANT_BITS: dict[str, tuple[str, str]] = {
    "f32": ("bitcast<f32>({})", "__uint_as_float({})"),
    "i32": ("bitcast<i32>({})", "(int)({})"),
    "u32": ("{}", "{}"),
}
"""A constant's value from its 32-bit word, per compute type, in WGSL and CUDA: a reinterpretation of the
bits (no conversion: NaN, infinities, -0.0 and subnormals arrive as stored; WGSL has no literal for the
first two)."""


def _constant(instruction: Const, language: Language) -> str:
    k = instruction.slot
    word = f"p.constants[{k // 4}u][{k % 4}u]" if language == "wgsl" else f"p.constants[{k}]"
    return CONSTANT_BITS[instruction.ctype][0 if language == "wgsl" else 1].format(word)


def constant_word(value: np.ndarray) -> int:
    """A size-1 constant as the 32-bit word a fused kernel reads: the bits of its value in its compute type
    (float16 widened to float32, exactly)."""
    scalar = np.asarray(value).reshape(-1)[:1]
    if scalar.dtype == FLOAT16:
        scalar = scalar.astype(FLOAT32)
    return int(scalar.view(np.uint32)[0])


def _convert(value: str, wgsl_type: str, language: Language) -> str:
    return f"{wgsl_type}({value})" if language == "wgsl" else f"CVT({CUDA_TYPE[wgsl_type]}, {value})"


def _let(index: int, wgsl_type: str, value: str, language: Language) -> str:
    if language == "wgsl":
        return f"let v{index}: {wgsl_type} = {value};"
    return f"{CUDA_TYPE[wgsl_type]} v{index} = {value};"


# the fused node -------------------------------------------------------------------------------------


def is_fusible(node: Node) -> bool:
    """Whether ``node`` may join a fused chain: an op of the op-expression table, a cast or ``where``, on
    plain tensors (quantized weights stay with their kernels)."""
    name = node.spec.name
    return (name in EXPRESSIONS or name in (CAST, WHERE)) and all(
        type(t) is Tensor for t in (*node.inputs, *node.outputs)
    )


def compute_type(node: Node) -> str | None:
    """The compute type an op of a chain works in: its operands' (a comparison's too, whose uint32 mask
    the program converts to), ``where``'s values' (not its condition's); None for a cast, which converts
    between two."""
    if node.spec.name == CAST:
        return None
    operand = node.inputs[1] if node.spec.name == WHERE else node.inputs[0]
    return WGSL_COMPUTE_TYPE[operand.dtype]


def input_key(tensor: Tensor) -> tuple[Storage, tuple[int, ...]]:
    """Two operands with this key are one input of a fused kernel."""
    return tensor.storage, tensor.shape


@dataclass
class _Builder:
    """A program under construction: the chain's values by storage, its inputs by :func:`input_key`, its
    constants (storages of ``known``, which holds their values) in slot order."""

    shape: tuple[int, ...]
    known: Mapping[Storage, np.ndarray]
    program: list[Instruction] = field(default_factory=list)
    inputs: list[Tensor] = field(default_factory=list)
    constants: list[Storage] = field(default_factory=list)
    values: dict[Any, int] = field(default_factory=dict)

    def operand(self, tensor: Tensor, internal: set[Storage]) -> int:
        if tensor.storage in internal:
            return self.values[tensor.storage]
        if tensor.storage in self.known:
            return self._constant(tensor)
        key = input_key(tensor)
        if key not in self.values:
            self.inputs.append(tensor)
            mode = read_mode(tensor, self.shape)
            self.program.append(Load(len(self.inputs) - 1, WGSL_COMPUTE_TYPE[tensor.dtype], mode))
            self.values[key] = len(self.program) - 1
        return self.values[key]

    def _constant(self, tensor: Tensor) -> int:
        key = ("constant", tensor.storage)
        if key not in self.values:
            self.constants.append(tensor.storage)
            self.program.append(Const(len(self.constants) - 1, WGSL_COMPUTE_TYPE[tensor.dtype]))
            self.values[key] = len(self.program) - 1
        return self.values[key]

    def apply(self, member: Node, args: tuple[int, ...]) -> int:
        """Append ``member`` of values ``args``; the index of its result."""
        name, dtype = member.spec.name, member.output.dtype
        if name == WHERE:  # the condition tested in its own type
            name = f"{WHERE}_{self._ctype(args[0])}"
        elif name in EXPRESSIONS and EXPRESSIONS[name].mask:  # 0/1 in the operands' type, held as uint32
            operand = self._ctype(args[0])
            self.program.append(Apply(name, args, operand, operand))
            name, args = CAST, (len(self.program) - 1,)
        self.program.append(Apply(name, args, WGSL_COMPUTE_TYPE[dtype], WGSL_TYPE[dtype]))
        return len(self.program) - 1

    def _ctype(self, value: int) -> str:
        return self.program[value].ctype


def fuse_nodes(members: Sequence[Node], constants: Mapping[Storage, np.ndarray] = MappingProxyType({})) -> Node:
    """One node running ``members`` (a chain in recording order: every member but the last is read by one
    later member only, all of the last one's shape) as one kernel. Operands on a storage of ``constants``
    (size-1 constants no op writes, with their values) become constants of the kernel, not inputs."""
    root = members[-1]
    internal = {m.output.storage for m in members[:-1]}
    builder = _Builder(root.output.shape, constants)
    for member in members:
        args = tuple(builder.operand(t, internal) for t in member.inputs)
        builder.values[member.output.storage] = builder.apply(member, args)
    if len(builder.inputs) > MAX_FUSED_INPUTS or len(builder.constants) > MAX_FUSED_CONSTANTS:
        raise ValueError(
            f"fuse_nodes: {len(builder.inputs)} inputs and {len(builder.constants)} constants, at most "
            f"{MAX_FUSED_INPUTS} and {MAX_FUSED_CONSTANTS}"
        )
    values = {storage: constants[storage] for storage in builder.constants}
    name = "fused(" + "+".join(m.spec.name for m in members) + ")"
    spec = OpSpec(
        name=name,
        infer=lambda inputs, params: (root.output.shape, root.output.dtype),
        reference=_reference(members, builder.inputs, values),
        doc=f"{len(members)} elementwise ops in one kernel: " + ", ".join(m.output.name for m in members),
    )
    node = Node(spec, tuple(builder.inputs), {"members": tuple(members)}, (root.output,))
    words = [constant_word(value) for value in values.values()]
    node.launches = [_launch(name, builder.program, builder.inputs, root.output, members, words)]
    return node


def _reference(members: Sequence[Node], inputs: Sequence[Tensor], constants: Mapping[Storage, np.ndarray]):
    """The members' references in order; each result stored in its dtype and read back as the reference
    executor does (float16 as float32); ``constants`` as the reference executor reads them from their
    buffers."""
    slots = {input_key(t): k for k, t in enumerate(inputs)}
    internal = {m.output.storage for m in members[:-1]}
    held = {storage: value.astype(FLOAT32) if value.dtype == FLOAT16 else value for storage, value in constants.items()}

    def operand(tensor: Tensor, arrays: list[np.ndarray], values: dict[Storage, np.ndarray]) -> np.ndarray:
        if tensor.storage in internal:
            return values[tensor.storage]
        if tensor.storage in held:
            return held[tensor.storage].reshape(tensor.shape)
        return arrays[slots[input_key(tensor)]]

    def reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
        values: dict[Storage, np.ndarray] = {}
        result = None
        for member in members:
            args = [operand(t, arrays, values) for t in member.inputs]
            for tensor in member.inputs:  # an intermediate has one reader: free it (numpy reuses the memory)
                values.pop(tensor.storage, None)
            with np.errstate(over="ignore"):  # float32 past float16's range stores inf, as the GPU does
                result = np.asarray(member.spec.reference(args, member.params)).astype(member.output.dtype, copy=False)
            values[member.output.storage] = result.astype(FLOAT32) if result.dtype == FLOAT16 else result
        return result

    return reference


def _launch(
    name: str,
    program: Sequence[Instruction],
    inputs: Sequence[Tensor],
    out: Tensor,
    members: Sequence[Node],
    constants: Sequence[int],
) -> Launch:
    ctypes = {compute_type(m) for m in members} - {None}
    ctype = ctypes.pop() if ctypes else WGSL_COMPUTE_TYPE[out.dtype]
    return program_launch(name, program, inputs, out, ctype, constants)


def program_launch(
    name: str,
    program: Sequence[Instruction],
    inputs: Sequence[Tensor],
    out: Tensor,
    ctype: str,
    constants: Sequence[int] = (),
) -> Launch:
    """One launch of the fused family running ``program`` over ``inputs`` (broadcast to ``out``'s shape) in
    compute type ``ctype``, with ``constants`` (32-bit words, :func:`constant_word`) in its params."""
    strided = [k for k, t in enumerate(inputs) if read_mode(t, out.shape) == STRIDED]
    shape, strides = collapse(out.shape, *(broadcast_strides(inputs[k].shape, out.shape) for k in strided))
    flat = [0] * (MAX_FUSED_INPUTS * MAX_DIMS)
    for k, input_strides in zip(strided, strides):
        flat[k * MAX_DIMS : k * MAX_DIMS + len(input_strides)] = input_strides
    types = [(f"I{k}", WGSL_TYPE[inputs[k].dtype] if k < len(inputs) else "f32") for k in range(MAX_FUSED_INPUTS)]
    types += [("O", WGSL_TYPE[out.dtype]), ("C", ctype)]
    text = program_text(program)
    return FUSED.launch(
        label=name,
        entry="fused",
        types=tuple(types),
        snippets=tuple((placeholder, text) for placeholder in PLACEHOLDERS),
        constants=(("IS_FLOAT", ctype == "f32"),),
        groups=groups_for(out.size),
        params=dict(
            n=out.size,
            ndim=len(shape) if strided else 0,
            shape=shape if strided else (),
            strides=flat,
            constants=constants,
        ),
        buffers={**{f"in{k}": t for k, t in enumerate(inputs)}, "out": out},
    )
