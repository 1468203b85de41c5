"""Checks of plain arguments of the public calls (flags, numbers, names), raising ``ArgumentError`` that
names the call and the argument instead of whatever Python error a bad value would cause later; and
:func:`brief`, a value shown short in any error message; :func:`within` and :func:`linked_within`, whether
writing into a folder would reach a given file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ArgumentError
from .promotion import scalar_value


def flag(what: str, name: str, value: Any) -> bool:
    """A bool (``True``/``False`` or a numpy bool)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(f"{what}: {name} must be True or False, got {type(value).__name__} {value!r:.40}")
    return bool(value)


def real(what: str, name: str, value: Any) -> float:
    """A real number (int, float, a numpy integer or floating scalar or 0-d array, not a bool: the numbers
    ops take, :func:`batchgpu.promotion.scalar_value`) as a float."""
    number = scalar_value(value)
    if number is None:
        raise ArgumentError(f"{what}: {name} must be a number, got {type(value).__name__} {value!r:.40}")
    try:
        return float(number)
    except OverflowError:
        raise ArgumentError(f"{what}: {name} = {number!r:.40}... is too large for a float") from None


def positive_reals(what: str, name: str, value: Any) -> tuple[float, ...] | None:
    """None, or a sequence (or 1-D array) of finite numbers > 0 as a tuple of floats."""
    if value is None:
        return None
    values = tuple(real(what, name, v) for v in np.asarray(value, dtype=object).reshape(-1))
    if np.ndim(value) != 1 or not all(0 < v < float("inf") for v in values):
        raise ArgumentError(f"{what}: {name} must be a 1-D sequence of finite numbers > 0, got {value!r:.60}")
    return values


def text(what: str, name: str, value: Any) -> str:
    """A str."""
    if not isinstance(value, str):
        raise ArgumentError(f"{what}: {name} must be a str, got {type(value).__name__} {value!r:.40}")
    return value


def brief(value: object) -> str:
    """``value`` for an error message, short whatever it is: a number or the start of a string as written,
    anything else by its type (the repr of a large or deeply nested value is not computed)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an int of {value.bit_length()} bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value[:60]) + ("..." if len(value) > 60 else "")
    return f"a {type(value).__name__}"


def within(path: Path, folder: Path) -> Path | None:
    """``path`` as a path under ``folder`` where it lies there, links resolved (the file or the folder reached
    through a symbolic link); None where it lies elsewhere."""
    try:
        return folder / path.resolve().relative_to(folder.resolve())
    except (OSError, ValueError, RuntimeError):  # RuntimeError: a loop of symbolic links
        return None


def linked_within(path: Path, folder: Path) -> Path | None:
    """The first file under ``folder`` that is the file ``path`` by another name (a hard link, or a symbolic
    link to it); None where there is none."""
    identity = _identity(path)
    if identity is None or not folder.is_dir():
        return None
    for root, _dirs, files in os.walk(folder):
        for name in files:
            if _identity(Path(root, name)) == identity:
                return Path(root, name)
    return None


def _identity(path: Path) -> tuple[int, int] | None:
    """The file's (device, inode), following links; None where it cannot be read."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
