"""The op-spec table entry and the recorded graph node. One spec drives recording (shape and dtype
inference with validation), the numpy reference, and lowering to executor-neutral launches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..dtypes import FLOATS, INT32
from ..errors import DTypeError, ShapeError
from ..kernels import Launch
from ..tensor import Storage, Tensor

Shape = tuple[int, ...]
InferFn = Callable[[Sequence[Tensor], dict[str, Any]], tuple[Shape, np.dtype]]
ReferenceFn = Callable[[list[np.ndarray], dict[str, Any]], np.ndarray | None]
LowerFn = Callable[["Node"], list[Launch]]
DtypeClass = Literal["all", "float", "signed"]
"""The dtypes an op accepts: all, floats (float32, float16), or signed (floats and int32)."""
Domain = Literal["any", "positive"]


@dataclass(frozen=True)
class OpSpec:
    """Everything batchgpu knows about one op.

    ``infer`` validates inputs and returns the output shape and dtype (None for in-place ops);
    ``reference`` computes the output with numpy (float16 inputs arrive as float32);
    ``lower`` turns a node into launches; ``view`` ops share their input's storage and launch nothing.
    ``dtypes`` is the dtype class the op accepts; ``domain`` tells tests which random inputs are valid
    (``"any"`` or ``"positive"``); ``doc`` describes the op (elementwise ops: their batch method's doc).
    """

    name: str
    infer: InferFn
    reference: ReferenceFn
    lower: LowerFn | None = None
    view: bool = False
    dtypes: DtypeClass = "all"
    domain: Domain = "any"
    doc: str = ""
    inplace: tuple[int, ...] | str = ()  # inputs the op writes in place ("all" for custom kernels)
    quantized: tuple[int, ...] = ()  # inputs that may be quantized weights (QuantTensor): their kernels dequantize
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Validates and completes the params before the op is recorded (custom kernels: grid, scalars)."""
    literal_operands: bool = True  # Python numbers among the operands become 0-d constants
    operands_name: str = ""  # errors name operand i "<operands_name>[i]"; default a/b, else inputs[i]

    def operand_name(self, index: int, count: int) -> str:
        """How errors name operand ``index`` of ``count``."""
        if self.operands_name:
            return f"{self.operands_name}[{index}]"
        return ("a", "b")[index] if count == 2 else f"inputs[{index}]"


@dataclass(eq=False)
class Node:
    """One recorded op: its spec, input tensors, parameters and outputs, lowered to launches."""

    spec: OpSpec
    inputs: tuple[Tensor, ...]
    params: dict[str, Any]
    outputs: tuple[Tensor, ...] = ()
    launches: list[Launch] = field(default_factory=list)
    scratch: list[Storage] = field(default_factory=list)
    constants: list[tuple[Storage, np.ndarray]] = field(default_factory=list)

    @property
    def output(self) -> Tensor:
        return self.outputs[0]

    def written(self) -> list[Storage]:
        """Storages this node writes: its outputs and any inputs it updates in place."""
        inplace = range(len(self.inputs)) if self.spec.inplace == "all" else self.spec.inplace
        return [t.storage for t in self.outputs] + [self.inputs[i].storage for i in inplace]

    def new_constant(self, array: np.ndarray) -> Storage:
        """A storage holding ``array`` (a lookup table), uploaded once with the batch's constants."""
        storage = Storage(array.nbytes, "const", array.dtype)
        self.constants.append((storage, array))
        return storage

    def new_scratch(self, nbytes: int, dtype: np.dtype) -> Storage:
        """A temporary storage that lives as long as the batch, private to this node."""
        storage = Storage(nbytes, "scratch", dtype)
        self.scratch.append(storage)
        return storage


def check_dtype(op: str, spec_dtypes: DtypeClass, tensor: Tensor, argument: str = "x") -> None:
    """Raise DTypeError when ``tensor``'s dtype is outside the op's dtype class."""
    allowed = {
        "all": True,
        "float": tensor.dtype in FLOATS,
        "signed": tensor.dtype in FLOATS or tensor.dtype == INT32,
    }[spec_dtypes]
    if not allowed:
        wanted = {"float": "float32 or float16", "signed": "float32, float16 or int32"}[spec_dtypes]
        raise DTypeError(f"{op}: {argument} {tensor.describe()} has dtype {tensor.dtype.name}; expected {wanted}")


def same_dtype(op: str, tensors: Sequence[Tensor], names: Sequence[str]) -> np.dtype:
    """All tensors must share one dtype; returns it."""
    first = tensors[0]
    for tensor, name in zip(tensors[1:], names[1:]):
        if tensor.dtype != first.dtype:
            raise DTypeError(
                f"{op}: {name} {tensor.describe()} has dtype {tensor.dtype.name}, but {names[0]} has "
                f"{first.dtype.name}; cast one of them first"
            )
    return first.dtype


def normalize_axis(op: str, axis: int, ndim: int, tensor: Tensor) -> int:
    """Map a possibly negative axis into ``range(ndim)`` or raise ShapeError (a 0-d tensor has no axis,
    as in numpy)."""
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ShapeError(f"{op}: axis {axis!r} is out of range for {tensor.describe()} (ndim {ndim})")
    return int(axis) % ndim
