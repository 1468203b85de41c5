"""Blocking driver waits (mapping a staging buffer, synchronizing an event) run off the event loop.

One daemon worker thread per executor runs the waits in order; ``await wait_future(future)`` awaits one
from whatever event loop is running. Awaiting never hands the wait itself to a loop: a cancelled
``await`` (``asyncio.wait_for`` timing out) leaves the wait running, so a later ``await`` (on this loop or
a new one) or a blocking read picks up its result, and a loop that closed meanwhile is never called back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any


class BlockingWorker:
    """A daemon thread that runs submitted blocking calls one after another."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple, concurrent.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the worker; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            fn, args, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


async def wait_future(future: concurrent.futures.Future) -> Any:
    """The result of ``future``, awaited without blocking the running event loop. Cancelling the caller
    does not cancel ``future``."""
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_: concurrent.futures.Future) -> None:
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits there any more
                loop.call_soon_threadsafe(_settle, waiter)

        future.add_done_callback(wake)
        await waiter
    return future.result()


def _settle(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
