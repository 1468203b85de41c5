"""Buffer sharing: the intermediates a plan does not keep readable (``keep``: the declared outputs,
``batch.outputs(...)``, or by default the tensors no op consumes and those read so far) share buffers.

An intermediate (an op's output that is not kept, or an op's scratch) lives from the node that
writes it first to the last node that reads or writes it. Intermediates whose lifetimes do not overlap
share one device buffer, sized for the largest of them. Only storages that their producing node writes
whole before anything reads them can share: inputs, constants, resident tensors, kept storages and
``batch.empty`` tensors (which may carry data from one execute to the next) keep their own buffers.

Assignment is greedy in recording order: a storage takes the smallest free buffer that fits, else the
largest free one (grown to fit), else a new one. Executors receive the buffers to allocate and an alias
map (storage -> the buffer storage it uses).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from .ops import Node
from .tensor import Storage

_BYTE = np.dtype(np.uint8)


@dataclass
class BufferPlan:
    """What to allocate (``storages``), who shares what (``aliases``), and the bytes saved. ``shareable``
    are the intermediates the assignment was free to share (their contents do not survive an execute,
    whether or not another storage ended up in the same buffer)."""

    storages: list[Storage]
    aliases: dict[Storage, Storage] = field(default_factory=dict)
    shareable: frozenset[Storage] = frozenset()
    unshared_bytes: int = 0  # every batch storage with its own buffer

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


def stateful_storages(nodes: Sequence[Node], storages: Collection[Storage]) -> frozenset[Storage]:
    """Storages whose device contents carry from one execute to the next: ``batch.empty`` tensors (no op
    produces them) and every storage an op writes in place (KV caches, custom kernels' buffers)."""
    produced = {t.storage for node in nodes if not node.spec.view for t in node.outputs}
    owned = set(storages)
    in_place = {s for node in nodes for s in node.written() if s in owned and s not in produced}
    empties = {s for s in owned if s.kind == "output" and s not in produced}
    return frozenset(empties | in_place)


def lifetimes(nodes: Sequence[Node], keep: Collection[Storage]) -> dict[Storage, tuple[int, int]]:
    """(first, last) node index of every storage that may share a buffer."""
    spans: dict[Storage, tuple[int, int]] = {}
    barred: set[Storage] = set(keep)
    for index, node in enumerate(nodes):
        created = set() if node.spec.view else {t.storage for t in node.outputs} | set(node.scratch)
        touched = [t.storage for t in node.inputs] + node.written() + list(node.scratch)
        for storage in touched:
            if storage in barred:
                continue
            if storage in spans:
                spans[storage] = (spans[storage][0], index)
            elif storage in created and storage.kind in ("output", "scratch"):
                spans[storage] = (index, index)
            else:
                barred.add(storage)  # read (or partly written) before its producer wrote it: keeps its data
    return spans


def share_buffers(nodes: Sequence[Node], storages: Sequence[Storage], keep: Collection[Storage]) -> BufferPlan:
    """Assign the batch's ``storages`` to buffers; ``keep`` (the storages the plan keeps readable) are never
    shared."""
    spans = lifetimes(nodes, keep)
    pools: list[list] = []  # [capacity, free after node index, members]
    for storage in sorted(spans, key=lambda s: (spans[s][0], -s.nbytes, s.id)):
        start, end = spans[storage]
        free = [pool for pool in pools if pool[1] < start]
        fitting = [pool for pool in free if pool[0] >= storage.nbytes]
        if fitting:
            pool = min(fitting, key=lambda p: p[0])
        elif free:
            pool = max(free, key=lambda p: p[0])
            pool[0] = storage.nbytes
        else:
            pool = [storage.nbytes, -1, []]
            pools.append(pool)
        pool[1] = end
        pool[2].append(storage)
    plan = BufferPlan(
        [s for s in storages if s not in spans],
        shareable=frozenset(spans),
        unshared_bytes=sum(s.nbytes for s in storages),
    )
    for capacity, _, members in pools:
        if len(members) == 1:
            plan.storages.append(members[0])
            continue
        buffer = Storage(capacity, "scratch", _BYTE)
        plan.storages.append(buffer)
        plan.aliases.update(dict.fromkeys(members, buffer))
    return plan
