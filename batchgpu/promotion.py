"""Type promotion for elementwise ops of mixed operands, as numpy and torch users expect it of batchgpu's
dtypes (float32, float16, int32, uint32): floats win over integers (int32 + float32 -> float32, as torch;
numpy would widen to float64, which batchgpu does not have), the wider float wins (float16 + float32 ->
float32), a float scalar makes an integer tensor float32, and ops defined on floats only (``div``,
``sqrt``, ...) compute integers as float32 (``int / int`` is true division, as in both). int32 with uint32
has no common supported dtype (numpy gives int64) and is refused.

Scalars (:func:`scalar_value`: Python ints and floats, numpy integer and floating scalars, 0-d numeric
arrays) are weak, as Python numbers are in torch and NumPy 2: only their kind (integer or float) counts,
never their width, so ``float16_tensor * np.float64(0.5)`` stays float16 (NumPy 2 would give float64,
which batchgpu does not have) and ``int32_tensor * np.float16(2)`` is float32, as with ``2.0``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .dtypes import FLOAT32, FLOATS
from .errors import DTypeError


def promote_types(
    op: str, dtypes: Sequence[np.dtype], *, python_float: bool = False, floats_only: bool = False
) -> np.dtype:
    """The dtype ``op`` computes in for tensor operands of ``dtypes`` (at least one), with a float scalar
    among the operands (``python_float``: :func:`has_float_scalar`), for an op defined on floats only
    (``floats_only``)."""
    distinct = set(dtypes)
    floating = distinct & FLOATS
    if floating:
        return FLOAT32 if len(floating) > 1 else floating.pop()
    if len(distinct) > 1:
        names = " and ".join(sorted(d.name for d in distinct))
        raise DTypeError(
            f"{op}: {names} operands have no common supported dtype (numpy would widen to int64); cast one of "
            "them first, e.g. x.astype(np.int32)"
        )
    return FLOAT32 if python_float or floats_only else distinct.pop()


def scalar_value(value: Any) -> int | float | None:
    """The Python number an op operand stands for when it is a scalar: a Python int or float, a numpy
    integer or floating scalar (``np.float64(0.125)``, ``np.int32(3)``) or a 0-d array of one, as the
    exact int or float; None for anything else (tensors, arrays with dimensions, bools, complex numbers,
    timedeltas, strings)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, np.generic):
        kind = value.dtype.kind
        return int(value) if kind in "iu" else float(value) if kind == "f" else None
    if isinstance(value, (int, float)):
        return int(value) if isinstance(value, int) else float(value)
    return None


def has_float_scalar(operands: Iterable[Any]) -> bool:
    """Whether a float scalar (Python or numpy, see :func:`scalar_value`) is among ``operands``."""
    return any(isinstance(scalar_value(operand), float) for operand in operands)
