"""GPU times for ``execute(profile=True)`` on the native (CUDA/HIP) executor, from timing events.

A profiled execute launches eagerly (not the captured graph) and records a timing event (created
without the disable-timing flag) on the stream before the first launch and after every launch; row
``i`` spans event ``i`` to event ``i + 1``, read with ``cuEventElapsedTime`` / ``hipEventElapsedTime``
relative to the first event once the last one has completed.

Precision: the driver reports milliseconds as a float with a resolution of about 0.5 µs. A row is the
stream time between two consecutive events, so when the host enqueues launches slower than the GPU
runs them (tiny kernels), a row also holds the idle gap before its launch: it is an upper bound of the
kernel's own time. The events of a plan are created once and reused by its later profiled executes
(the batch reads a profile before the next execute re-records them); they are destroyed with the plan.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .base import Execution

if TYPE_CHECKING:
    from ..profiling import Session
    from .native.driver import Driver
    from .native.memory import Event


class TimedExecutor(Protocol):
    """The native executor, as its timer uses it: :class:`~batchgpu.executors.native.NativeExecutor` (which
    imports this module): the driver and stream, a launch, and binding the device to the calling thread."""

    driver: Driver
    stream: int

    def launch(self, packed: Any) -> None: ...

    def make_current(self) -> None: ...


class TimedPlan(Protocol):
    """A native plan, as its timer uses it: the packed launches (each with its ``grid``)."""

    launches: list[Any]


class _Events:
    """``count`` timing events of one plan (each destroyed when dropped, with the plan)."""

    def __init__(self, driver: Driver, count: int) -> None:
        from .native.memory import Event

        self.handles: list[Event] = [Event(driver, timing=True) for _ in range(count)]


_events: weakref.WeakKeyDictionary[TimedPlan, _Events] = weakref.WeakKeyDictionary()


class EventTimer:
    """Hooks ``NativeExecutor.run`` calls while enqueuing a profiled execute (shaped like wgpu's GpuTimer)."""

    def __init__(self, executor: TimedExecutor, plan: TimedPlan, session: Session, started: float) -> None:
        self.executor = executor
        self.session = session
        self.cursor = started
        n = len(plan.launches)
        session.dispatch_grids = [tuple(packed.grid) for packed in plan.launches]  # type: ignore[misc]
        self.events: _Events | None = None
        if n == 0:
            return
        events = _events.get(plan)
        if events is None or len(events.handles) != n + 1:
            events = _events[plan] = _Events(executor.driver, n + 1)
        self.events = events  # kept alive while the session may still read them

    def uploaded(self) -> None:
        self.cursor = self.session.span("upload", self.cursor)

    def launch_all(self, plan: TimedPlan) -> None:
        """Every launch eagerly, an event before the first and after each."""
        assert self.events is not None
        stream, handles = self.executor.stream, self.events.handles
        self.session.gpu_anchor = time.perf_counter()  # the GPU track starts about when the first event is queued
        handles[0].record(stream, "timing event record")
        for packed, event in zip(plan.launches, handles[1:]):
            self.executor.launch(packed)
            event.record(stream, "timing event record")
        self.cursor = self.session.span("launch", self.cursor)

    def submitted(self, execution: Execution) -> None:
        """After the readback copies are enqueued: note the span and hand the session its GPU times."""
        self.session.span("submit", self.cursor)
        events = self.events
        if events is not None:
            self.session.gpu_fetch = lambda: elapsed_ns(self.executor, events.handles)


def elapsed_ns(executor: TimedExecutor, handles: list[Event]) -> np.ndarray:
    """(len(handles) - 1, 2) start/end nanoseconds of each launch after the first event; waits for the last."""
    drv = executor.driver
    executor.make_current()
    handles[-1].synchronize("waiting for the timing events")
    ms = ctypes.c_float()
    times = np.zeros(len(handles), np.float64)
    for i, event in enumerate(handles[1:], start=1):
        drv.check(drv.event_elapsed_time(ctypes.byref(ms), handles[0].handle, event.handle), "event elapsed time")
        times[i] = ms.value * 1e6
    return np.stack([times[:-1], times[1:]], axis=1)
