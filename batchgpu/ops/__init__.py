"""The op table: every op batchgpu records, keyed by name."""

from __future__ import annotations

from . import attention, custom, elementwise, gather, layout, matmul, norm, paged, reduce, sampling, select
from .spec import Node, OpSpec

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for family in (elementwise, select, layout, matmul, reduce, norm, attention, paged, gather, sampling, custom)
    for spec in family.SPECS
}

__all__ = ["OPS", "Node", "OpSpec"]
