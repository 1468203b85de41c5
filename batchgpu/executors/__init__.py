"""Executors behind the batch API, created by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import BatchError
from .base import Executor, Stats

KINDS = ("wgpu", "reference", "cuda", "hip")


def create_executor(
    kind: str, *, adapter: Any = None, poison: bool = False, limits: Mapping[str, int] | None = None
) -> Executor:
    """Create the executor ``kind`` (``"wgpu"``, ``"reference"``, ``"cuda"`` or ``"hip"``), its ``max_*``
    limits lowered to ``limits`` where given (:meth:`~batchgpu.limits.Limits.lowered`; wgpu requests its device
    with them, so the driver's own validation holds the lowered values too)."""
    executor: Executor
    if kind == "wgpu":
        from .wgpu import WgpuExecutor

        return WgpuExecutor(adapter, poison=poison, limits=limits)
    if kind == "reference":
        from .reference import ReferenceExecutor

        executor = ReferenceExecutor()
    elif kind in ("cuda", "hip"):
        from .native import EXECUTORS

        executor = EXECUTORS[kind](device=adapter if isinstance(adapter, int) else 0, poison=poison)
    else:
        raise BatchError(f"Device: unknown executor {kind!r}; expected one of {', '.join(KINDS)}")
    executor.limits = executor.limits.lowered(limits, executor.name)
    return executor


__all__ = ["KINDS", "Executor", "Stats", "create_executor"]
