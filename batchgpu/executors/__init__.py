"""Executors behind the batch API, created by name."""

from __future__ import annotations

from typing import Any

from ..errors import BatchError
from .base import Executor, Stats

KINDS = ("wgpu", "reference")


def create_executor(kind: str, *, adapter: Any = None, poison: bool = False) -> Executor:
    """Create the executor ``kind`` (``"wgpu"`` or ``"reference"``)."""
    if kind == "wgpu":
        from .wgpu import WgpuExecutor

        return WgpuExecutor(adapter, poison=poison)
    if kind == "reference":
        from .reference import ReferenceExecutor

        return ReferenceExecutor()
    raise BatchError(f"Device: unknown executor {kind!r}; expected one of {', '.join(KINDS)}")


__all__ = ["KINDS", "Executor", "Stats", "create_executor"]
