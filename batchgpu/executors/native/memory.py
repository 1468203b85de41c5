"""Memory and events of a native device: device buffers freed when unreferenced, pinned host buffers
pooled for staging (:class:`~batchgpu.executors.base.StagingPool`), and :class:`Event`, an owning
driver event."""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Callable

import numpy as np

from ...errors import DeviceError
from ..base import StagingPool, Stats, padded
from .driver import EVENT_DISABLE_TIMING, Driver


class Event:
    """One driver event, destroyed by :meth:`close` or when dropped. ``timing``: created without
    ``EVENT_DISABLE_TIMING``, for ``event_elapsed_time``. Destroying an event the device has not
    reached yet is allowed: the driver frees it once the device completes it."""

    __slots__ = ("driver", "handle")

    def __init__(self, driver: Driver, timing: bool = False) -> None:
        event = ctypes.c_void_p()
        flags, what = (0, "timing event create") if timing else (EVENT_DISABLE_TIMING, "event create")
        driver.check(driver.event_create(ctypes.byref(event), flags), what)
        self.driver = driver
        self.handle = int(event.value or 0)

    def record(self, stream: int, what: str = "event record") -> None:
        self.driver.check(self.driver.event_record(self.handle, stream), what)

    def synchronize(self, what: str) -> None:
        """Block until the device has completed the work recorded before this event."""
        self.driver.check(self.driver.event_synchronize(self.handle), what)

    def done(self) -> bool:
        """Whether the device has completed the event (a query, never blocking)."""
        return self.driver.event_query(self.handle) == 0

    def close(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            self.driver.event_destroy(handle)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # a half-made event, or the interpreter shutting down
            self.close()


class DeviceBuffer:
    """Device memory freed when the last reference goes."""

    __slots__ = ("pointer", "nbytes", "__weakref__")

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes


class HostBuffer:
    """Pinned host memory with a numpy byte view. ``event``: when set, the device may still be copying
    into the buffer until that event completes."""

    __slots__ = ("pointer", "nbytes", "array", "event", "__weakref__")

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.array = np.frombuffer((ctypes.c_char * nbytes).from_address(pointer), np.uint8)
        self.event: Event | None = None


class PinnedPool(StagingPool[HostBuffer]):
    """Pinned host staging buffers; an idle one is handed out again once its event is done."""

    def __init__(self, driver: Driver, stats: Stats) -> None:
        super().__init__(stats)
        self.driver = driver

    def create(self, size: int) -> HostBuffer:
        buffer = HostBuffer(self.driver.alloc_host(size), size)
        weakref.finalize(buffer, self.driver.host_free, buffer.pointer)
        return buffer

    def size(self, buffer: HostBuffer) -> int:
        return buffer.nbytes

    def ready(self, buffer: HostBuffer) -> bool:
        if buffer.event is not None:
            if not buffer.event.done():
                return False
            buffer.event.close()
            buffer.event = None
        return True


class Allocator:
    """Device buffers and pooled pinned staging buffers (:attr:`pinned`) of one device. ``make_current``
    binds the device to the calling thread: buffers may be freed from any thread (a DLPack consumer's,
    say)."""

    def __init__(self, driver: Driver, stats: Stats, make_current: Callable[[], None]) -> None:
        self.driver = driver
        self.stats = stats
        self.make_current = make_current
        self.pinned = PinnedPool(driver, stats)

    def alloc(self, nbytes: int) -> DeviceBuffer:
        size = padded(nbytes)
        pointer = ctypes.c_void_p()
        self.driver.check(self.driver.mem_alloc(ctypes.byref(pointer), size), f"device alloc of {size} bytes")
        buffer = DeviceBuffer(int(pointer.value or 0), size)
        self.stats.buffers_created += 1
        self.stats.buffers_live += 1
        weakref.finalize(buffer, self._free_device, self.driver, buffer.pointer, self.stats, self.make_current)
        return buffer

    @staticmethod
    def _free_device(driver: Driver, pointer: int, stats: Stats, make_current: Callable[[], None]) -> None:
        with contextlib.suppress(DeviceError):  # a lost device: the memory went with it
            make_current()
        driver.mem_free(pointer)
        stats.buffers_live -= 1

    def host(self, nbytes: int) -> HostBuffer:
        """A pinned buffer of at least ``nbytes`` (power-of-two buckets), reused once its event is done."""
        return self.pinned.acquire(nbytes)

    def release(self, buffer: HostBuffer) -> None:
        self.pinned.release(buffer)
