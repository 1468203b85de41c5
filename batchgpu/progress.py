"""Progress bars for long work (model loading, dequantization, benchmark sweeps).

``progress(iterable, desc, total)`` shows a tqdm bar on stderr when stderr is a terminal and tqdm is
installed (``pip install batchgpu[cli]``), and iterates plainly otherwise (pipes, CI logs, tests).
:class:`Stages` is one such display over work in phases (a model load: reading the file, then a bar over
its tensors) whose last line stays, with each phase's seconds.
``BATCHGPU_PROGRESS=0`` turns bars off, ``=1`` forces them on even when stderr is not a terminal.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PROGRESS = "BATCHGPU_PROGRESS"


def enabled() -> bool:
    """Whether a bar would be shown now."""
    setting = os.environ.get(ENV_PROGRESS, "").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return False
    if setting not in ("1", "on", "true", "yes"):
        isatty = getattr(sys.stderr, "isatty", None)
        if not (isatty and isatty()):
            return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def progress(iterable: Iterable[T], desc: str = "", total: int | None = None, *, unit: str = "it") -> Iterator[T]:
    """``iterable`` with a progress bar when :func:`enabled`, else ``iterable`` itself, untouched."""
    if not enabled():
        yield from iterable
        return
    from tqdm import tqdm

    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield from bar


PHASE_FORMAT = "{desc}: {elapsed_s:.1f} s"
"""A phase with no count: its name and its clock."""

TICK_S = 0.5
"""How often a phase with no count is redrawn (its clock moves while the work holds the main thread)."""


class Ticker:
    """Redraws a tqdm bar every :data:`TICK_S` seconds from a daemon thread until :meth:`stop`."""

    def __init__(self, bar: Any) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(bar,), name="batchgpu-progress", daemon=True)
        self._thread.start()

    def _run(self, bar: Any) -> None:
        while not self._stop.wait(TICK_S):
            bar.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Stages:
    """One stderr line over work in phases, when :func:`enabled` (or ``show``): :meth:`phase` names a phase
    with no count (its clock ticks), :meth:`track` turns the line into a bar over an iterable, and
    :meth:`close` (or leaving a ``with`` block) leaves the line on screen with the total and each phase's
    seconds. Not shown: the phases are still timed (:attr:`seconds`) and :meth:`track` iterates plainly.

        with Stages(unit="tensors") as stages:
            stages.phase("reading model.gguf")
            weights = parse(...)
            for name in stages.track(names, "loading weights"):
                ...
    """

    def __init__(self, *, unit: str = "it", show: bool | None = None) -> None:
        self.unit = unit
        self.show = enabled() if show is None else show
        self.seconds: dict[str, float] = {}
        """Each finished phase's seconds, in order (a name used twice adds up)."""
        self._started = time.perf_counter()
        self._current: tuple[str, float] | None = None
        self._bar: Any = None
        self._ticker: Ticker | None = None

    def __enter__(self) -> Stages:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def phase(self, desc: str, name: str | None = None) -> None:
        """Start a phase with no count (reading a file): the line shows ``desc`` and its seconds so far;
        ``name`` (default ``desc``) is its name in :attr:`seconds` and the last line."""
        self._begin(name or desc)
        if not self.show:
            return
        if self._bar is None:
            self._bar = _bar(desc, self.unit, PHASE_FORMAT)
        else:
            self._bar.bar_format, self._bar.desc, self._bar.total = PHASE_FORMAT, desc, None
            self._bar.reset()
        self._ticker = Ticker(self._bar)

    def track(self, iterable: Iterable[T], desc: str, total: int | None = None, name: str | None = None) -> Iterator[T]:
        """``iterable`` as the next phase: a bar over its items on the same line (``total`` or its length)."""
        self._begin(name or desc)
        if not self.show:
            yield from iterable
            return
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        if self._bar is None:
            self._bar = _bar(desc, self.unit, None, total)
        else:
            self._bar.bar_format, self._bar.desc = None, desc
            self._bar.reset(total)
        for item in iterable:
            yield item
            self._bar.update()

    def close(self) -> None:
        """End the last phase; the line stays, its statistics replaced by the seconds in all and per phase."""
        self._end()
        bar, self._bar = self._bar, None
        if bar is None:
            return
        summary = f"{self.elapsed():.1f} s: " + ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        summary = summary.replace("{", "{{").replace("}", "}}")  # a literal inside tqdm's format string
        head = "{desc}" if bar.total is None else "{l_bar}{bar}| {n_fmt}/{total_fmt}"
        bar.bar_format = f"{head} [{summary}]"
        bar.dynamic_ncols, bar.ncols, bar.nrows = False, None, None  # whole, whatever the terminal's size
        bar.close()

    def elapsed(self) -> float:
        """Seconds since the display was made."""
        return time.perf_counter() - self._started

    def _begin(self, name: str) -> None:
        self._end()
        self._current = (name, time.perf_counter())

    def _end(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if self._current is not None:
            name, since = self._current
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - since
            self._current = None


def _bar(desc: str, unit: str, bar_format: str | None, total: int | None = None) -> Any:
    """A tqdm bar on stderr that stays when closed."""
    from tqdm import tqdm

    return tqdm(
        desc=desc, total=total, unit=unit, bar_format=bar_format, file=sys.stderr, leave=True, dynamic_ncols=True
    )
