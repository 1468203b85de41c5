"""The dtypes batchgpu supports and how each maps to shader types and host arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import DTypeError

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
INT32 = np.dtype(np.int32)
UINT32 = np.dtype(np.uint32)

SUPPORTED: tuple[np.dtype, ...] = (FLOAT32, FLOAT16, INT32, UINT32)
FLOATS: frozenset[np.dtype] = frozenset({FLOAT32, FLOAT16})

WGSL_TYPE: dict[np.dtype, str] = {FLOAT32: "f32", FLOAT16: "f16", INT32: "i32", UINT32: "u32"}
"""Storage type of each dtype in WGSL."""

WGSL_COMPUTE_TYPE: dict[np.dtype, str] = {FLOAT32: "f32", FLOAT16: "f32", INT32: "i32", UINT32: "u32"}
"""Type arithmetic is done in: float16 computes in float32 and rounds once when stored."""


def as_dtype(dtype: Any, *, what: str = "dtype") -> np.dtype:
    """Return the numpy dtype for ``dtype`` if batchgpu supports it, else raise DTypeError."""
    try:
        resolved = np.dtype(dtype)
    except TypeError as exc:
        raise DTypeError(f"{what}: {dtype!r} is not a dtype") from exc
    if resolved not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise DTypeError(f"{what}: dtype {resolved.name} is not supported (expected one of {names})")
    return resolved


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The numpy dtype the reference computes in (float16 is computed in float32)."""
    return FLOAT32 if dtype == FLOAT16 else dtype


def host_array(data: Any, dtype: Any = None, *, what: str) -> np.ndarray:
    """Convert user data to a C-contiguous array of a supported dtype.

    Without ``dtype`` the data must already have a supported dtype: a float64 or int64 array is an
    error rather than a silent cast. With ``dtype`` the data is cast on the host.
    """
    array = np.asarray(data)
    if dtype is None:
        if array.dtype not in SUPPORTED:
            raise DTypeError(
                f"{what}: got an array of dtype {array.dtype.name}; expected one of "
                f"{', '.join(d.name for d in SUPPORTED)} (pass dtype=np.float32 to cast it)"
            )
        target = array.dtype
    else:
        target = as_dtype(dtype, what=what)
    return np.asarray(array, dtype=target, order="C")  # unlike ascontiguousarray, keeps 0-d data 0-d
