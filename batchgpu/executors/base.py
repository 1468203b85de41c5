"""The executor protocol every backend implements, the counters it keeps, and the skeleton the device
executors (wgpu, CUDA/HIP) share.

- :class:`Executor`: the protocol (compile/prepare, resident memory, plan, carry, run, read).
- :func:`plan_buffers`: the common start of every ``plan``: one buffer per storage (poison-filled
  where asked), aliases pointed at the buffer they share, resident buffers for bindings.
- :class:`ReadbackLayout`, :class:`StagedExecution`, :class:`StagingPool`: where an execute's
  read-back storages land in host-readable staging buffers, pooled by power-of-two size.
- :class:`DeviceExecutor`: the read path both device executors run (an extra copy-only execution for a
  storage the execute did not copy back; blocking and asyncio reads sharing one wait on the executor's
  :class:`~batchgpu.executors.blocking.BlockingWorker`) and the copy-out into per-storage arrays.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from ..errors import DeviceMismatchError, ExportError, UnsupportedError
from ..kernels import Launch
from ..limits import UNLIMITED, Limits
from ..ops import Node
from ..scalars import Scalar
from ..tensor import Storage
from .blocking import BlockingWorker, wait_future

if TYPE_CHECKING:
    from ..interop import ForeignArray
    from ..profiling import Session

POISON_BYTE = 0x7F
"""Fill byte of new output and scratch buffers when the device was made with ``poison=True`` (NaN for
float16, 3.4e38 for float32, 2139062143 for int32): an element a kernel fails to write shows up in
tests. Every executor that poisons, and the WebGPU export mirroring a poisoned device, use this one."""

POISONED_KINDS = ("output", "scratch")
"""Storage kinds whose new buffers are poison-filled (inputs and constants are uploaded anyway)."""

B = TypeVar("B")  # a device buffer, of whatever type an executor allocates


def padded(nbytes: int) -> int:
    """Bytes of the device buffer for ``nbytes``: whole 4-byte words, at least one."""
    return max(4, -(-nbytes // 4) * 4)


@dataclass
class Stats:
    """Monotonic counters of one device (``buffers_live`` and ``staging_idle`` are gauges)."""

    pipelines_compiled: int = 0  # pipelines created through wgpu by this process
    pipeline_cache_hits: int = 0  # ... of which an earlier process built and dispatched (driver disk cache)
    pipeline_cache_misses: int = 0  # ... of which are new: compiled from scratch by the driver
    submits: int = 0
    dispatches: int = 0
    bytes_uploaded: int = 0
    bytes_read: int = 0
    buffers_created: int = 0
    buffers_live: int = 0
    staging_idle: int = 0

    def snapshot(self) -> dict[str, int]:
        """A plain dict copy, handy for before/after comparisons."""
        return asdict(self)


@dataclass
class ReadbackLayout:
    """Where each read-back storage lands in the one staging buffer of an execute."""

    copies: list[tuple[Storage, Any, int, int]]  # storage, device buffer, staging offset, bytes
    total: int

    @classmethod
    def build(cls, storages: Sequence[Storage], buffers: dict[Storage, Any], align: int) -> ReadbackLayout:
        """Back-to-back copies of whole storages (sizes padded to 4 bytes, offsets to ``align``)."""
        copies, offset = [], 0
        for storage in storages:
            size = -(-storage.nbytes // 4) * 4
            copies.append((storage, buffers[storage], offset, size))
            offset += -(-size // align) * align
        return cls(copies, offset)

    @classmethod
    def single(cls, storage: Storage, buffer: Any) -> ReadbackLayout:
        """One storage alone (its padded bytes), for an extra copy-only execution or a resident read."""
        size = padded(storage.nbytes)
        return cls([(storage, buffer, 0, size)], size)

    @property
    def nbytes(self) -> int:
        """The bytes the copies read (without the alignment gaps between them)."""
        return sum(size for *_, size in self.copies)


class Plan:
    """What an executor built once for a recorded graph: buffers, pipelines, bind groups/arguments.

    Device executors set ``buffers`` (storage -> device buffer) and may raise ``readback_align``."""

    buffers: dict[Storage, Any]
    readback_align = 4

    def readback_layout(self, readback: Sequence[Storage]) -> ReadbackLayout:
        """The staging layout for ``readback``, built once per distinct set."""
        layouts = self.__dict__.setdefault("_readback_layouts", {})
        key = tuple(readback)
        if key not in layouts:
            layouts[key] = ReadbackLayout.build(key, self.buffers, self.readback_align)
        return layouts[key]


def alias_buffers(buffers: dict[Storage, Any], aliases: Mapping[Storage, Storage] | None) -> None:
    """Point each aliased storage at the buffer it shares (:mod:`batchgpu.memory`)."""
    for storage, shared in (aliases or {}).items():
        buffers[storage] = buffers[shared]


def plan_buffers(
    storages: Sequence[Storage],
    launches: Sequence[Launch],
    aliases: Mapping[Storage, Storage] | None,
    *,
    allocate: Callable[[Storage], B],
    resident: Callable[[Storage], B],
    poison: Callable[[B], None] | None = None,
) -> dict[Storage, B]:
    """The buffers of a new plan: ``allocate(storage)`` for each of ``storages``, then ``poison(buffer)``
    for output and scratch storages (when given: a device made with ``poison=True``); each aliased
    storage pointed at the buffer it shares; ``resident(storage)`` for every other storage a launch
    binds (weights resident on the device)."""
    buffers: dict[Storage, B] = {}
    for storage in storages:
        buffer = buffers[storage] = allocate(storage)
        if poison is not None and storage.kind in POISONED_KINDS:
            poison(buffer)
    alias_buffers(buffers, aliases)
    for launch in launches:
        for binding in launch.bindings:
            if binding.storage is not None and binding.storage not in buffers:
                buffers[binding.storage] = resident(binding.storage)
    return buffers


class Execution:
    """One submitted execute (or copy-only submit): where its readback results will come from.
    ``holders`` counts the holds on it (:class:`batchgpu.runner.Ticket`: the batch's on its latest
    execute, each :class:`~batchgpu.runtime.Submission`'s, each read's from the moment it is requested until
    it completes); when the last one goes it is abandoned."""

    holders = 0

    def abandon(self) -> None:
        """Called once nothing holds this execution (its results will never be read again); frees what is
        no longer needed."""

    def holds(self, storage: Storage) -> bool:
        """Whether this execute copied ``storage`` back (its value stays readable after later executes)."""
        return False


class StagedExecution(Execution):
    """One submit of a device executor: its readback ``layout``, the staging buffers its copies land in
    (``parts``: staging buffer, first byte of the layout it holds, bytes), the wait an asyncio read
    started on the executor's worker (``waiting``) and, once copied out, the ``results``."""

    def __init__(self, layout: ReadbackLayout, parts: list[tuple[Any, int, int]]) -> None:
        self.layout = layout
        self.parts = parts
        self.results: dict[Storage, np.ndarray] | None = None
        self.waiting: concurrent.futures.Future | None = None

    def holds(self, storage: Storage) -> bool:
        """Whether this execute copied ``storage`` back."""
        return any(s is storage for s, *_ in self.layout.copies)

    def close(self) -> None:
        """Called once the results are copied out: free what only the wait needed (an event)."""


class Executor(ABC):
    """compile, allocate, upload, encode the plan, submit, read back."""

    kind: str
    name: str
    limits: Limits
    features: frozenset[str]
    stats: Stats
    poison: bool = False
    """Whether new output and scratch buffers are filled with :data:`POISON_BYTE` (``Device(poison=True)``)."""
    concurrent: bool = False
    """The device runs submitted work while the host goes on (a GPU): work submitted ahead of the reads
    overlaps the host's encoding with the device's computing. False where the host does the computing
    (numpy, a CPU Vulkan driver such as lavapipe, whose submit blocks while earlier work runs)."""

    @abstractmethod
    def supports(self, dtype: np.dtype) -> bool:
        """Whether tensors of ``dtype`` can live on this device."""

    @abstractmethod
    def alloc_resident(self, storage: Storage, data: np.ndarray) -> None:
        """Allocate a device-owned storage and upload ``data`` into it."""

    @abstractmethod
    def write_resident(self, storage: Storage, data: np.ndarray) -> None:
        """Overwrite a resident storage."""

    @abstractmethod
    def read_resident(self, storage: Storage) -> np.ndarray:
        """Copy a resident storage to the host (flat array of its dtype)."""

    # interop (optional; see batchgpu.interop) ---------------------------------------------------

    def dlpack_device(self) -> tuple[int, int]:
        """DLPack ``(device_type, device_id)`` of this executor's memory."""
        raise ExportError(f"{self.kind}: this executor's memory has no DLPack device type")

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]:
        """``(pointer, owner)`` of a resident storage for DLPack: the memory stays valid while ``owner``
        lives, and every queued write to it has completed. ``copy``: export a fresh copy instead."""
        raise ExportError(
            f"{self.kind}: resident memory of {self.name} cannot be shared with other libraries; "
            f"copy it to the host with Device.read(tensor)"
        )

    def import_stream(self, device_type: int, device_id: int | None) -> int | None:
        """For device memory at DLPack ``(device_type, device_id)`` that :meth:`alloc_resident_from_device`
        can copy directly: the stream a DLPack producer must order its pending work before. Raises
        DeviceMismatchError saying why not (the default: no device-to-device import)."""
        raise DeviceMismatchError(f"the {self.kind} executor copies only from host memory")

    def alloc_resident_from_device(self, storage: Storage, foreign: ForeignArray) -> None:
        """Allocate a device-owned storage and copy the contiguous device array ``foreign`` into it
        (device to device, complete on return)."""
        raise UnsupportedError(f"{self.kind}: no device-to-device import")

    def form(self, launch: Launch) -> Launch:
        """The shape of ``launch`` this executor runs (see :attr:`Launch.native`, :attr:`Launch.gpu`)."""
        return launch

    def prepare(self, launch: Launch) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Compile what ``launch`` needs now, so errors surface at record time (optional)."""

    @abstractmethod
    def plan(
        self,
        nodes: Sequence[Node],
        storages: Sequence[Storage],
        scalars: Sequence[Scalar],
        *,
        aliases: Mapping[Storage, Storage] | None = None,
    ) -> Plan:
        """Build buffers, pipelines and bindings for ``nodes``; ``storages`` are the non-resident buffers
        to allocate (inputs, constants, outputs, scratch, shared buffers); ``aliases`` maps each storage
        that shares a buffer to that buffer's storage (see :func:`alias_buffers`); ``scalars`` are the
        batch's declared scalars."""

    @abstractmethod
    def carry(self, source: Plan, target: Plan, storages: Sequence[Storage]) -> None:
        """Copy the device contents of ``storages`` from ``source``'s buffers into ``target``'s, ordered
        after the work already submitted: a batch planned anew after executes keeps its state."""

    @abstractmethod
    def run(
        self,
        plan: Plan,
        writes: Sequence[tuple[Storage, np.ndarray]],
        readback: Sequence[Storage],
        scalars: Mapping[str, int | float],
        *,
        profile: Session | None = None,
    ) -> Execution:
        """Upload ``writes`` and the scalar values, encode every launch and the readback copies, and
        submit once. With a ``profile`` session, also note host spans and per-dispatch device times
        into it."""

    @abstractmethod
    def holding(self, plan: Plan, execution: Execution, storage: Storage) -> Execution:
        """An execution holding the contents ``storage`` has after the work submitted so far, for a read
        requested now: ``execution`` (the latest run of ``plan``) when it copied ``storage`` back, else
        one that copies it now (ordered after that work; a later run does not change what it holds)."""

    @abstractmethod
    def read(self, execution: Execution, storage: Storage) -> np.ndarray:
        """The flat contents of ``storage`` that ``execution`` holds, waiting for the device (blocking)."""

    @abstractmethod
    async def read_async(self, execution: Execution, storage: Storage) -> np.ndarray:
        """:meth:`read` without blocking the event loop."""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "features": sorted(self.features)}


class StagingPool(ABC, Generic[B]):
    """Host-readable staging buffers reused across executes, bucketed by power-of-two size (at least 256
    bytes; where the bucket would exceed ``limit``, the exact size rounded to 4 bytes, still pooled). At
    most ``max_idle_per_size`` idle buffers are kept per size.

    Subclasses say how a buffer is made (:meth:`create`), its size, whether an idle one may be handed out
    again (:meth:`ready`: the device may still be copying into it) and how one the pool does not keep
    goes (:meth:`discard`). ``stats`` counts created buffers and idle ones (``staging_idle``)."""

    def __init__(self, stats: Stats, limit: int = UNLIMITED, max_idle_per_size: int = 4) -> None:
        self.stats = stats
        self.limit = limit
        self._idle: dict[int, list[B]] = {}
        self._max_idle = max_idle_per_size

    def bucket(self, nbytes: int) -> int:
        """The size of the buffer that holds ``nbytes``."""
        size = max(256, 1 << (max(nbytes, 1) - 1).bit_length())
        if size > self.limit:
            size = -(-nbytes // 4) * 4
        return size

    def acquire(self, nbytes: int) -> B:
        """An idle buffer of ``nbytes``' bucket that is :meth:`ready`, else a new one."""
        size = self.bucket(nbytes)
        idle = self._idle.get(size)
        if idle:
            for i, buffer in enumerate(idle):
                if self.ready(buffer):
                    self.stats.staging_idle -= 1
                    return idle.pop(i)
        self.stats.buffers_created += 1
        return self.create(size)

    def release(self, buffer: B) -> None:
        """Give ``buffer`` back: kept idle for a later :meth:`acquire`, or discarded when its bucket is full."""
        idle = self._idle.setdefault(self.size(buffer), [])
        if len(idle) < self._max_idle:
            idle.append(buffer)
            self.stats.staging_idle += 1
        else:
            self.discard(buffer)

    @abstractmethod
    def create(self, size: int) -> B:
        """A new staging buffer of ``size`` bytes."""

    @abstractmethod
    def size(self, buffer: B) -> int:
        """The size ``buffer`` was created with."""

    def ready(self, buffer: B) -> bool:
        """Whether an idle ``buffer`` may be handed out now."""
        return True

    def discard(self, buffer: B) -> None:
        """Free a buffer the pool does not keep."""


class DeviceExecutor(Executor):
    """The skeleton of the device executors (wgpu, CUDA/HIP): resident buffers, the start of ``plan``,
    and the read path. Subclasses provide:

    - :meth:`allocate` (a device buffer for a storage) and :meth:`poison_fill` (fill one with
      :data:`POISON_BYTE`);
    - :meth:`submit_copies`: a copy-only submit of a readback layout into staging, as a
      :class:`StagedExecution`;
    - :meth:`wait_staged`: block until an execution's staging buffers hold its data (run on the caller's
      thread by blocking reads, on the ``waits`` worker by asyncio reads);
    - :meth:`staged_bytes` and :meth:`unstage`: the host bytes of a staging buffer, and giving it back.

    Hooks with defaults: :meth:`check_readable` (before a wait and a copy-out) and :meth:`wait_failed`
    (the error to raise for an exception of the wait)."""

    staging: StagingPool
    waits: BlockingWorker  # runs the waits of asyncio reads; a cancelled await leaves its wait running

    def __init__(self) -> None:
        self._resident: dict[int, Any] = {}  # storage id -> buffer

    # resident storages ----------------------------------------------------------------------------

    def keep_resident(self, storage: Storage, buffer: Any) -> None:
        """Hold ``buffer`` as the device memory of the resident ``storage`` while the storage lives."""
        self._resident[storage.id] = buffer
        weakref.finalize(storage, self._resident.pop, storage.id, None)

    def resident_buffer(self, storage: Storage) -> Any:
        return self._resident[storage.id]

    # planning -------------------------------------------------------------------------------------

    @abstractmethod
    def allocate(self, storage: Storage) -> Any:
        """A new device buffer for ``storage`` (its bytes padded to whole words)."""

    @abstractmethod
    def poison_fill(self, buffer: Any) -> None:
        """Fill ``buffer`` with :data:`POISON_BYTE`."""

    def plan_buffers(
        self, nodes: Sequence[Node], storages: Sequence[Storage], aliases: Mapping[Storage, Storage] | None
    ) -> tuple[dict[Storage, Any], list[Launch]]:
        """The common start of ``plan``: the launches in the form this executor runs, and their buffers
        (:func:`plan_buffers`, poisoned when the device was made with ``poison=True``)."""
        launches = [self.form(launch) for node in nodes for launch in node.launches]
        buffers = plan_buffers(
            storages,
            launches,
            aliases,
            allocate=self.allocate,
            resident=self.resident_buffer,
            poison=self.poison_fill if self.poison else None,
        )
        return buffers, launches

    # reading --------------------------------------------------------------------------------------

    @abstractmethod
    def submit_copies(self, layout: ReadbackLayout) -> StagedExecution:
        """Copy ``layout``'s storages into staging, ordered after the work submitted so far."""

    @abstractmethod
    def wait_staged(self, execution: StagedExecution) -> None:
        """Block until ``execution``'s staging buffers hold its data."""

    @abstractmethod
    def staged_bytes(self, staging: Any, size: int) -> Any:
        """The first ``size`` bytes of a waited-for staging buffer, readable by :func:`numpy.frombuffer`."""

    @abstractmethod
    def unstage(self, staging: Any) -> None:
        """Give a staging buffer back once its bytes are copied out."""

    def check_readable(self) -> None:
        """Raise if results can no longer be read (a lost device)."""

    def wait_failed(self, exc: Exception) -> Exception | None:
        """The error to raise when :meth:`wait_staged` raised ``exc``; None re-raises ``exc``."""
        return None

    def holding(self, plan: Plan, execution: Execution, storage: Storage) -> StagedExecution:
        """``execution``, or for a storage it did not copy back, an extra copy-only execution of it
        submitted now."""
        assert isinstance(execution, StagedExecution)
        if not execution.holds(storage):
            execution = self.submit_copies(ReadbackLayout.single(storage, plan.buffers[storage]))
        return execution

    def read(self, execution: Execution, storage: Storage) -> np.ndarray:
        assert isinstance(execution, StagedExecution)
        return self.collect(execution)[storage]

    async def read_async(self, execution: Execution, storage: Storage) -> np.ndarray:
        """Waits on the executor's worker thread, which keeps waiting if this await is cancelled (a later
        read, on any event loop, or a blocking one gets the result)."""
        assert isinstance(execution, StagedExecution)
        return (await self.collect_async(execution))[storage]

    def collect(self, execution: StagedExecution) -> dict[Storage, np.ndarray]:
        """The execution's results, waiting for the device (blocking); an asyncio read's wait in flight is
        waited for, not repeated."""
        if execution.results is None:
            self.check_readable()
            with self._waiting():
                if execution.waiting is not None:
                    execution.waiting.result()
                else:
                    self.wait_staged(execution)
        return self._results(execution)

    async def collect_async(self, execution: StagedExecution) -> dict[Storage, np.ndarray]:
        """:meth:`collect` without blocking the event loop: the wait runs on the ``waits`` worker and goes
        on if this await is cancelled (a later read, on any loop, or :meth:`collect` picks it up)."""
        if execution.results is None:
            self.check_readable()
            if execution.waiting is None:
                execution.waiting = self.waits.submit(self.wait_staged, execution)
            with self._waiting():
                await wait_future(execution.waiting)
        return self._results(execution)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Around the wait, the one step :meth:`collect` and :meth:`collect_async` do differently: a failed
        wait raises :meth:`wait_failed`'s error."""
        try:
            yield
        except Exception as exc:
            failure = self.wait_failed(exc)
            if failure is None:
                raise
            raise failure from None

    def _results(self, execution: StagedExecution) -> dict[Storage, np.ndarray]:
        """The results of a waited-for execution, copied out of its staging buffers the first time."""
        if execution.results is None:
            execution.results = self._copy_out(execution)
        return execution.results

    def _copy_out(self, execution: StagedExecution) -> dict[Storage, np.ndarray]:
        """Per-storage flat arrays from the execution's staging buffers, each then given back."""
        self.check_readable()
        results: dict[Storage, np.ndarray] = {}
        copies = execution.layout.copies
        for staging, start, size in execution.parts:
            data = self.staged_bytes(staging, size)
            for storage, _, offset, nbytes in copies:
                if start <= offset < start + size:
                    raw = np.frombuffer(data, np.uint8, count=nbytes, offset=offset - start)
                    results[storage] = raw.view(storage.dtype).copy()
            self.unstage(staging)
        self.stats.bytes_read += execution.layout.nbytes
        execution.parts = []
        execution.close()
        return results
