"""Fusion: the graph pass between a recording and an executor's plan.

First, epilogues fold into the matmul that produces their input: ``add(matmul(a, b), bias)`` (bias one
value per output column) and an activation after it (``relu``, ``gelu``, ``silu``, any unary op of the
op-expression table) become the matmul's ``bias`` and ``activation``, stored by its kernel, where the
matmul runs as one launch (no split-K) and its output (and the add's) is read by that op only. Then
chains of elementwise ops (the op-expression table's ops and casts, with broadcast operands and scalars)
become one generated kernel each (:func:`batchgpu.ops.fused.fuse_nodes`), on every executor. An op joins
the op that reads its output when that output

- is read by that op only (no other op, no view, no in-place writer) and is not kept (``keep``: a batch's
  declared outputs, ``batch.outputs``, or else the tensors no op consumes and those read so far:
  :meth:`batchgpu.runner.Readback.kept`);
- has the reader's output shape (it is read at the output index, not broadcast);
- is computed in the chain's compute type (a cast may convert between two);

and nothing between the chain's first op and its reader writes the chain's inputs in place. A chain reads
at most ``MAX_FUSED_INPUTS`` input buffers (fewer where the device allows fewer storage buffers per
stage), runs at most ``MAX_FUSED_OPS`` ops and holds at most ``MAX_FUSED_CONSTANTS`` constants: the
Python scalar operands of its ops (size-1 constants no op writes), which are words of the kernel's
params, not input buffers, so ``x * 0.5 + 1.0`` reads one buffer and any other pair of numbers runs the
same pipeline. Results match the unfused graph: every intermediate is rounded through its own dtype
(float16 as numpy rounds, by integer arithmetic that no compiler may fold:
:data:`batchgpu.ops.fused.ROUND_FLOAT16`), a constant holds the bits its buffer would, so integers are
equal and floats agree within their dtype's tolerance (a driver may fuse a multiply and an add of two ops
into one rounding, as WGSL and NVRTC allow; a folded matmul epilogue keeps product, bias and activation
in float32); the reference executor computes member by member, exactly as the unfused graph.

``BATCHGPU_FUSION=off`` (or ``GpuCommandBatch(fusion=False)``) turns the pass off for debugging.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from .limits import Limits, check_launch
from .ops import Node
from .ops.fused import compute_type, fuse_nodes, input_key, is_fusible
from .ops.interface import MAX_FUSED_CONSTANTS, MAX_FUSED_INPUTS, MAX_FUSED_OPS
from .ops.matmul import fold_epilogue, is_activation
from .tensor import Storage, Tensor

ENV_SWITCH = "BATCHGPU_FUSION"


def enabled_by_environment() -> bool:
    """False when ``BATCHGPU_FUSION`` is ``off``/``0``/``false``/``no``."""
    return os.environ.get(ENV_SWITCH, "on").strip().lower() not in ("off", "0", "false", "no")


@dataclass
class Fused:
    """The nodes an executor plans, and the intermediates no kernel writes any more (unreadable)."""

    nodes: list[Node]
    eliminated: frozenset[Storage] = frozenset()


@dataclass
class _Chain:
    """Node indices of a chain (recording order, its root last), its input buffers by key and its
    constants."""

    members: list[int]
    inputs: dict[tuple, Tensor] = field(default_factory=dict)
    constants: set[Storage] = field(default_factory=set)
    ctype: str | None = None


def fuse(
    nodes: Sequence[Node],
    keep: Collection[Storage],
    limits: Limits,
    device_name: str,
    host: Mapping[Storage, np.ndarray] = MappingProxyType({}),
) -> Fused:
    """Fold epilogues into matmuls, then replace every chain of two or more fusible ops of ``nodes`` by
    one fused node; ``keep`` are the storages that stay readable; ``host`` the host values of the batch's
    constants (those of size 1 that no op writes become constants of the kernels that read them)."""
    folded = _fold_epilogues(nodes, set(keep))
    chained = _fuse_chains(folded.nodes, keep, limits, device_name, host)
    return Fused(chained.nodes, folded.eliminated | chained.eliminated)


def _inlinable(host: Mapping[Storage, np.ndarray], writers: Mapping[Storage, list[int]]) -> dict[Storage, np.ndarray]:
    """The constants a fused kernel may hold in its params: one value each, never written by an op."""
    return {
        storage: value
        for storage, value in host.items()
        if storage.kind == "const" and storage.nbytes == storage.dtype.itemsize and not writers.get(storage)
    }


def _uses(nodes: Sequence[Node]) -> tuple[dict[Storage, set[int]], dict[Storage, list[int]]]:
    """Which nodes read (inputs) and write each storage, by index."""
    readers: dict[Storage, set[int]] = defaultdict(set)
    writers: dict[Storage, list[int]] = defaultdict(list)
    for index, node in enumerate(nodes):
        for tensor in node.inputs:
            readers[tensor.storage].add(index)
        for storage in node.written():
            writers[storage].append(index)
    return readers, writers


def _fold_epilogues(nodes: Sequence[Node], kept: set[Storage]) -> Fused:
    """Each matmul whose output only an ``add`` of a bias row and / or an activation reads, with those
    ops in its store (see :func:`batchgpu.ops.matmul.fold_epilogue`)."""
    readers, writers = _uses(nodes)

    def sole_reader(index: int) -> int | None:
        storage = nodes[index].output.storage
        reader = readers[storage]
        if len(reader) != 1 or storage in kept or writers[storage] != [index]:
            return None
        (after,) = reader
        return after if after > index else None

    replaced: dict[int, Node] = {}
    absorbed: set[int] = set()
    for index, node in enumerate(nodes):
        if node.spec.name != "matmul" or not node.outputs:
            continue
        taken, bias, activation, out = [], None, None, node.output
        after = sole_reader(index)
        if after is not None and nodes[after].spec.name == "add":
            bias = _bias_operand(nodes, index, after, writers)
            if bias is not None:
                taken.append(after)
                out = nodes[after].output
                after = sole_reader(after)
        if after is not None and is_activation(nodes[after], out):
            taken.append(after)
            activation, out = nodes[after].spec.name, nodes[after].output
        folded = fold_epilogue(node, out, bias=bias, activation=activation) if taken else None
        if folded is not None:
            replaced[index] = folded
            absorbed.update(taken)
    written = {folded.output.storage for folded in replaced.values()}
    eliminated = {nodes[i].output.storage for i in (*replaced, *absorbed)} - written
    planned = [replaced.get(i, node) for i, node in enumerate(nodes) if i not in absorbed]
    return Fused(planned, frozenset(eliminated))


def _bias_operand(nodes: Sequence[Node], matmul: int, add: int, writers: dict[Storage, list[int]]) -> Tensor | None:
    """The other operand of ``add`` when it is a row of one value per output column, of the product's
    dtype, final when the matmul runs (nothing writes it from there to the add)."""
    product = nodes[matmul].output
    a, b = nodes[add].inputs
    other = b if a.storage is product.storage else a
    if other.storage is product.storage or type(other) is not Tensor:
        return None
    if other.shape != product.shape[-1:] or other.dtype != product.dtype or nodes[add].output.shape != product.shape:
        return None
    if any(w >= matmul for w in writers[other.storage]):
        return None
    return other


def _fuse_chains(
    nodes: Sequence[Node], keep: Collection[Storage], limits: Limits, device_name: str, host: Mapping
) -> Fused:
    """Every chain of two or more fusible elementwise ops as one fused node."""
    readers, writers = _uses(nodes)
    constants = _inlinable(host, writers)
    cap = min(MAX_FUSED_INPUTS, limits.max_storage_buffers_per_shader_stage - 1)
    chains: dict[int, _Chain] = {}  # by root index
    kept = set(keep)
    for index, node in enumerate(nodes):
        if not is_fusible(node):
            continue
        buffers = {input_key(t): t for t in node.inputs if t.storage not in constants}
        chain = _Chain([index], buffers, {t.storage for t in node.inputs if t.storage in constants}, compute_type(node))
        for tensor in node.inputs:
            producer = writers[tensor.storage][0] if len(writers[tensor.storage]) == 1 else None
            if producer is None or producer not in chains or tensor.storage in kept:
                continue
            if _joins(chains[producer], chain, tensor, index, nodes, readers, writers, cap):
                _absorb(chain, chains.pop(producer), tensor)
        chains[index] = chain
    fused_at = {chain.members[-1]: chain for chain in chains.values() if len(chain.members) > 1}
    absorbed = {i for chain in fused_at.values() for i in chain.members[:-1]}
    planned: list[Node] = []
    for index, node in enumerate(nodes):
        if index in fused_at:
            fused = fuse_nodes([nodes[i] for i in fused_at[index].members], constants)
            for launch in fused.launches:
                check_launch(launch, limits, device_name)
            planned.append(fused)
        elif index not in absorbed:
            planned.append(node)
    eliminated = frozenset(nodes[i].output.storage for i in absorbed)
    return Fused(planned, eliminated)


def _joins(
    producer: _Chain,
    consumer: _Chain,
    tensor: Tensor,
    at: int,
    nodes: Sequence[Node],
    readers: dict[Storage, set[int]],
    writers: dict[Storage, list[int]],
    cap: int,
) -> bool:
    """Whether ``producer``'s chain (whose root writes ``tensor``) may run inside ``consumer``'s, at node
    ``at``."""
    root = nodes[producer.members[-1]]
    if readers[tensor.storage] != {at} or tensor.shape != nodes[at].output.shape or root.output.shape != tensor.shape:
        return False
    if None not in (producer.ctype, consumer.ctype) and producer.ctype != consumer.ctype:
        return False
    merged = (consumer.inputs.keys() - {input_key(tensor)}) | producer.inputs.keys()
    if len(merged) > cap or len(consumer.constants | producer.constants) > MAX_FUSED_CONSTANTS:
        return False
    if len(consumer.members) + len(producer.members) > MAX_FUSED_OPS:
        return False
    first = producer.members[0]
    return not any(first < w < at for t in producer.inputs.values() for w in writers[t.storage])


def _absorb(consumer: _Chain, producer: _Chain, tensor: Tensor) -> None:
    consumer.members = sorted(consumer.members + producer.members)
    consumer.inputs.pop(input_key(tensor), None)
    consumer.inputs.update(producer.inputs)
    consumer.constants |= producer.constants
    consumer.ctype = consumer.ctype or producer.ctype
