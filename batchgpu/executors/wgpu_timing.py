"""GPU timestamps for ``execute(profile=True)`` on the wgpu executor.

With ``timestamp-query`` and ``timestamp-query-inside-passes`` (lavapipe has both), a timestamp is
written before and after every dispatch inside the one compute pass; the query sets are resolved into a
buffer that is copied into the execute's readback staging buffer, so a profiled execute is still one
submit. With ``timestamp-query`` alone, the pass's own begin/end timestamps give the time of the whole
pass. Without it, only host-side timing is recorded.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..tensor import Storage
from .base import StagedExecution

if TYPE_CHECKING:
    from ..profiling import Session

log = logging.getLogger("batchgpu")


class TimedExecutor(Protocol):
    """The wgpu executor, as its timer uses it: :class:`~batchgpu.executors.wgpu.WgpuExecutor` (which imports
    this module): wgpu-py, the device, its name and features, and blocking reads of an execution."""

    wgpu: Any
    device: Any
    name: str
    features: frozenset[str]

    def collect(self, execution: StagedExecution) -> dict[Storage, np.ndarray]: ...


class TimedPlan(Protocol):
    """A wgpu plan, as its timer uses it: the dispatches, each (pipeline, bind group, x, y, z)."""

    dispatches: list[tuple]


MAX_QUERIES = 4096  # wgpu's limit on queries per query set
_U64 = np.dtype(np.uint64)


class _Queries:
    """Query sets and their resolve buffer for one plan, reused by its profiled executes."""

    def __init__(self, executor: TimedExecutor, count: int) -> None:
        wgpu = executor.wgpu
        self.count = count
        self.sets = [
            executor.device.create_query_set(type="timestamp", count=min(MAX_QUERIES, count - start))
            for start in range(0, count, MAX_QUERIES)
        ]
        nbytes = 8 * count
        self.resolve = executor.device.create_buffer(
            size=nbytes, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC, label="timestamps"
        )
        self.storage = Storage(nbytes, "scratch", _U64)


_queries: weakref.WeakKeyDictionary[TimedPlan, _Queries] = weakref.WeakKeyDictionary()


def timestamp_period(executor: TimedExecutor) -> float:
    """Nanoseconds per timestamp tick (wgpu-native normalizes to 1.0; older versions may not)."""
    try:
        from wgpu.backends.wgpu_native._ffi import lib

        return float(lib.wgpuQueueGetTimestampPeriod(executor.device.queue._internal)) or 1.0
    except Exception:
        return 1.0


class GpuTimer:
    """Hooks ``WgpuExecutor.run`` calls while encoding a profiled execute."""

    def __init__(self, executor: TimedExecutor, plan: TimedPlan, session: Session, started: float) -> None:
        self.executor = executor
        self.session = session
        self.cursor = started
        self.mode = ""
        features = executor.features
        n = len(plan.dispatches)
        session.dispatch_grids = [tuple(d[2:5]) for d in plan.dispatches]
        if n == 0:
            return
        if "timestamp-query" in features and "timestamp-query-inside-passes" in features:
            self.mode = "dispatch"
            count = 2 * n
        elif "timestamp-query" in features:
            self.mode = "pass"
            count = 2
            session.message = (
                f"{executor.name} lacks timestamp-query-inside-passes: GPU time of the whole compute pass only"
            )
        else:
            session.message = f"{executor.name} lacks the timestamp-query feature: host-side timing only"
            return
        queries = _queries.get(plan)
        if queries is None or queries.count != count:
            queries = _queries[plan] = _Queries(executor, count)
        self.queries = queries

    def uploaded(self) -> None:
        self.cursor = self.session.span("upload", self.cursor)

    def pass_descriptor(self) -> dict[str, Any]:
        if self.mode != "pass":
            return {}
        writes = {"query_set": self.queries.sets[0], "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1}
        return {"timestamp_writes": writes}

    def wrap(self, compute: Any) -> Any:
        """``compute`` itself, or with timestamps around each dispatch (``run``'s loop stays as it is)."""
        return _TimedPass(compute, self.queries.sets) if self.mode == "dispatch" else compute

    def extend_readback(self, encoder: Any, layout: Any) -> Any:
        """Resolve the queries and add them to the execute's readback layout (same staging, same submit)."""
        if not self.mode:
            return layout
        queries = self.queries
        for k, query_set in enumerate(queries.sets):
            encoder.resolve_query_set(query_set, 0, query_set.count, queries.resolve, k * MAX_QUERIES * 8)
        offset = -(-layout.total // 8) * 8
        copies = [*layout.copies, (queries.storage, queries.resolve, offset, queries.resolve.size)]
        return type(layout)(copies, offset + queries.resolve.size)

    def encoded(self) -> None:
        self.cursor = self.session.span("encode", self.cursor)

    def submitted(self, execution: StagedExecution) -> None:
        self.session.span("submit", self.cursor)
        self.session.gpu_anchor = time.perf_counter()
        if not self.mode:
            return
        executor, storage, mode = self.executor, self.queries.storage, self.mode
        period = timestamp_period(executor)
        self.session.gpu_pass_only = mode == "pass"

        def fetch() -> np.ndarray:
            ticks = executor.collect(execution)[storage]
            return ticks.reshape(-1, 2).astype(np.float64) * period

        self.session.gpu_fetch = fetch


class _TimedPass:
    """A compute pass encoder whose ``dispatch_workgroups`` writes a timestamp before and after."""

    def __init__(self, compute: Any, sets: list[Any]) -> None:
        from wgpu.backends.wgpu_native.extras import write_timestamp

        self._compute = compute
        self._sets = sets
        self._write = write_timestamp
        self._query = 0

    def dispatch_workgroups(self, x: int, y: int = 1, z: int = 1) -> None:
        query_set = self._sets[self._query // MAX_QUERIES]
        index = self._query % MAX_QUERIES
        self._write(self._compute, query_set, index)
        self._compute.dispatch_workgroups(x, y, z)
        self._write(self._compute, query_set, index + 1)
        self._query += 2

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compute, name)
