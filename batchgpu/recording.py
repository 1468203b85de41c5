"""What a batch recorded: its ops, the storages they use, the host data of its inputs and constants,
and its per-execute scalars. Device-free; the batch validates every call, this keeps what passed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .memory import stateful_storages
from .ops import Node
from .scalars import Scalar
from .tensor import Storage, Tensor


class Recording:
    """The recorded graph of one batch. ``count`` advances with every recorded storage and op, so a
    storage's place in it says whether an execute (which notes the count it ran at) saw it."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.storages: list[Storage] = []
        self.births: dict[int, int] = {}  # storage id -> count when recorded
        self.host: dict[Storage, np.ndarray] = {}  # latest host data of inputs and constants
        self.pending: dict[Storage, np.ndarray] = {}  # host data not uploaded yet (new inputs, constants)
        self.scalars: dict[str, Scalar] = {}
        self.scalar_values: dict[str, int | float] = {}
        self.record_spans: list[tuple[float, float]] = []  # host time of each op's record call (profiling)
        self.count = 0

    def own(self, storage: Storage, data: np.ndarray | None = None) -> None:
        """Add a storage of the batch; ``data`` is its host value, uploaded by the next execute."""
        self.storages.append(storage)
        self.births[storage.id] = self.count
        self.count += 1
        if data is not None:
            self.host[storage] = self.pending[storage] = data

    def add(self, node: Node, constants: Sequence[tuple[Storage, np.ndarray]]) -> None:
        """Add an op with the constants it made (Python scalar operands) and its outputs and scratch."""
        for storage, value in (*constants, *node.constants):
            self.own(storage, value)
        if not node.spec.view:
            for tensor in node.outputs:
                self.own(tensor.storage)
        for storage in node.scratch:
            self.own(storage)
        self.nodes.append(node)
        self.count += 1

    def recorded_before(self, storage: Storage, count: int) -> bool:
        """Whether the batch's ``storage`` existed when the recording's count was ``count``."""
        return self.births[storage.id] < count

    def stateful(self) -> frozenset[Storage]:
        """Storages whose device contents live from one execute to the next (:func:`stateful_storages`)."""
        return stateful_storages(self.nodes, self.storages)

    def sinks(self) -> set[Storage]:
        """Outputs written and never read afterwards: what a batch reads back when told nothing else."""
        last_write: dict[Storage, int] = {}
        last_read: dict[Storage, int] = {}
        for index, node in enumerate(self.nodes):
            for tensor in node.inputs:
                last_read[tensor.storage] = index
            for storage in node.written():
                last_write[storage] = index
        return {s for s, w in last_write.items() if s.kind == "output" and last_read.get(s, -1) <= w}

    def replayable(self) -> bool:
        """Whether running an execute again with its inputs and scalars gives its values again: no op writes
        a tensor in place (state carried from one execute to the next) and none reads a resident tensor
        (which may change between executes: ``Device.write``, other batches, a DLPack consumer)."""
        return not any(
            node.spec.inplace or any(t.storage.kind == "resident" for t in node.inputs) for node in self.nodes
        )

    def input_tensors(self) -> tuple[Tensor, ...]:
        """One tensor per input storage some op uses, in upload order."""
        by_storage: dict[Storage, Tensor] = {}
        for node in self.nodes:
            for tensor in node.inputs:
                if tensor.storage.kind == "input":
                    by_storage.setdefault(tensor.storage, tensor)
        return tuple(by_storage[s] for s in self.storages if s in by_storage)

    def uses(self, storage: Storage) -> bool:
        """Whether some recorded op reads ``storage``."""
        return any(t.storage is storage for node in self.nodes for t in node.inputs)
