"""Executors behind the batch API, created by name."""

from __future__ import annotations

from typing import Any

from ..errors import BatchError
from .base import Executor, Stats

KINDS = ("wgpu", "reference", "cuda", "hip")


def create_executor(kind: str, *, adapter: Any = None, poison: bool = False) -> Executor:
    """Create the executor ``kind`` (``"wgpu"``, ``"reference"``, ``"cuda"`` or ``"hip"``)."""
    if kind == "wgpu":
        from .wgpu import WgpuExecutor

        return WgpuExecutor(adapter, poison=poison)
    if kind == "reference":
        from .reference import ReferenceExecutor

        return ReferenceExecutor()
    if kind in ("cuda", "hip"):
        from .native import EXECUTORS

        return EXECUTORS[kind](device=adapter if isinstance(adapter, int) else 0, poison=poison)
    raise BatchError(f"Device: unknown executor {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = ["KINDS", "Executor", "Stats", "create_executor"]
