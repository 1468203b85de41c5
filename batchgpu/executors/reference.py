"""The numpy reference executor: runs a recorded graph op by op with each spec's numpy reference.
It defines the semantics every device executor is tested against."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..dtypes import FLOAT16, FLOAT32, SUPPORTED
from ..errors import NotExecutedError
from ..interop import KDL_CPU
from ..limits import Limits
from ..ops import Node
from ..quant import dequantize_words
from ..scalars import Scalar
from ..tensor import QuantTensor, Storage, Tensor
from .base import Execution, Executor, Plan, Stats

if TYPE_CHECKING:
    from ..profiling import Session


class ReferencePlan(Plan):
    def __init__(self, nodes: Sequence[Node], arrays: dict[Storage, np.ndarray]) -> None:
        self.nodes = list(nodes)
        self.arrays = arrays


class ReferenceExecution(Execution):
    def __init__(self, results: dict[Storage, np.ndarray]) -> None:
        self.results = results

    def holds(self, storage: Storage) -> bool:
        return storage in self.results


class ReferenceExecutor(Executor):
    kind = "reference"
    name = "numpy reference"

    def __init__(self) -> None:
        self.limits = Limits()
        self.features = frozenset({"shader-f16"})
        self.stats = Stats()
        self._resident: dict[Storage, np.ndarray] = {}
        self._dequant_cache: dict[int, np.ndarray] = {}

    def supports(self, dtype: np.dtype) -> bool:
        return dtype in SUPPORTED

    def alloc_resident(self, storage: Storage, data: np.ndarray) -> None:
        self._resident[storage] = data.reshape(-1).copy()
        self.stats.bytes_uploaded += data.nbytes

    def write_resident(self, storage: Storage, data: np.ndarray) -> None:
        self._resident[storage][:] = data.reshape(-1)
        self._dequant_cache.pop(storage.id, None)
        self.stats.bytes_uploaded += data.nbytes

    def read_resident(self, storage: Storage) -> np.ndarray:
        self.stats.bytes_read += storage.nbytes
        return self._resident[storage].copy()

    def dlpack_device(self) -> tuple[int, int]:
        return (KDL_CPU, 0)

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]:
        """The resident host array itself (zero copy: Device.write later updates it in place), or a copy."""
        array = self._resident[storage]
        if copy:
            array = array.copy()
        return array.ctypes.data, array

    def plan(
        self,
        nodes: Sequence[Node],
        storages: Sequence[Storage],
        scalars: Sequence[Scalar],
        *,
        aliases: Mapping[Storage, Storage] | None = None,
    ) -> ReferencePlan:
        arrays = {s: np.zeros(s.nbytes // s.dtype.itemsize, dtype=s.dtype) for s in storages}
        for storage, shared in (aliases or {}).items():  # typed views of the shared bytes, as on a GPU
            arrays[storage] = arrays[shared].view(np.uint8)[: storage.nbytes].view(storage.dtype)
        for node in nodes:
            for tensor in node.inputs:
                if tensor.resident:
                    arrays[tensor.storage] = self._resident[tensor.storage]
        return ReferencePlan(nodes, arrays)

    def carry(self, source: Plan, target: Plan, storages: Sequence[Storage]) -> None:
        for storage in storages:
            target.arrays[storage][:] = source.arrays[storage]  # type: ignore[attr-defined]

    def run(
        self,
        plan: Plan,
        writes: Sequence[tuple[Storage, np.ndarray]],
        readback: Sequence[Storage],
        scalars: Mapping[str, int | float],
        *,
        profile: Session | None = None,
    ) -> ReferenceExecution:
        assert isinstance(plan, ReferencePlan)
        run_node = self._run_node if profile is None else HostOpTimer(self._run_node, plan, profile)
        for storage, data in writes:
            plan.arrays[storage][:] = data.reshape(-1)
            self.stats.bytes_uploaded += data.nbytes
        for node in plan.nodes:
            run_node(plan, node, scalars)
            self.stats.dispatches += len(node.launches)
        if profile is not None:
            run_node.done()
        self.stats.submits += 1
        return ReferenceExecution({s: self.snapshot(plan, s) for s in readback})

    def snapshot(self, plan: Plan, storage: Storage) -> np.ndarray:
        """A copy of ``storage``'s flat contents in ``plan`` now (what a readback copy lands)."""
        assert isinstance(plan, ReferencePlan)
        if storage not in plan.arrays:
            raise NotExecutedError(f"read: {storage} is not part of this batch's plan")
        return plan.arrays[storage].copy()

    def _run_node(self, plan: ReferencePlan, node: Node, scalars: Mapping[str, int | float]) -> None:
        if node.spec.view:
            return
        params = {k: scalars[v.name] if isinstance(v, Scalar) else v for k, v in node.params.items()}
        views = [self._dequantized(t) if isinstance(t, QuantTensor) else _view(plan.arrays, t) for t in node.inputs]
        if not node.outputs:  # in-place ops (custom kernels, cache writes) update writable views
            node.spec.reference(views, params)
            return
        written = () if node.spec.inplace == "all" else node.spec.inplace  # "all": no outputs, handled above
        upcast = [v.astype(FLOAT32) if v.dtype == FLOAT16 and i not in written else v for i, v in enumerate(views)]
        results = node.spec.reference(upcast, params)
        if len(node.outputs) == 1:
            results = (results,)
        for out, result in zip(node.outputs, results):
            with np.errstate(over="ignore"):  # float32 past float16's range stores inf, as the GPU does
                plan.arrays[out.storage][: out.size] = np.asarray(result).astype(out.dtype).reshape(-1)

    def _dequantized(self, tensor: QuantTensor) -> np.ndarray:
        """Quantized weights as float32, computed once per tensor. Stored column-major: the quantized
        matmuls read them transposed (``x @ w.T``), and BLAS multiplies a few rows by a contiguous
        ``w.T`` fastest."""
        cached = self._dequant_cache.get(tensor.storage.id)
        if cached is None:
            words = self._resident[tensor.storage]
            rows = dequantize_words(words, tensor.qtype, tensor.shape)
            cached = self._dequant_cache[tensor.storage.id] = np.asfortranarray(rows)
        return cached

    def holding(self, plan: Plan, execution: Execution, storage: Storage) -> ReferenceExecution:
        """``execution``, or for a storage it did not copy back, its contents copied now."""
        assert isinstance(execution, ReferenceExecution)
        if execution.holds(storage):
            return execution
        return ReferenceExecution({storage: self.snapshot(plan, storage)})

    def read(self, execution: Execution, storage: Storage) -> np.ndarray:
        assert isinstance(execution, ReferenceExecution)
        data = execution.results[storage]
        self.stats.bytes_read += data.nbytes
        return data

    async def read_async(self, execution: Execution, storage: Storage) -> np.ndarray:
        return self.read(execution, storage)


def _view(arrays: dict[Storage, np.ndarray], tensor: Tensor) -> np.ndarray:
    return arrays[tensor.storage][: tensor.size].reshape(tensor.shape)


class HostOpTimer:
    """``_run_node`` timing each op on the host for ``execute(profile=True)``: numpy has no GPU timeline."""

    def __init__(self, run_node: Callable[..., None], plan: ReferencePlan, profile: Session) -> None:
        self.run_node = run_node
        self.profile = profile
        self.index = {id(node): i for i, node in enumerate(plan.nodes)}
        self.started = time.perf_counter()
        profile.message = "GPU timing unavailable on the reference executor (numpy): host time per op"

    def __call__(self, plan: ReferencePlan, node: Node, *args: Any) -> None:
        if self.started is not None:  # the writes before the first op
            self.cursor = self.profile.span("upload", self.started)
            self.started = None
        begin = time.perf_counter()
        self.run_node(plan, node, *args)
        if node.launches:
            self.profile.op_host[self.index[id(node)]] = (begin, time.perf_counter())

    def done(self) -> None:
        if self.started is not None:
            self.cursor = self.profile.span("upload", self.started)
        self.profile.span("run ops", self.cursor)
