"""Running a recording: one plan on an executor with its latest execution (a :class:`Runner`), and the
set of storages every execute copies back (:class:`Readback`). A recording that changes gets a new
runner, which carries the old one's device state over; nothing is reset by hand."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BatchError, NotExecutedError
from .executors import Executor
from .executors.base import Execution, Plan
from .fusion import Fused, fuse
from .memory import BufferPlan, share_buffers
from .ops import Node
from .recording import Recording
from .tensor import Storage, Tensor

if TYPE_CHECKING:
    from .profiling import Session

log = logging.getLogger("batchgpu")


class Readback:
    """Which storages each execute copies back: the declared outputs (``batch.outputs``: every execute's
    :class:`~batchgpu.runtime.Submission` can read any of them), else the ones read so far, else the
    recording's sinks (outputs written and never consumed); and which ones a plan keeps readable
    (:meth:`kept`)."""

    def __init__(self) -> None:
        self.declared: frozenset[Storage] | None = None
        self.wanted: set[Storage] = set()
        self._storages: tuple[Storage, ...] | None = None

    def storages(self, recording: Recording) -> tuple[Storage, ...]:
        if self._storages is None:
            chosen = self.declared if self.declared is not None else self.wanted or recording.sinks()
            self._storages = tuple(sorted(chosen, key=lambda s: s.id))
        return self._storages

    def kept(self, recording: Recording, fusion: bool) -> frozenset[Storage]:
        """The storages a plan of ``recording`` keeps readable (the others may run fused into the op that
        reads them, or share a buffer): the declared outputs; else, where the plan fuses and an execute
        can run again to compute one of the others (:meth:`Recording.replayable`, :func:`keep_readable`),
        the sinks and the storages read so far; else every storage."""
        if self.declared is not None:
            return self.declared
        if fusion and recording.replayable():
            return frozenset(recording.sinks() | self.wanted)
        return frozenset(recording.storages)

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
    """One plan of a recording on an executor (elementwise chains fused and buffers shared, keeping what
    ``readback`` keeps: :meth:`Readback.kept`) and the latest execution of it. ``count`` is the recording's
    count the plan covers; ``nodes`` are the ops the plan runs (fused chains as one node each);
    ``declared``: whether the plan kept the declared outputs only."""

    def __init__(self, executor: Executor, recording: Recording, readback: Readback, *, fusion: bool = True) -> None:
        self.executor = executor
        self.count = recording.count
        self.declared = readback.declared is not None
        keep = readback.kept(recording, fusion)
        limits = executor.limits
        fused = fuse(recording.nodes, keep, limits, executor.name, recording.host) if fusion else Fused(recording.nodes)
        self.nodes: list[Node] = fused.nodes
        storages = [s for s in recording.storages if s not in fused.eliminated]
        self.buffers: BufferPlan = share_buffers(fused.nodes, storages, keep)
        self.buffers.shareable |= fused.eliminated
        self.plan: Plan = executor.plan(
            fused.nodes, self.buffers.storages, tuple(recording.scalars.values()), aliases=self.buffers.aliases
        )
        self.execution: Execution | None = None  # the latest execution of the plan, held until the next
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
        """Upload ``writes``, run the plan, copy ``readback`` back; the hold on the previous execution goes
        (Submissions and reads requested before keep their own)."""
        self.drop_execution()
        execution = self.executor.run(self.plan, list(writes.items()), readback, scalar_values, **extra)
        _hold(execution)
        self.execution = execution
        self.ran = True

    def drop_execution(self) -> None:
        """Let the latest execution go (abandoned unless a Submission or a read holds it)."""
        if self.execution is not None:
            if self.profiled is not None:
                self.profiled.settle()  # read its timestamps before its readback buffer is recycled
            execution, self.execution = self.execution, None
            _let_go(execution)

    def ticket(self) -> Ticket:
        """A hold on the latest execution: what it copied back stays readable after newer ones."""
        assert self.execution is not None
        return Ticket(self.executor, self.execution)

    def bind(self, storage: Storage) -> Ticket:
        """A hold on the contents ``storage`` has after the latest execution, taken now (a read requested):
        the latest execution when it copied ``storage`` back, else a copy submitted now. Later executes do
        not change what it reads."""
        return Ticket(self.executor, self._holding(storage))

    def read(self, storage: Storage) -> np.ndarray:
        """``storage`` after the latest execution, blocking (nothing else runs meanwhile: no hold needed)."""
        return self.executor.read(self._holding(storage), storage)

    def _holding(self, storage: Storage) -> Execution:
        assert self.execution is not None
        return self.executor.holding(self.plan, self.execution, storage)


def keep_readable(
    runner: Runner, recording: Recording, readback: Readback, tensor: Tensor, *, fusion: bool, stale: bool, batch: str
) -> Runner:
    """The runner to read ``tensor`` from, which ``runner``'s plan left out by default (fused away or in a
    shared buffer; no outputs declared): a new plan keeping it too, and the latest execute run again
    (its inputs and scalars) on it; a debug log says so. BatchError where that execute cannot run again
    (the batch changed since): the next execute keeps it."""
    if runner.execution is None:
        raise NotExecutedError(
            f"read: the last execute() of batch {batch!r} failed, so {tensor.describe()} has no value; execute again"
        )
    if readback.declared is not None:
        raise BatchError(
            f"read: {tensor.describe()} is an intermediate of batch {batch!r}, which declares its outputs now "
            f"(batch.outputs); add it to them (and execute) to read it"
        )
    readback.want(tensor.storage)
    if stale:
        raise BatchError(
            f"read: {tensor.describe()} was fused away (or shares its buffer) in the latest execute of batch "
            f"{batch!r}, which has recorded more since, so that execute cannot run again to compute it; "
            f"execute again to read it (the next execute keeps it), or declare it with batch.outputs"
        )
    log.debug(
        "batch %r: %s was fused away (or shares its buffer) in the latest execute, which kept the tensors no op "
        "consumes and those read before; planning again to keep it and running that execute again to read it "
        "(batch.outputs declares what to keep)",
        batch,
        tensor.describe(),
    )
    fresh = Runner(runner.executor, recording, readback, fusion=fusion)
    fresh.carry_from(runner, recording)
    runner.drop_execution()
    fresh.run(recording.host, readback.storages(recording), recording.scalar_values, {})
    return fresh


class Ticket:
    """A hold on one execution: the storages it copied back stay readable (its staging buffers are not
    recycled) until every hold on it is let go, whatever ran since; the last hold to go abandons it.

    The batch holds its latest execution itself (:class:`Runner`). A ticket's hold goes by :meth:`release`
    or when the ticket is garbage-collected: a ``weakref.finalize`` callback, which keeps the execution
    reachable from outside the ticket, so that even a ticket collected with a reference cycle lets go of an
    execution whose buffers are intact (a ``__del__`` would run after theirs and pool dead buffers)."""

    def __init__(self, executor: Executor, execution: Execution) -> None:
        self.executor = executor
        self.execution: Execution | None = execution
        _hold(execution)
        self._finalizer = weakref.finalize(self, _let_go, execution)
        self._finalizer.atexit = False  # at interpreter exit the device goes too: nothing to give back

    def holds(self, storage: Storage) -> bool:
        return self.execution is not None and self.execution.holds(storage)

    def share(self) -> Ticket:
        """Another hold on the same execution, released on its own."""
        assert self.execution is not None
        return Ticket(self.executor, self.execution)

    def read(self, storage: Storage) -> np.ndarray:
        """What the execution copied back of ``storage``, waiting for the device (blocking)."""
        assert self.execution is not None and self.execution.holds(storage)
        return self.executor.read(self.execution, storage)

    async def read_async(self, storage: Storage) -> np.ndarray:
        """:meth:`read` without blocking the event loop."""
        assert self.execution is not None and self.execution.holds(storage)
        return await self.executor.read_async(self.execution, storage)

    def release(self) -> None:
        """Let the execution go (abandoned when this was the last hold on it); idempotent."""
        self.execution = None
        self._finalizer()


def _hold(execution: Execution) -> None:
    """Keep ``execution``'s read-back results until the matching :func:`_let_go`."""
    execution.holders += 1


def _let_go(execution: Execution) -> None:
    """End one hold on ``execution``; the last one abandons it (its staging buffers are recycled)."""
    execution.holders -= 1
    if not execution.holders:
        execution.abandon()
