"""``@bg.jit``: a Python function of tensors captured into a batch on its first call for each input
signature and replayed afterwards, one submit per call (tinygrad's ``TinyJit``, ``torch.cuda.graphs``).

The function receives batch tensors where it was given numpy arrays (inputs fed anew every call) and
gets resident tensors (weights) and other Python values as they are; it records ops on them through
tensor operators and methods (``x @ w``, ``(x * 2).relu()``) or through their batch (``x.batch.where``),
and returns a tensor or a tuple / list / dict of them. A call returns the same structure with numpy
arrays. A new signature (array shapes and dtypes, which resident tensors, the other values) records a
new batch; nothing is recompiled on a replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .batch import GpuCommandBatch, Submission, default_device
from .device import Device
from .dtypes import SUPPORTED, host_array
from .errors import ArgumentError
from .tensor import Tensor

Structure = Any
"""What the function returned, with tensors in place (a tensor, or nested tuples / lists / dicts)."""


@dataclass
class Capture:
    """One recorded signature: its batch, the inputs fed each call (by argument position or keyword),
    what the function returned and the tensors to read from it."""

    batch: GpuCommandBatch
    inputs: dict[int | str, Tensor]
    returned: Structure
    outputs: list[Tensor]


class Jit:
    """``fn`` captured per signature on ``device`` (default: a resident tensor argument's device, else the
    default device). Call it like ``fn``; ``await jitted.call_async(...)`` reads without blocking the event
    loop. ``captures`` holds the recorded batches by signature."""

    def __init__(self, fn: Callable[..., Any], *, device: Device | None = None, fusion: bool = True) -> None:
        if not callable(fn):
            raise ArgumentError(f"jit: expected a function, got {type(fn).__name__}")
        self.fn = fn
        self.device = device
        self.fusion = fusion
        self.captures: dict[Hashable, Capture] = {}
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"jit({getattr(self.fn, '__qualname__', self.fn)!r}, {len(self.captures)} signatures)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture, submission = self.submit(*args, **kwargs)
        return _rebuild(capture.returned, {id(t): submission.read(t) for t in capture.outputs})

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        """The call, awaiting the device (other tasks run meanwhile)."""
        capture, submission = self.submit(*args, **kwargs)
        values = {id(t): await submission.read_async(t) for t in capture.outputs}
        return _rebuild(capture.returned, values)

    def submit(self, *args: Any, **kwargs: Any) -> tuple[Capture, Submission]:
        """Capture (first call of a signature) or feed, and execute; the capture and its submission."""
        arguments = {**dict(enumerate(args)), **kwargs}
        key = tuple(sorted(((str(k), _signature(k, v)) for k, v in arguments.items()), key=lambda item: item[0]))
        capture = self.captures.get(key)
        if capture is None:
            capture = self.captures[key] = self._capture(args, kwargs)
        feeds = {tensor: arguments[k] for k, tensor in capture.inputs.items()}
        return capture, capture.batch.execute(feeds)

    def release(self) -> None:
        """Release every captured batch (the next call records again)."""
        for capture in self.captures.values():
            capture.batch.release()
        self.captures.clear()

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
        name = getattr(self.fn, "__name__", "fn")
        batch = GpuCommandBatch(self._device(args, kwargs), name=f"jit:{name}", fusion=self.fusion)
        inputs: dict[int | str, Tensor] = {}

        def bind(key: int | str, value: Any) -> Any:
            if not isinstance(value, np.ndarray):
                return value
            inputs[key] = batch.upload(value, name=f"{name}.{key}")
            return inputs[key]

        returned = self.fn(*(bind(i, a) for i, a in enumerate(args)), **{k: bind(k, v) for k, v in kwargs.items()})
        outputs = _tensors(returned)
        if not outputs:
            raise ArgumentError(f"jit: {name} returned no tensor ({type(returned).__name__}); return what to read")
        for tensor in outputs:
            if tensor.batch is not batch:
                raise ArgumentError(f"jit: {name} returned {tensor.describe()}, which its batch did not compute")
        batch.outputs(*outputs)
        return Capture(batch, inputs, returned, outputs)

    def _device(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Device:
        if self.device is not None:
            return self.device
        resident = [v for v in (*args, *kwargs.values()) if isinstance(v, Tensor) and v.resident]
        return resident[0].device if resident else default_device()


def jit(fn: Callable[..., Any] | None = None, *, device: Device | None = None, fusion: bool = True) -> Any:
    """Decorator (``@bg.jit`` or ``@bg.jit(device=dev)``): see :class:`Jit`."""
    if fn is None:
        return lambda function: Jit(function, device=device, fusion=fusion)
    return Jit(fn, device=device, fusion=fusion)


def _signature(key: int | str, value: Any) -> Hashable:
    """What makes a new capture: an array's shape and dtype, a tensor's identity, another value itself."""
    if isinstance(value, np.ndarray):
        dtype = value.dtype.newbyteorder("=")
        if dtype not in SUPPORTED:
            host_array(value, what=f"jit argument {key}")  # raises the upload's DTypeError (float64, int64, ...)
        return ("array", value.shape, dtype.str)
    if isinstance(value, Tensor):
        if not value.resident:
            raise ArgumentError(
                f"jit: argument {key} {value.describe()} belongs to a batch; pass arrays or resident tensors"
            )
        return ("tensor", id(value))
    try:
        hash(value)
    except TypeError:
        raise ArgumentError(
            f"jit: argument {key} of type {type(value).__name__} is neither an array, a resident tensor nor a "
            "hashable value (lists: pass np.asarray(...))"
        ) from None
    return ("value", type(value).__name__, value)


def _tensors(returned: Structure) -> list[Tensor]:
    """The tensors of a returned structure, in order, each once."""
    if isinstance(returned, Tensor):
        return [returned]
    items = returned.values() if isinstance(returned, dict) else returned if isinstance(returned, (tuple, list)) else ()
    found: list[Tensor] = []
    for item in items:
        found += [t for t in _tensors(item) if all(t is not f for f in found)]
    return found


def _rebuild(returned: Structure, values: dict[int, np.ndarray]) -> Any:
    """``returned`` with each tensor replaced by its array."""
    if isinstance(returned, Tensor):
        return values[id(returned)]
    if isinstance(returned, dict):
        return {k: _rebuild(v, values) for k, v in returned.items()}
    if isinstance(returned, (tuple, list)):
        return type(returned)(_rebuild(v, values) for v in returned)
    return returned
