"""``@bg.jit``: a Python function of tensors captured into a batch on its first call for each input
signature and replayed afterwards, one submit per call (tinygrad's ``TinyJit``, ``torch.cuda.graphs``).

The function receives batch tensors where it was given numpy arrays (inputs fed anew every call) and
gets resident tensors (weights) and other Python values as they are; it records ops on them through
tensor operators and methods (``x @ w``, ``(x * 2).relu()``) or through their batch (``x.batch.where``),
and returns a tensor or a tuple / list / dict of them. A call returns the same structure with numpy
arrays. A new signature (array shapes and dtypes, which resident tensors, the other values by type and
bits) records a new batch; nothing is recompiled on a replay. The captures are bounded: past
``max_captures`` the least recently used one is released.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from .batch import GpuCommandBatch, Submission, default_device
from .device import Device
from .dtypes import SUPPORTED, host_array
from .errors import ArgumentError
from .tensor import Tensor

Structure = Any
"""What the function returned, with tensors in place (a tensor, or nested tuples / lists / dicts)."""

DEFAULT_MAX_CAPTURES = 16
"""How many signatures a jitted function keeps captured unless told otherwise (``max_captures``)."""


@dataclass
class Capture:
    """One recorded signature: its batch, the inputs fed each call (by argument position or keyword),
    what the function returned and the tensors to read from it. ``reads`` counts calls still reading
    from it; a capture retired meanwhile (evicted, released) frees its batch when the last one is done."""

    batch: GpuCommandBatch
    inputs: dict[int | str, Tensor]
    returned: Structure
    outputs: list[Tensor]
    reads: int = 0
    retired: bool = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Keep the batch while a call reads its submission."""
        self.reads += 1
        try:
            yield
        finally:
            self.reads -= 1
            if self.retired and not self.reads:
                self.batch.release()

    def retire(self) -> None:
        """Release the batch now, or after the calls still reading it."""
        self.retired = True
        if not self.reads:
            self.batch.release()


class Jit:
    """``fn`` captured per signature on ``device`` (default: a resident tensor argument's device, else the
    default device). Call it like ``fn``; ``await jitted.call_async(...)`` reads without blocking the event
    loop.

    A signature is the arrays' shapes and dtypes, the resident tensors' identities (a capture holds its
    tensors) and every other argument by type and value, floats by their bits (``-0.0`` is not ``0.0``, a
    NaN is the NaN of the same payload, ``1``, ``1.0``, ``True`` and ``np.int32(1)`` differ, inside tuples
    too). ``captures`` holds the recorded batches by signature, least recently used first; past
    ``max_captures`` (default :data:`DEFAULT_MAX_CAPTURES`) the least recently used is evicted and its
    batch released. ``recorded`` and ``evicted`` count captures made and evicted: a value that changes
    every call (pass it in an array instead) shows as a capture per call.

    The function runs only when a signature is first seen. What it reads besides its arguments (globals,
    closure variables, attributes such as ``self.scale``) and the Python values it returns are fixed at
    that moment: replays do not see later changes, nor do they repeat side effects (prints, counters).
    Pass such values as arguments (each new value is a new capture) or as arrays (fed every call)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        device: Device | None = None,
        fusion: bool = True,
        max_captures: int = DEFAULT_MAX_CAPTURES,
    ) -> None:
        if not callable(fn):
            raise ArgumentError(f"jit: expected a function, got {type(fn).__name__}")
        if isinstance(max_captures, bool) or not isinstance(max_captures, int) or max_captures < 1:
            raise ArgumentError(f"jit: max_captures must be an int >= 1, got {max_captures!r:.40}")
        self.fn = fn
        self.device = device
        self.fusion = fusion
        self.max_captures = max_captures
        self.captures: OrderedDict[Hashable, Capture] = OrderedDict()
        self.recorded = 0
        self.evicted = 0
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"jit({getattr(self.fn, '__qualname__', self.fn)!r}, {len(self.captures)} signatures)"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        capture, submission = self.submit(*args, **kwargs)
        with capture.reading():
            return _rebuild(capture.returned, {id(t): submission.read(t) for t in capture.outputs})

    async def call_async(self, *args: Any, **kwargs: Any) -> Any:
        """The call, awaiting the device (other tasks run meanwhile)."""
        capture, submission = self.submit(*args, **kwargs)
        with capture.reading():
            values = {id(t): await submission.read_async(t) for t in capture.outputs}
        return _rebuild(capture.returned, values)

    def submit(self, *args: Any, **kwargs: Any) -> tuple[Capture, Submission]:
        """Capture (first call of a signature) or feed, and execute; the capture and its submission. Read
        the submission inside ``with capture.reading():`` if other calls may come first: one of them can
        evict the capture and release its batch."""
        arguments = {**dict(enumerate(args)), **kwargs}
        key = tuple(sorted(((str(k), _signature(k, v)) for k, v in arguments.items()), key=lambda item: item[0]))
        capture = self.captures.get(key)
        if capture is None:
            capture = self._capture(args, kwargs)
            self.recorded += 1
            self._admit(key, capture)
        else:
            self.captures.move_to_end(key)
        feeds = {tensor: arguments[k] for k, tensor in capture.inputs.items()}
        return capture, capture.batch.execute(feeds)

    def release(self) -> None:
        """Release every captured batch (the next call records again; calls still reading finish first)."""
        for capture in self.captures.values():
            capture.retire()
        self.captures.clear()

    def _admit(self, key: Hashable, capture: Capture) -> None:
        """Keep ``capture`` as the most recently used, evicting the least recently used past the bound."""
        self.captures[key] = capture
        while len(self.captures) > self.max_captures:
            _, evicted = self.captures.popitem(last=False)
            evicted.retire()
            self.evicted += 1

    def _capture(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
        name = getattr(self.fn, "__name__", "fn")
        batch = GpuCommandBatch(self._device(args, kwargs), name=f"jit:{name}", fusion=self.fusion)
        try:
            return self._record(batch, name, args, kwargs)
        except BaseException:
            batch.release()  # a function that raised leaves no device buffers behind
            raise

    def _record(self, batch: GpuCommandBatch, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Capture:
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
        return cast(Device, resident[0].device) if resident else default_device()  # a Device: it made the tensor


def jit(
    fn: Callable[..., Any] | None = None,
    *,
    device: Device | None = None,
    fusion: bool = True,
    max_captures: int = DEFAULT_MAX_CAPTURES,
) -> Any:
    """Decorator (``@bg.jit`` or ``@bg.jit(device=dev, max_captures=4)``): see :class:`Jit`."""
    if fn is None:
        return lambda function: Jit(function, device=device, fusion=fusion, max_captures=max_captures)
    return Jit(fn, device=device, fusion=fusion, max_captures=max_captures)


def _signature(key: int | str, value: Any) -> Hashable:
    """What makes a new capture: an array's shape and dtype, a tensor's identity (the key holds the tensor,
    so no other object takes its id while the capture lives), another value by :func:`_static_key`."""
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
        return ("tensor", value)
    try:
        hash(value)
    except TypeError:
        raise ArgumentError(
            f"jit: argument {key} of type {type(value).__name__} is neither an array, a resident tensor nor a "
            "hashable value (lists: pass np.asarray(...))"
        ) from None
    return ("value", _static_key(value))


def _static_key(value: Hashable) -> Hashable:
    """A static argument as a cache key: its type with its value; floats and complex numbers (Python and
    numpy) by their bits, so -0.0 differs from 0.0 and a NaN matches a NaN of the same payload; tuples and
    frozensets element by element, so ``(1,)``, ``(1.0,)`` and ``(True,)`` differ though they are equal."""
    kind = type(value)
    if isinstance(value, np.generic):
        return (kind, value.dtype.str, value.tobytes())
    if isinstance(value, float):
        return (kind, struct.pack("<d", value))
    if isinstance(value, complex):
        return (kind, struct.pack("<dd", value.real, value.imag))
    if isinstance(value, tuple):
        return (kind, tuple(_static_key(item) for item in value))
    if isinstance(value, frozenset):
        return (kind, frozenset(_static_key(item) for item in value))
    return (kind, value)


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
