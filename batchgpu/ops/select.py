"""``where(cond, a, b)``: ``a`` where ``cond`` is non-zero, else ``b``, all three broadcast like numpy. It runs
as a program of the fused elementwise family (:mod:`batchgpu.ops.fused`): three loads and one select,
the condition tested in its own type (any dtype; a comparison's uint32 mask), the values in theirs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..dtypes import WGSL_COMPUTE_TYPE, WGSL_TYPE
from ..errors import ShapeError
from ..kernels import Launch
from ..tensor import Tensor
from .common import check_rank
from .elementwise import read_mode
from .fused import Apply, Load, program_launch
from .spec import Node, OpSpec, same_dtype


def _where_infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[tuple[int, ...], np.dtype]:
    cond, a, b = inputs
    dtype = same_dtype("where", (a, b), ("a", "b"))
    for tensor in inputs:
        check_rank("where", tensor)
    try:
        shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    except ValueError:
        raise ShapeError(
            f"where: cannot broadcast cond {cond.describe()}, a {a.describe()} and b {b.describe()} together"
        ) from None
    return tuple(shape), dtype


def _where_reference(arrays: list[np.ndarray], params: dict[str, Any]) -> np.ndarray:
    cond, a, b = arrays
    return np.where(cond != 0, a, b)


def _where_lower(node: Node) -> list[Launch]:
    cond, a, b = node.inputs
    out = node.output
    ctype, condition = WGSL_COMPUTE_TYPE[out.dtype], WGSL_COMPUTE_TYPE[cond.dtype]
    program = [
        Load(0, condition, read_mode(cond, out.shape)),
        Load(1, ctype, read_mode(a, out.shape)),
        Load(2, ctype, read_mode(b, out.shape)),
        Apply(f"where_{condition}", (0, 1, 2), ctype, WGSL_TYPE[out.dtype]),
    ]
    return [program_launch("where", program, (cond, a, b), out, ctype)]


WHERE = OpSpec(
    name="where",
    infer=_where_infer,
    reference=_where_reference,
    lower=_where_lower,
    doc="a where cond is non-zero (NaN counts), else b; broadcasting like numpy.where",
)

SPECS: list[OpSpec] = [WHERE]
