"""Per-execute scalars: symbolic values (a decode position, a sequence length) that ops read from one
small uniform buffer written by every ``execute(scalars={...})``: no re-recording, no new pipeline."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Protocol

from .errors import BatchError, DTypeError, LimitError
from .promotion import scalar_value

SCALAR_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}
MAX_SCALARS = 64
SCALAR_BYTES = 4 * MAX_SCALARS
"""The scalar uniform buffer: ``array<vec4<u32>, 16>`` in WGSL, one 4-byte slot per scalar."""

NO_SLOT = 0xFFFFFFFF
"""Slot value telling a kernel to use the literal instead of a scalar."""


class ScalarBatch(Protocol):
    """The batch that declares a scalar, as scalars use it: a :class:`~batchgpu.GpuCommandBatch` (a layer
    above this module), named in errors."""

    name: str


class Scalar:
    """A named per-execute value of a batch, created by ``batch.scalar(name, dtype)``."""

    __slots__ = ("name", "dtype", "slot", "batch", "bounds")

    def __init__(self, name: str, dtype: str, slot: int, batch: ScalarBatch) -> None:
        self.name = name
        self.dtype = dtype
        self.slot = slot
        self.batch = batch
        self.bounds: list[tuple[int, str]] = []  # (largest allowed value, why) added by ops

    def __repr__(self) -> str:
        return f"Scalar({self.name!r}, {self.dtype})"

    def require_at_most(self, largest: int, why: str) -> None:
        """Record a bound every execute checks (e.g. a cache position must fit the cache)."""
        self.bounds.append((largest, why))


def check_value(scalar: Scalar, value: object) -> int | float:
    """Validate one execute-time value of ``scalar``: a number as ops take them
    (:func:`batchgpu.promotion.scalar_value`: Python or numpy, a 0-d array; no bools); returns it as a
    Python number."""
    given = scalar_value(value)
    if scalar.dtype == "f32":
        if given is None:
            raise DTypeError(f"execute: scalar {scalar.name!r} (f32) got {type(value).__name__} {value!r:.40}")
        return float(given)
    if given is None or (isinstance(given, float) and not given.is_integer()):
        raise DTypeError(f"execute: scalar {scalar.name!r} ({scalar.dtype}) needs an int, got {value!r:.40}")
    number = int(given)
    low, high = (0, 2**32 - 1) if scalar.dtype == "u32" else (-(2**31), 2**31 - 1)
    if not low <= number <= high:
        raise DTypeError(f"execute: scalar {scalar.name!r} = {number!r:.40} is out of range for {scalar.dtype}")
    for largest, why in scalar.bounds:
        if number > largest:
            raise LimitError(f"execute: scalar {scalar.name!r} = {number} exceeds {largest}: {why}")
    return number


def resolve(scalars: Mapping[str, Scalar], current: Mapping[str, int | float], given: Mapping[str, object]) -> dict:
    """The full set of scalar values for one execute: ``current`` updated by validated ``given``."""
    values = dict(current)
    for name, value in given.items():
        if name not in scalars:
            known = ", ".join(sorted(scalars)) or "none"
            raise BatchError(f"execute: unknown scalar {name!r} (this batch declares: {known})")
        values[name] = check_value(scalars[name], value)
    return values


def uniform_bytes(scalars: Sequence[Scalar], values: Mapping[str, int | float]) -> bytes:
    """The uniform buffer contents for ``values``."""
    data = bytearray(SCALAR_BYTES)
    for scalar in scalars:
        struct.pack_into("<" + SCALAR_FORMATS[scalar.dtype], data, 4 * scalar.slot, values[scalar.name])
    return bytes(data)


def operand(value: Scalar | int) -> tuple[int, int]:
    """(slot, literal) for a kernel parameter that is either a Scalar or a fixed int."""
    if isinstance(value, Scalar):
        return value.slot, 0
    return NO_SLOT, int(value)
