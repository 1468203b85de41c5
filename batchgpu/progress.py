"""Progress bars for long work (model loading, dequantization, benchmark sweeps).

``progress(iterable, desc, total)`` shows a tqdm bar on stderr when stderr is a terminal and tqdm is
installed (``pip install batchgpu[cli]``), and iterates plainly otherwise (pipes, CI logs, tests).
``BATCHGPU_PROGRESS=0`` turns bars off, ``=1`` forces them on even when stderr is not a terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

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
