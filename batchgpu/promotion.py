"""Type promotion for elementwise ops of mixed operands, as numpy and torch users expect it of batchgpu's
dtypes (float32, float16, int32, uint32): floats win over integers (int32 + float32 -> float32, as torch;
numpy would widen to float64, which batchgpu does not have), the wider float wins (float16 + float32 ->
float32), a Python float makes an integer tensor float32, and ops defined on floats only (``div``,
``sqrt``, ...) compute integers as float32 (``int / int`` is true division, as in both). int32 with uint32
has no common supported dtype (numpy gives int64) and is refused."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .dtypes import FLOAT32, FLOATS
from .errors import DTypeError


def promote_types(
    op: str, dtypes: Sequence[np.dtype], *, python_float: bool = False, floats_only: bool = False
) -> np.dtype:
    """The dtype ``op`` computes in for tensor operands of ``dtypes`` (at least one), with a Python float
    among the operands (``python_float``), for an op defined on floats only (``floats_only``)."""
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
