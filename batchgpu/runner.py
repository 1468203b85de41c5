"""Running a recording: one plan on an executor with its latest execution (a :class:`Runner`), and the
set of storages every execute copies back (:class:`Readback`). A recording that changes gets a new
runner, which carries the old one's device state over; nothing is reset by hand."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .executors import Executor
from .executors.base import Execution, Plan
from .memory import BufferPlan, share_buffers
from .recording import Recording
from .tensor import Storage

if TYPE_CHECKING:
    from .profiling import Session


class Readback:
    """Which storages each execute copies back: the ones read so far, else the declared outputs
    (``batch.outputs``), else the recording's sinks (outputs written and never consumed)."""

    def __init__(self) -> None:
        self.declared: frozenset[Storage] | None = None
        self.wanted: set[Storage] = set()
        self._storages: tuple[Storage, ...] | None = None

    def storages(self, recording: Recording) -> tuple[Storage, ...]:
        if self._storages is None:
            default = self.declared if self.declared is not None else recording.sinks()
            self._storages = tuple(sorted(self.wanted or default, key=lambda s: s.id))
        return self._storages

    def want(self, storage: Storage) -> None:
        """``storage`` was read: later executes copy it back in their own submit."""
        if storage not in self.wanted:
            self.wanted.add(storage)
            self._storages = None

    def declare(self, storages: Collection[Storage] | None) -> None:
        """Only ``storages`` are read back from now on (None: anything may be read again)."""
        self.declared = frozenset(storages) if storages is not None else None
        self.wanted.clear()
        self._storages = None

    def recording_changed(self) -> None:
        self._storages = None


class Runner:
    """One plan of a recording on an executor (buffers, shared per ``declared`` outputs) and the latest
    execution of it. ``count`` is the recording's count the plan covers."""

    def __init__(self, executor: Executor, recording: Recording, declared: Collection[Storage] | None) -> None:
        self.executor = executor
        self.count = recording.count
        keep = recording.storages if declared is None else declared
        self.buffers: BufferPlan = share_buffers(recording.nodes, recording.storages, keep)
        self.plan: Plan = executor.plan(
            recording.nodes, self.buffers.storages, tuple(recording.scalars.values()), aliases=self.buffers.aliases
        )
        self.execution: Execution | None = None
        self.ran = False  # an execute of this runner, or of one it replaced, succeeded
        self.profiled: Session | None = None  # the latest execute(profile=True), kept across runners

    def carry_from(self, previous: Runner, recording: Recording) -> frozenset[Storage]:
        """Copy the device contents of every storage whose data lives from one execute to the next (a KV
        cache in ``batch.empty``, an input a kernel updates in place) from ``previous``'s buffers into
        this plan's; returns them: their host copies must not overwrite them."""
        self.profiled = previous.profiled
        self.ran = previous.ran
        carried = frozenset(s for s in recording.stateful() if recording.recorded_before(s, previous.count))
        if carried:
            self.executor.carry(previous.plan, self.plan, sorted(carried, key=lambda s: s.id))
        return carried

    def run(
        self,
        writes: Mapping[Storage, np.ndarray],
        readback: Sequence[Storage],
        scalar_values: Mapping[str, int | float],
        extra: Mapping[str, Any],
    ) -> None:
        """Upload ``writes``, run the plan, copy ``readback`` back; the previous execution is dropped."""
        self.drop_execution()
        self.execution = self.executor.run(self.plan, list(writes.items()), readback, scalar_values, **extra)
        self.ran = True

    def drop_execution(self) -> None:
        if self.execution is not None:
            if self.profiled is not None:
                self.profiled.settle()  # read its timestamps before its readback buffer is recycled
            self.execution.abandon()
            self.execution = None

    async def read(self, storage: Storage) -> np.ndarray:
        assert self.execution is not None
        return await self.executor.read(self.plan, self.execution, storage)

    def read_sync(self, storage: Storage) -> np.ndarray:
        assert self.execution is not None
        return self.executor.read_sync(self.plan, self.execution, storage)
