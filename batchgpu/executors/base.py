"""The executor protocol every backend implements, and the counters it keeps."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DeviceMismatchError, ExportError, UnsupportedError
from ..kernels import Launch
from ..limits import Limits
from ..ops import Node
from ..scalars import Scalar
from ..tensor import Storage

if TYPE_CHECKING:
    from ..interop import ForeignArray
    from ..profiling import Session


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


class Execution:
    """One submitted execute: where its readback results will come from."""

    def abandon(self) -> None:
        """Called when a newer execute supersedes this one; frees what is no longer needed."""


class Executor(ABC):
    """compile, allocate, upload, encode the plan, submit, read back."""

    kind: str
    name: str
    limits: Limits
    features: frozenset[str]
    stats: Stats

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
    async def read(self, plan: Plan, execution: Execution, storage: Storage) -> np.ndarray:
        """The flat contents of ``storage`` after ``execution``, without blocking the event loop."""

    @abstractmethod
    def read_sync(self, plan: Plan, execution: Execution, storage: Storage) -> np.ndarray:
        """Blocking version of :meth:`read`."""

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "features": sorted(self.features)}
