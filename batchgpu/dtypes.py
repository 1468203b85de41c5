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

CUDA_TYPE: dict[str, str] = {"f32": "float", "f16": "bg_half", "i32": "int", "u32": "unsigned"}
"""CUDA type of each WGSL scalar type (float16 is a 2-byte storage struct, shaders/cuda/prelude.cuh)."""


DTYPE_NAMES: dict[str, np.dtype] = {"f32": FLOAT32, "f16": FLOAT16, "i32": INT32, "u32": UINT32}
"""Short names (the WGSL ones, as ``batch.scalar`` takes them) accepted wherever a dtype is."""

_CAST_HINT = {"f": "np.float32", "c": "np.float32", "i": "np.int32", "b": "np.int32", "u": "np.uint32"}


def as_dtype(dtype: Any, *, what: str = "dtype") -> np.dtype:
    """Return the numpy dtype for ``dtype`` if batchgpu supports it, else raise DTypeError. Accepts numpy
    dtypes and their names, the short names of :data:`DTYPE_NAMES`, and either byte order."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise DTypeError(f"{what}: {dtype!r} is not a dtype") from None
    native = resolved.newbyteorder("=")
    if native not in SUPPORTED:
        names = ", ".join(d.name for d in SUPPORTED)
        raise DTypeError(
            f"{what}: dtype {resolved.name} is not supported (expected one of {names}, or f32/f16/i32/u32)"
        )
    return native


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The numpy dtype the reference computes in (float16 is computed in float32)."""
    return FLOAT32 if dtype == FLOAT16 else dtype


def host_array(data: Any, dtype: Any = None, *, what: str) -> np.ndarray:
    """Convert user data to a native-byte-order, C-contiguous array of a supported dtype.

    Without ``dtype``, an array must already have a supported dtype (either byte order): a float64 or
    int64 array is an error rather than a silent cast. Python numbers and nested lists take the default
    dtypes, as in torch: floats give float32, ints int32 (when they fit). With ``dtype`` the data is
    cast on the host; integer targets refuse values they cannot hold (out of range, NaN, inf).
    """
    array = _as_array(data, what)
    if dtype is not None:
        target = as_dtype(dtype, what=what)
        _check_cast(array, target, what)
    elif _python_data(data):
        target = _python_default(array, what)
    else:
        target = array.dtype.newbyteorder("=")
        if target not in SUPPORTED:
            hint = _CAST_HINT.get(array.dtype.kind)
            raise DTypeError(
                f"{what}: got an array of dtype {array.dtype.name}; expected one of "
                f"{', '.join(d.name for d in SUPPORTED)}" + (f" (pass dtype={hint} to cast it)" if hint else "")
            )
    return np.asarray(array, dtype=target, order="C")  # unlike ascontiguousarray, keeps 0-d data 0-d


def host_copy(data: Any, dtype: Any = None, *, what: str) -> np.ndarray:
    """:func:`host_array` that never shares memory with ``data``: what a batch keeps for later uploads."""
    array = host_array(data, dtype, what=what)
    if isinstance(data, np.ndarray) and np.may_share_memory(array, data):
        array = array.copy()
    return array


def _as_array(data: Any, what: str) -> np.ndarray:
    if isinstance(data, (str, bytes, bytearray, memoryview)):
        raise DTypeError(f"{what}: got {type(data).__name__} data; pass a numpy array or numbers")
    try:
        array = np.asarray(data)
    except (ValueError, TypeError) as exc:
        raise DTypeError(f"{what}: cannot make an array of the given {type(data).__name__}: {exc}") from None
    if array.dtype.kind not in "biufc":
        raise DTypeError(
            f"{what}: got data of dtype {array.dtype.name} (from {type(data).__name__}); expected numbers "
            f"(a numpy array or nested lists of numbers)"
        )
    return array


def _python_data(data: Any) -> bool:
    """Python numbers or (nested) lists/tuples of them, as opposed to arrays that carry a dtype."""
    return isinstance(data, (int, float, list, tuple)) and not isinstance(data, (bool, np.generic))


def _python_default(array: np.ndarray, what: str) -> np.dtype:
    if array.dtype.kind == "f":
        return FLOAT32
    if array.dtype.kind in "iu":
        info = np.iinfo(INT32)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise DTypeError(f"{what}: integers out of int32 range; pass dtype=np.uint32 or dtype=np.float32")
        return INT32
    raise DTypeError(f"{what}: got Python {array.dtype.name} values; pass numbers and a dtype (e.g. dtype=np.int32)")


def _check_cast(array: np.ndarray, target: np.dtype, what: str) -> None:
    """Refuse a host cast into an integer dtype that would not hold every value."""
    if target.kind not in "iu" or array.size == 0 or array.dtype == target:
        return
    info = np.iinfo(target)
    if array.dtype.kind in "fc" and not np.isfinite(array).all():
        raise DTypeError(f"{what}: cannot cast NaN or inf to {target.name}")
    if array.dtype.kind == "b":
        return
    low, high = array.min(), array.max()
    if low < info.min or high > info.max:
        raise DTypeError(
            f"{what}: values from {low} to {high} do not fit {target.name} ({info.min} .. {info.max}); "
            f"cast them yourself if wrapping is meant"
        )
