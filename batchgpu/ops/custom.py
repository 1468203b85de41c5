"""Custom kernels: ``batch.launch(kernel, grid, buffers, scalars)`` runs user WGSL on tensors in place."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ArgumentError, BatchError, DTypeError, LimitError, UnsupportedError
from ..kernels import Binding, Kernel, Launch
from ..tensor import Tensor
from .spec import Node, OpSpec


def normalize_grid(kernel: Kernel, grid: int | Sequence[int]) -> tuple[int, int, int]:
    """A 3-tuple of positive workgroup counts."""
    integral = (int, np.integer)
    dims = (grid,) if isinstance(grid, integral) else grid
    if (
        not isinstance(dims, (tuple, list))
        or not 1 <= len(dims) <= 3
        or not all(isinstance(d, integral) and not isinstance(d, (bool, np.bool_)) for d in dims)
    ):
        raise LimitError(f"launch {kernel.name}: grid must be an int or 1 to 3 ints, got {grid!r}")
    if any(d < 1 for d in dims):
        raise LimitError(f"launch {kernel.name}: grid {tuple(dims)} has a workgroup count below 1")
    padded = tuple(int(d) for d in dims) + (1,) * (3 - len(dims))
    return (padded[0], padded[1], padded[2])


F32_MAX = float(np.finfo(np.float32).max)


def kernel_uniform(kernel: Kernel, scalars: Sequence[Any]) -> bytes:
    """Scalars as a uniform struct of 4-byte fields: float -> f32, int -> i32 (u32 above 2**31 - 1),
    numpy scalars keep their dtype; padded to 16 bytes. Values a 4-byte field cannot hold are refused."""
    if isinstance(scalars, (str, bytes)) or not isinstance(scalars, (tuple, list)):
        raise ArgumentError(f"launch {kernel.name}: scalars must be a list of numbers, got {scalars!r}")
    out = b""
    for i, value in enumerate(scalars):
        out += _pack_scalar(kernel, i, value)
    return out + b"\0" * (-len(out) % 16)


def _pack_scalar(kernel: Kernel, index: int, value: Any) -> bytes:
    what = f"launch {kernel.name}: scalars[{index}] = {value!r}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(f"{what} is not an int or float")
    if isinstance(value, (np.floating, float)):
        if abs(float(value)) > F32_MAX and np.isfinite(value):
            raise DTypeError(f"{what} does not fit an f32 field (largest finite {F32_MAX:g})")
        return struct.pack("<f", float(value))
    number = int(value)
    if isinstance(value, np.unsignedinteger) or number > 2**31 - 1:
        if not 0 <= number <= 2**32 - 1:
            raise DTypeError(f"{what} does not fit a u32 field (0 .. {2**32 - 1})")
        return struct.pack("<I", number)
    if number < -(2**31):
        raise DTypeError(f"{what} does not fit an i32 field ({-(2**31)} .. {2**31 - 1})")
    return struct.pack("<i", number)


def _infer(inputs: Sequence[Tensor], params: dict[str, Any]) -> tuple[None, None]:
    kernel: Kernel = params["kernel"]
    seen: dict[int, int] = {}
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, Tensor):
            raise BatchError(f"launch {kernel.name}: buffers[{i}] is {type(tensor).__name__}, expected a Tensor")
        if tensor.storage.id in seen:
            raise BatchError(
                f"launch {kernel.name}: buffers[{i}] and buffers[{seen[tensor.storage.id]}] are the same storage "
                f"({tensor.describe()}); a read_write buffer can be bound once per launch"
            )
        seen[tensor.storage.id] = i
    return None, None


def _prepare(params: dict[str, Any]) -> dict[str, Any]:
    """``launch``'s params checked and completed: the Kernel, a 3-D grid, the scalars packed into the
    kernel's uniform struct (``packed_scalars``)."""
    kernel = params["kernel"]
    if not isinstance(kernel, Kernel):
        raise ArgumentError(f"launch: expected a batchgpu.Kernel, got {type(kernel).__name__}")
    packed = kernel_uniform(kernel, params["scalars"])
    return {
        **params,
        "grid": normalize_grid(kernel, params["grid"]),
        "scalars": tuple(params["scalars"]),
        "packed_scalars": packed,
    }


def _reference(arrays: list[np.ndarray], params: dict[str, Any]) -> None:
    kernel: Kernel = params["kernel"]
    if kernel.reference is None:
        raise UnsupportedError(
            f"launch {kernel.name}: the reference executor needs Kernel(..., reference=fn) to run a custom kernel"
        )
    kernel.reference(*arrays, *params["scalars"])


def _lower(node: Node) -> list[Launch]:
    kernel: Kernel = node.params["kernel"]
    bindings = [Binding(i, "write", t.storage, t.storage.nbytes) for i, t in enumerate(node.inputs)]
    params = node.params["packed_scalars"]
    if params:
        bindings.append(Binding(len(node.inputs), "uniform", None, len(params)))
    return [
        Launch(
            label=f"launch {kernel.name}",
            entry=kernel.entry,
            groups=node.params["grid"],
            bindings=tuple(bindings),
            params=params,
            kernel=kernel,
            workgroup_size=kernel.workgroup_size or (1, 1, 1),
            workgroup_bytes=kernel.workgroup_bytes,
        )
    ]


LAUNCH = OpSpec(
    name="launch",
    infer=_infer,
    reference=_reference,
    lower=_lower,
    inplace="all",
    doc="run a custom Kernel over a grid of workgroups, buffers bound read_write in place",
    prepare=_prepare,
    literal_operands=False,  # buffers are written in place: a number would silently become a constant
    operands_name="buffers",
)

SPECS: list[OpSpec] = [LAUNCH]
