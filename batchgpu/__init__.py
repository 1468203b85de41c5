"""batchgpu: record GPU compute as a small command graph, execute it with one submit, many times."""

from __future__ import annotations

import logging

from .batch import GpuCommandBatch, default_device
from .device import Device
from .errors import (
    ArgumentError,
    BatchError,
    CompileError,
    DeviceError,
    DeviceMismatchError,
    DTypeError,
    ExportError,
    GrammarError,
    LimitError,
    ModelFileError,
    NotExecutedError,
    OverloadedError,
    RequestError,
    ShapeError,
    UnsupportedError,
)
from .jit import Jit, jit
from .kernels import Kernel
from .limits import Limits
from .ops import OPS
from .profiling import Profile
from .tensor import Tensor

__version__ = "0.1.0"

logging.getLogger("batchgpu").addHandler(logging.NullHandler())  # compile events, cache hits/misses

__all__ = [
    "OPS",
    "ArgumentError",
    "BatchError",
    "CompileError",
    "DTypeError",
    "Device",
    "DeviceError",
    "DeviceMismatchError",
    "ExportError",
    "GpuCommandBatch",
    "Jit",
    "Kernel",
    "LimitError",
    "Limits",
    "ModelFileError",
    "NotExecutedError",
    "OverloadedError",
    "Profile",
    "GrammarError",
    "RequestError",
    "ShapeError",
    "Tensor",
    "UnsupportedError",
    "default_device",
    "jit",
]
