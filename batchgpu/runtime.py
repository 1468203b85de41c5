"""The execute-and-read side of a batch: :class:`BatchRuntime` plans what a
:class:`~batchgpu.GpuCommandBatch` recorded (a :class:`~batchgpu.runner.Runner`, anew when the recording
changed), validates feeds and scalars, executes, and reads results back; each execute's results stay
readable through its :class:`Submission`; :class:`BatchView` shows what was recorded and executed to the
WebGPU export, profiling and tools. The batch itself records ops and hands every execute and read here."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Coroutine, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from . import arguments, profiling
from .device import Device
from .dtypes import host_copy
from .errors import (
    ArgumentError,
    BatchError,
    DeviceError,
    DeviceMismatchError,
    DTypeError,
    NotExecutedError,
    ShapeError,
)
from .executors.base import Execution, Plan
from .ops import Node
from .profiling import Profile, ProfiledBatch, Session
from .recording import Recording
from .runner import Readback, Runner, Ticket, keep_readable
from .scalars import Scalar
from .scalars import resolve as resolve_scalars
from .tensor import Storage, Tensor, TensorBatch

_default_device: Device | None = None


def default_device() -> Device:
    """The process-wide default Device, created on first use."""
    global _default_device
    if _default_device is None:
        _default_device = Device()
    return _default_device


class RuntimeBatch(TensorBatch, ProfiledBatch, Protocol):
    """The batch a runtime executes: a :class:`~batchgpu.GpuCommandBatch` (a layer above this module), as its
    tensors carry it and profiling reads it."""


class BatchRuntime:
    """The execute-and-read side of one batch: its :attr:`recording` (the batch records ops into it), the
    plan of its latest execute and the storages each execute copies back. Each public method is the
    :class:`~batchgpu.GpuCommandBatch` method of the same name (documented there)."""

    def __init__(self, batch: RuntimeBatch, device: Device, *, fusion: bool) -> None:
        self.batch = batch  # the GpuCommandBatch: its tensors carry it, errors name it
        self.device = device
        self.fusion = fusion
        self._recording = Recording()
        self._readback = Readback()
        self._runner: Runner | None = None  # the plan of the latest execute (or of a failed one after it)
        self._stale = True  # the recording changed since the runner's plan: the next execute plans anew
        self._released = False
        self.uploads: list[Tensor] = []  # the batch's inputs, for feeds by name

    @property
    def name(self) -> str:
        return self.batch.name

    @property
    def recording(self) -> Recording:
        """What the batch recorded (an empty recording once released)."""
        return self._recording

    @property
    def released(self) -> bool:
        return self._released

    def view(self) -> BatchView:
        self.check_open("view")
        return BatchView(self)

    def recording_changed(self) -> None:
        """The recording grew: the next execute plans anew, and the default readback may differ."""
        self._stale = True
        self._readback.recording_changed()

    def check_member(self, op: str, argument: str, tensor: Tensor) -> None:
        if tensor.device is not self.device:
            default = " (the default device: GpuCommandBatch() without one)" if self.device is _default_device else ""
            raise DeviceMismatchError(
                f"{op}: {argument} {tensor.describe()} lives on {tensor.device!r}, but batch {self.name!r} records "
                f"on {self.device!r}{default}; create the batch on the tensor's device, GpuCommandBatch(dev), or "
                "read the tensor back and upload it to this device"
            )
        if tensor.batch is not None and tensor.batch is not self.batch:
            raise DeviceMismatchError(
                f"{op}: {argument} {tensor.describe()} belongs to batch {tensor.batch.name!r}, not {self.name!r}; "
                f"read it back and upload it, or make it resident with Device.tensor"
            )

    def check_open(self, op: str) -> None:
        if self._released:
            raise BatchError(f"{op}: batch {self.name!r} was released")
        self.device.check_thread(op)

    # execution -------------------------------------------------------------------------------

    def execute(
        self,
        feeds: Mapping[Tensor | str, Any] | Iterable[tuple[Tensor | str, Any]] | None = None,
        *,
        scalars: Mapping[str, int | float] | Iterable[tuple[str, int | float]] | None = None,
        profile: bool = False,
    ) -> Submission:
        self.check_open("execute")
        session = profiling.start(self.batch, arguments.flag("execute", "profile", profile))
        fed = self._validate_feeds(feeds)
        scalar_values = self._scalar_values(scalars)
        recording = self._recording
        runner = self._runner
        if runner is None or self._stale:  # a new plan: inputs and constants are uploaded, state carried over
            planning = time.perf_counter()
            fresh = Runner(self.device.executor, recording, self._readback, fusion=self.fusion)
            carried = fresh.carry_from(runner, recording) if runner is not None else frozenset()
            if runner is not None:
                runner.drop_execution()
            self._runner, self._stale, runner = fresh, False, fresh
            writes = {**{s: a for s, a in recording.host.items() if s not in carried}, **recording.pending, **fed}
            if session is not None:
                session.span("plan", planning)
        else:
            writes = {**recording.pending, **fed}
        if session is not None:
            session.nodes = list(runner.nodes)
        readback = self._readback.storages(recording)
        runner.run(writes, readback, scalar_values, profiling.run_kwargs(self.device.executor, session))
        recording.scalar_values = scalar_values
        recording.host.update(writes)
        recording.pending.clear()
        if session is not None:
            session.finish()
            runner.profiled = session
        return Submission(self, runner.ticket())

    def execute_async(
        self,
        feeds: Mapping[Tensor | str, Any] | Iterable[tuple[Tensor | str, Any]] | None = None,
        *,
        scalars: Mapping[str, int | float] | Iterable[tuple[str, int | float]] | None = None,
        profile: bool = False,
    ) -> Coroutine[Any, Any, Submission]:
        return _ready(self.execute(feeds, scalars=scalars, profile=profile))

    def profile(self) -> Profile:
        self.check_open("profile")
        session = self._runner.profiled if self._runner is not None else None
        if session is None:
            raise NotExecutedError(
                f"profile: batch {self.name!r} has no profiled execute; call execute(profile=True) first"
            )
        return session.result()

    def _scalar_values(self, given: Any) -> dict[str, int | float]:
        """Every scalar's value for an execute: the current ones updated by the validated ``given``."""
        recording = self._recording
        return resolve_scalars(recording.scalars, recording.scalar_values, _as_mapping(given, "execute: scalars"))

    def _validate_feeds(self, feeds: Any) -> dict[Storage, np.ndarray]:
        validated = {}
        for key, data in _as_mapping(feeds, "execute: feeds").items():
            tensor = self._input_named(key) if isinstance(key, str) else key
            if not isinstance(tensor, Tensor) or tensor.batch is not self.batch or tensor.storage.kind != "input":
                raise ArgumentError(f"execute: feed key {key!r} is not an input (from upload) of batch {self.name!r}")
            array = host_copy(data, what=f"execute feed {tensor.name}")  # later edits of data don't leak in
            if array.dtype != tensor.dtype:
                raise DTypeError(
                    f"execute: feed for {tensor.describe()} has dtype {array.dtype.name}, expected {tensor.dtype.name}"
                )
            if array.shape != tensor.shape:
                raise ShapeError(
                    f"execute: feed for {tensor.describe()} has shape {array.shape}, expected {tensor.shape}"
                )
            validated[tensor.storage] = array
        return validated

    def _input_named(self, name: str) -> Tensor:
        """The batch's input called ``name`` (a feed given by name), or ArgumentError naming the inputs."""
        matches = [t for t in self.uploads if t.name == name]
        if len(matches) != 1:
            names = ", ".join(repr(t.name) for t in self.uploads) or "none"
            problem = "names no input" if not matches else f"names {len(matches)} inputs"
            raise ArgumentError(f"execute: feed {name!r} {problem} of batch {self.name!r} (its inputs: {names})")
        return matches[0]

    def outputs(self, *tensors: Tensor) -> None:
        self.check_open("outputs")
        for tensor in tensors:
            if not isinstance(tensor, Tensor):
                raise ArgumentError(f"outputs: expected Tensors, got {type(tensor).__name__}")
            self.check_member("outputs", "tensor", tensor)
            if tensor.resident:
                raise BatchError(f"outputs: {tensor.describe()} is resident (read it with Device.read), not an output")
        self._readback.declare([t.storage for t in tensors] if tensors else None)
        self._stale = True  # buffer sharing follows the declaration

    def memory(self) -> dict[str, int]:
        if self._runner is None:
            return {"planned": 0, "unshared": 0, "buffers": 0}
        plan = self._runner.buffers
        return {"planned": plan.nbytes, "unshared": plan.unshared_bytes, "buffers": len(plan.storages)}

    # readback --------------------------------------------------------------------------------

    def read_async(self, tensor: Tensor) -> Coroutine[Any, Any, np.ndarray]:
        storage = self._check_readable(tensor)
        if storage.kind == "resident":
            return _ready(self._read_resident(tensor))
        return _read_held(tensor, self._bind_read(tensor), self.name)

    def read(self, tensor: Tensor) -> np.ndarray:
        storage = self._check_readable(tensor)
        if storage.kind == "resident":
            return self._read_resident(tensor)
        assert self._runner is not None
        with _naming_read_errors(tensor, self.name):
            flat = self._runner.read(storage)
        self._readback.want(storage)
        return _shaped(tensor, flat)

    def _read_resident(self, tensor: Tensor) -> np.ndarray:
        """A resident tensor, or a batch view of one (``reshape(w)``): its device contents now, which
        follow every execute submitted so far."""
        if tensor.resident:
            return self.device.read(tensor)
        return _shaped(tensor, self.device.executor.read_resident(tensor.storage))

    def _bind_read(self, tensor: Tensor) -> Ticket:
        """A hold on ``tensor``'s value after the latest execute, taken now (the read is requested);
        later executes copy it back in their own submit."""
        assert self._runner is not None
        with _naming_read_errors(tensor, self.name):
            ticket = self._runner.bind(tensor.storage)
        self._readback.want(tensor.storage)
        return ticket

    def _check_readable(self, tensor: Tensor) -> Storage:
        self.check_open("read")
        if not isinstance(tensor, Tensor):
            raise ArgumentError(f"read: expected a Tensor, got {type(tensor).__name__}")
        self.check_member("read", "tensor", tensor)
        runner = self._runner
        if tensor.storage.kind == "resident":
            if not self._recording.uses(tensor.storage):
                raise BatchError(f"read: {tensor.describe()} is not used by batch {self.name!r}; use Device.read")
            if runner is None or not runner.ran:
                raise NotExecutedError(f"read: batch {self.name!r} was never executed; call execute() first")
            return tensor.storage
        if runner is None or not runner.ran:
            raise NotExecutedError(
                f"read: {tensor.describe()} was not executed: batch {self.name!r} was never executed; "
                f"call execute() first"
            )
        if tensor.storage in runner.buffers.shareable and not runner.declared:  # left out by default: keep it
            runner = self._runner = keep_readable(
                runner, self._recording, self._readback, tensor, fusion=self.fusion, stale=self._stale, batch=self.name
            )
        if tensor.storage in runner.buffers.shareable:  # by the executed plan, whatever outputs() says since
            raise BatchError(
                f"read: {tensor.describe()} is an intermediate of batch {self.name!r}, not kept since "
                f"batch.outputs(...) was declared (other intermediates reuse its buffer, or its op runs fused "
                f"into the next); add it to batch.outputs (and execute) to read it"
            )
        if not self._recording.recorded_before(tensor.storage, runner.count):
            raise NotExecutedError(
                f"read: {tensor.describe()} was recorded after the last execute() of batch {self.name!r}; execute again"
            )
        if runner.execution is None:
            raise NotExecutedError(
                f"read: the last execute() of batch {self.name!r} failed, so {tensor.describe()} has no value; "
                f"execute again"
            )
        return tensor.storage

    def release(self) -> None:
        if self._runner is not None:
            self._runner.drop_execution()
        self._runner = None
        self._recording = Recording()
        self._released = True


class Submission:
    """One ``execute`` of a batch, a handle on its results: the tensors it copied back (declared outputs,
    or the tensors read so far) read as they were after this execute, whatever was submitted since, so a
    loop can submit step n + 1 before reading step n (a decode loop whose next input is written on the
    device). The submission holds its staging buffers until :meth:`release` or until it is collected;
    reads requested through it hold them on their own until they complete."""

    def __init__(self, runtime: BatchRuntime, ticket: Ticket) -> None:
        self.batch = runtime.batch
        self._runtime = runtime
        self._ticket = ticket

    def read(self, tensor: Tensor) -> np.ndarray:
        """The tensor's value after this execute (blocks until the device is done with it)."""
        storage = self._check(tensor)
        with _naming_read_errors(tensor, self.batch.name):
            flat = self._ticket.read(storage)
        return _shaped(tensor, flat)

    def read_async(self, tensor: Tensor) -> Coroutine[Any, Any, np.ndarray]:
        """:meth:`read` without blocking the event loop; requested when called (a :meth:`release` or a
        batch ``release()`` before it is awaited does not take its value away)."""
        self._check(tensor)
        return _read_held(tensor, self._ticket.share(), self.batch.name)

    def read_sync(self, tensor: Tensor) -> np.ndarray:
        """Deprecated name of :meth:`read` (kept for one release)."""
        warn_deprecated("Submission.read_sync", "read")
        return self.read(tensor)

    def release(self) -> None:
        """Let this execute's readback buffers go without reading them (reads already requested still
        complete); later reads through this submission raise BatchError."""
        self._ticket.release()

    def _check(self, tensor: Tensor) -> Storage:
        self._runtime.check_open("read")
        if not isinstance(tensor, Tensor):
            raise ArgumentError(f"read: expected a Tensor, got {type(tensor).__name__}")
        self._runtime.check_member("read", "tensor", tensor)
        if not self._ticket.holds(tensor.storage):
            raise BatchError(
                f"read: {tensor.describe()} was not copied back by this execute of batch {self.batch.name!r} "
                f"(released, resident, or not among its outputs: declare it with batch.outputs before executing)"
            )
        return tensor.storage


class BatchView:
    """What a batch recorded and last executed, read-only: the seam the WebGPU export, profiling and the
    CLI use instead of the batch's internals. Taken at one moment; take a new one after recording or
    executing."""

    def __init__(self, runtime: BatchRuntime) -> None:
        recording, runner = runtime._recording, runtime._runner
        self.name = runtime.name
        self.device = runtime.device
        self.nodes: tuple[Node, ...] = tuple(recording.nodes)
        self.storages: tuple[Storage, ...] = tuple(recording.storages)
        """The batch's own storages (inputs, constants, outputs, scratch) in recording order."""
        self.inputs: tuple[Tensor, ...] = recording.input_tensors()
        """One tensor per input storage some op uses, in upload order."""
        self.host: Mapping[Storage, np.ndarray] = MappingProxyType(dict(recording.host))
        """The latest host values of inputs and constants (what a new plan uploads)."""
        self.scalars: tuple[Scalar, ...] = tuple(recording.scalars.values())
        self.scalar_values: Mapping[str, int | float] = MappingProxyType(dict(recording.scalar_values))
        self.readback: tuple[Storage, ...] = runtime._readback.storages(recording)
        """The storages the next execute copies back."""
        self.stateful: frozenset[Storage] = recording.stateful()
        """Storages whose device contents live from one execute to the next."""
        self.record_spans: tuple[tuple[float, float], ...] = tuple(recording.record_spans)
        self.plan: Plan | None = runner.plan if runner is not None else None
        """The executor's plan of the latest execute (None before the first)."""
        self.execution: Execution | None = runner.execution if runner is not None else None
        self.profiled: Session | None = runner.profiled if runner is not None else None
        """The latest ``execute(profile=True)``."""
        self._runtime = runtime
        self._runner = runner

    def device_value(self, storage: Storage) -> np.ndarray | None:
        """The flat device contents of one of the batch's storages after the latest execute, which the next
        execute starts from (a new plan carries them over); None when that execute failed or the storage
        was recorded after it."""
        runner = self._runner
        if runner is None or runner.execution is None:
            return None
        if not self._runtime._recording.recorded_before(storage, runner.count):
            return None
        return runner.read(storage)

    def check_feeds(self, feeds: Any) -> dict[Storage, np.ndarray]:
        """``execute``'s validation of input feeds (``{tensor: array}`` or pairs): storage -> host copy."""
        return self._runtime._validate_feeds(feeds)

    def check_scalars(self, scalars: Any) -> dict[str, int | float]:
        """``execute``'s validation of scalar values: every scalar's value with ``scalars`` applied."""
        return self._runtime._scalar_values(scalars)

    def check_member(self, op: str, argument: str, tensor: Tensor) -> None:
        """Raise DeviceMismatchError unless ``tensor`` may be used by this batch (``op`` and ``argument``
        name it in the message)."""
        self._runtime.check_member(op, argument, tensor)


def _shaped(tensor: Tensor, flat: np.ndarray) -> np.ndarray:
    """A tensor's value from the flat contents of its storage (a copy the caller owns)."""
    return flat[: tensor.size].reshape(tensor.shape).copy()


async def _ready(value: Any) -> Any:
    """A coroutine giving ``value``: the ``*_async`` methods act when called and return this."""
    return value


async def _read_held(tensor: Tensor, ticket: Ticket, batch_name: str) -> np.ndarray:
    """Wait for the value ``ticket`` holds (a read requested earlier), then let the hold go, however the
    await ends (a value, an error, a cancellation; never awaited: when the coroutine is collected)."""
    try:
        with _naming_read_errors(tensor, batch_name):
            return _shaped(tensor, await ticket.read_async(tensor.storage))
    finally:
        ticket.release()


@contextlib.contextmanager
def _naming_read_errors(tensor: Tensor, batch_name: str) -> Iterator[None]:
    """Device errors of a read say which tensor of which batch was being read."""
    try:
        yield
    except DeviceError as exc:
        raise DeviceError(f"read {tensor.describe()} of batch {batch_name!r}: {exc}") from None


def _as_mapping(value: Any, what: str) -> Mapping:
    """``value`` as a mapping: a mapping itself, None (empty) or (key, value) pairs."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return value
    try:
        return dict(value)
    except (TypeError, ValueError):
        raise ArgumentError(
            f"{what} must be a mapping or (key, value) pairs, got {type(value).__name__} {value!r:.80}"
        ) from None


def warn_deprecated(old: str, new: str) -> None:
    """A DeprecationWarning for the caller of ``old`` (a method), naming ``new`` and its coroutine twin."""
    warnings.warn(
        f"{old} is deprecated: use {new}() (a numpy array) or {new}_async() (a coroutine)", DeprecationWarning, 3
    )
