"""The wgpu executor: WGSL kernels on Vulkan, Metal, D3D12, GL or lavapipe through wgpu-py.

Planning builds every buffer, pipeline (from the device's cache) and bind group once, by the rules of
:mod:`.wgpu_plan`; ``run`` writes the inputs, encodes all dispatches in one compute pass plus the
readback copies in one command encoder, and submits once. Readback maps pooled ``MAP_READ`` staging
buffers (the read path itself is :class:`~batchgpu.executors.base.DeviceExecutor`'s).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cache import DiskIndex, configure_driver_cache
from ..coldstart import import_wgpu
from ..dtypes import FLOAT16, SUPPORTED
from ..errors import CompileError, DeviceError, ExportError, LimitError
from ..interop import KDL_WEBGPU
from ..kernels import Launch
from ..limits import Limits, split_groups
from ..ops import Node
from ..scalars import SCALAR_BYTES, Scalar, uniform_bytes
from ..tensor import Storage
from .base import POISON_BYTE, DeviceExecutor, Plan, ReadbackLayout, StagedExecution, StagingPool, Stats, padded
from .blocking import BlockingWorker
from .wgpu_encode import DirectEncoder, direct_encoder, encode_plain
from .wgpu_plan import LaunchLayout, PipelineSpec, pipeline_key, pipeline_spec, plan_launches
from .wgpu_timing import GpuTimer

if TYPE_CHECKING:
    from ..profiling import Session

log = logging.getLogger("batchgpu")

REQUESTED_FEATURES = ("shader-f16", "timestamp-query", "timestamp-query-inside-passes", "subgroup")


def quiet_environment() -> None:
    """Give Mesa's WSI a private XDG_RUNTIME_DIR so it does not print 'XDG_RUNTIME_DIR is invalid'."""
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and os.path.isdir(current):
        return
    path = os.path.join(tempfile.gettempdir(), f"batchgpu-runtime-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["XDG_RUNTIME_DIR"] = path


def adapter_rank(adapter: Any) -> tuple[int, int]:
    """Lower is better: discrete before integrated before CPU, native APIs before OpenGL."""
    info = adapter.info
    type_rank = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}.get(info.get("adapter_type"), 4)
    backend_rank = 1 if info.get("backend_type") == "OpenGL" else 0
    return (backend_rank, type_rank)


def gpu_kernels(adapter: Any) -> bool:
    """Whether to run launches' GPU forms (:attr:`Launch.gpu`): on every adapter but a CPU one
    (lavapipe, SwiftShader), whose kernels are shaped for few loads per invocation instead;
    ``BATCHGPU_GPU_KERNELS=1`` / ``0`` forces the choice."""
    forced = os.environ.get("BATCHGPU_GPU_KERNELS")
    if forced in ("0", "1"):
        return forced == "1"
    return dict(adapter.info).get("adapter_type") != "CPU"


def choose_adapter(wgpu: Any, adapter: Any = None) -> Any:
    """Pick an adapter: None (best), an index into the enumerated list, a summary substring or an adapter."""
    if adapter is not None and not isinstance(adapter, (int, str)):
        return adapter
    adapters = wgpu.gpu.enumerate_adapters_sync()
    if not adapters:
        raise DeviceError("wgpu: no adapter found (on a machine without a GPU install mesa-vulkan-drivers)")
    if isinstance(adapter, int):
        if not 0 <= adapter < len(adapters):
            raise DeviceError(f"wgpu: adapter index {adapter} out of range (found {len(adapters)})")
        return adapters[adapter]
    if isinstance(adapter, str):
        matches = [a for a in adapters if adapter.lower() in a.summary.lower()]
        if not matches:
            raise DeviceError(f"wgpu: no adapter matches {adapter!r}; found {[a.summary for a in adapters]}")
        adapters = matches
    return min(adapters, key=adapter_rank)


class MapReadPool(StagingPool):
    """``MAP_READ`` staging buffers; ``limit`` is the device's ``max_buffer_size``."""

    def __init__(self, device: Any, wgpu: Any, stats: Stats, limit: int) -> None:
        super().__init__(stats, limit)
        self._device = device
        self._usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST

    def create(self, size: int) -> Any:
        return self._device.create_buffer(size=size, usage=self._usage, label="batchgpu.staging")

    def size(self, buffer: Any) -> int:
        return buffer.size

    def discard(self, buffer: Any) -> None:
        buffer.destroy()


class PipelineCache:
    """Compiled pipelines of one device, keyed by WGSL source, entry point, constants and layout."""

    def __init__(self, device: Any, wgpu: Any, stats: Stats) -> None:
        self._device = device
        self.wgpu = wgpu
        self._stats = stats
        self.lost: Any = lambda what, probe=False: None  # set by the executor: a lost device is no CompileError
        self._modules: dict[str, Any] = {}
        self._pipelines: dict[tuple, Any] = {}
        self._layouts: dict[tuple[int, bool], Any] = {}
        self.disk = DiskIndex(stats)  # pipelines built by earlier processes (see batchgpu/cache.py)

    def get(self, launch: Launch, spec: PipelineSpec | None = None) -> Any:
        """The pipeline of ``launch`` (``spec``: its :func:`~.wgpu_plan.pipeline_spec`, when known)."""
        key = spec.key if spec is not None else pipeline_key(launch)
        pipeline = self._pipelines.get(key)
        if pipeline is None:
            pipeline = self._pipelines[key] = self._compile(launch, spec or pipeline_spec(launch))
            self.disk.created(pipeline, key)
        return pipeline

    def _compile(self, launch: Launch, spec: PipelineSpec) -> Any:
        started = time.perf_counter()
        module = self._modules.get(spec.source)
        try:
            if module is None:
                module = self._device.create_shader_module(code=spec.source, label=spec.shader_name)
                self._modules[spec.source] = module
            layout = self._custom_layout(spec.layout) if spec.layout is not None else "auto"
            pipeline = self._device.create_compute_pipeline(
                layout=layout,
                compute={"module": module, "entry_point": spec.entry, "constants": spec.constants},
                label=spec.label,
            )
        except self.wgpu.GPUError as exc:
            self._modules.pop(spec.source, None)
            self.lost(f"{launch.label}: compiling {spec.shader_name}", probe=True)
            raise CompileError(f"{launch.label}: {spec.shader_name} failed to compile: {exc}") from None
        self._stats.pipelines_compiled += 1
        log.info("compiled %s:%s in %.1f ms", spec.shader_name, spec.entry, 1e3 * (time.perf_counter() - started))
        return pipeline

    def _custom_layout(self, key: tuple[int, bool]) -> Any:
        layout = self._layouts.get(key)
        if layout is None:
            storage_count, has_uniform = key
            stage = self.wgpu.ShaderStage.COMPUTE
            entries = [{"binding": i, "visibility": stage, "buffer": {"type": "storage"}} for i in range(storage_count)]
            if has_uniform:
                entries.append({"binding": storage_count, "visibility": stage, "buffer": {"type": "uniform"}})
            group = self._device.create_bind_group_layout(entries=entries)
            layout = self._layouts[key] = self._device.create_pipeline_layout(bind_group_layouts=[group])
        return layout


class WgpuPlan(Plan):
    def __init__(
        self,
        buffers: dict[Storage, Any],
        dispatches: list[tuple],
        params_buffer: Any,
        scalars_buffer: Any,
        scalars: tuple[Scalar, ...],
    ) -> None:
        self.buffers = buffers
        self.dispatches = dispatches
        self.params_buffer = params_buffer
        self.scalars_buffer = scalars_buffer
        self.scalars = scalars
        self.labels: list[str] = []  # per dispatch: the op and kernel, for errors
        self.direct_calls: list[tuple] | None = None  # the dispatches' C handles (wgpu_encode.DirectEncoder)


class WgpuExecution(StagedExecution):
    """One submit's readback: the staging buffers (parts of the layout's byte range, each at most the
    pool's limit) and, once mapped and copied out, the results. ``waiting``: an asyncio read's mapping
    on the executor's worker."""

    def __init__(self, pool: MapReadPool, parts: list[tuple[Any, int, int]], layout: ReadbackLayout) -> None:
        super().__init__(layout, parts)
        self.pool = pool

    def abandon(self) -> None:
        if self.waiting is None and self.results is None:
            for buffer, _, _ in self.parts:
                self.pool.release(buffer)
        self.parts = []  # a mapping in flight finishes on its own; its buffers are then dropped


def staging_parts(layout: ReadbackLayout, limit: int) -> list[tuple[int, int]]:
    """(first byte, bytes) spans covering the layout's copies, each at most ``limit`` bytes and holding
    whole copies: one staging buffer per span."""
    parts: list[tuple[int, int]] = []
    start = end = 0
    for _, _, offset, size in layout.copies:
        if offset + size - start > limit and end > start:
            parts.append((start, end - start))
            start = offset
        end = offset + size
    if end > start:
        parts.append((start, end - start))
    return parts


class WgpuExecutor(DeviceExecutor):
    kind = "wgpu"

    def __init__(self, adapter: Any = None, *, poison: bool = False, limits: Mapping[str, int] | None = None) -> None:
        super().__init__()
        quiet_environment()
        driver_cache = configure_driver_cache()  # before the graphics instance exists
        wgpu = import_wgpu()

        self.wgpu = wgpu  # the wgpu-py module this executor runs on
        chosen = choose_adapter(wgpu, adapter)
        features = [f for f in REQUESTED_FEATURES if f in chosen.features]
        wanted = Limits.from_mapping(dict(chosen.limits)).lowered(limits, chosen.summary)
        wanted_limits = {
            k: getattr(wanted, k.replace("-", "_"))
            for k in chosen.limits
            if k.replace("-", "_") in Limits.__dataclass_fields__
        }
        self.device = chosen.request_device_sync(required_features=features, required_limits=wanted_limits)
        self.adapter = chosen
        self.name = chosen.summary
        self.features = frozenset(self.device.features)
        self.limits = Limits.from_mapping(dict(self.device.limits))
        self.stats = Stats()
        self.poison = poison
        self.pipelines = PipelineCache(self.device, wgpu, self.stats)
        self.pipelines.disk.open(chosen, driver_cache)
        self.staging = MapReadPool(self.device, wgpu, self.stats, self.limits.max_buffer_size)
        self.waits = BlockingWorker("batchgpu-wgpu-readback")  # maps staging buffers for async reads
        self.pipelines.lost = self.check_alive
        self.lost_reason: str | None = None  # set once the device is known to be lost or destroyed
        self._group_layouts: dict[Any, Any] = {}  # pipeline -> its bind group layout 0
        self._usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.gpu_kernels = gpu_kernels(chosen)
        self.concurrent = dict(chosen.info).get("adapter_type") != "CPU"
        self.direct = direct_encoder(self.device)  # the hot encode loop through wgpu-native's C functions

    def form(self, launch: Launch) -> Launch:
        return launch.for_gpu() if self.gpu_kernels else launch

    def describe(self) -> dict[str, Any]:
        info = dict(self.adapter.info)
        return {**super().describe(), "backend": info.get("backend_type"), "adapter_type": info.get("adapter_type")}

    def supports(self, dtype: np.dtype) -> bool:
        return dtype in SUPPORTED and (dtype != FLOAT16 or "shader-f16" in self.features)

    # device loss ------------------------------------------------------------------------------

    def check_alive(self, what: str, probe: bool = False) -> None:
        """Raise DeviceError if the device was lost or destroyed. The cheap test is wgpu-py 0.32's own
        state: ``GPUDevice.destroy()`` stops the device's poll thread (wgpu-py exposes no ``lost``
        promise, and mapping or submitting on a destroyed device aborts the process inside
        wgpu-native, so this must be known before those calls). ``probe=True`` (error paths only) also
        finishes an empty command encoder, which fails with "device is lost" after any loss."""
        if self.lost_reason is None and getattr(self.device, "_poller", True) is None:
            self.lost_reason = "destroyed"
        if self.lost_reason is None and probe:
            try:
                self.device.create_command_encoder().finish()
            except self.wgpu.GPUError as exc:
                if "lost" in str(exc).lower():
                    self.lost_reason = "lost: " + " ".join(str(exc).split())
        if self.lost_reason is not None:
            raise DeviceError(
                f"{what}: the device {self.name!r} was {self.lost_reason}; its buffers and unread results are "
                f"gone. Create a new bg.Device() (and record the batches again on it)"
            )

    # buffers ----------------------------------------------------------------------------------

    def _create_buffer(self, storage: Storage, label: str) -> Any:
        size = padded(storage.nbytes)
        if size > self.limits.max_buffer_size:
            raise LimitError(f"{label}: max_buffer_size exceeded: {size} > {self.limits.max_buffer_size}")
        try:
            buffer = self.device.create_buffer(size=size, usage=self._usage, label=label)
        except self.wgpu.GPUError as exc:
            self.check_alive(f"allocating {label}", probe=True)
            raise DeviceError(f"allocating {label} ({size} bytes) failed: {exc}") from None
        self.stats.buffers_created += 1
        self.stats.buffers_live += 1
        weakref.finalize(buffer, _decrement_live, self.stats)
        return buffer

    def _write(self, buffer: Any, data: np.ndarray) -> None:
        raw = data.reshape(-1).view(np.uint8)
        if raw.nbytes % 4:
            raw = np.concatenate([raw, np.zeros(-raw.nbytes % 4, np.uint8)])
        self.device.queue.write_buffer(buffer, 0, raw)
        self.stats.bytes_uploaded += data.nbytes

    def allocate(self, storage: Storage) -> Any:
        return self._create_buffer(storage, f"{storage.kind} {storage.id}")

    def poison_fill(self, buffer: Any) -> None:
        self.device.queue.write_buffer(buffer, 0, bytes([POISON_BYTE]) * buffer.size)

    def alloc_resident(self, storage: Storage, data: np.ndarray) -> None:
        self.check_alive("Device.tensor")
        buffer = self._create_buffer(storage, f"resident {storage.id}")
        self.keep_resident(storage, buffer)
        self._write(buffer, data)

    def write_resident(self, storage: Storage, data: np.ndarray) -> None:
        self.check_alive("Device.write")
        self._write(self.resident_buffer(storage), data)

    def dlpack_device(self) -> tuple[int, int]:
        return (KDL_WEBGPU, 0)

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]:
        raise ExportError(
            f"wgpu: buffers of {self.name} cannot be shared with other libraries (WebGPU gives no device "
            f"pointer); copy the tensor to the host with Device.read(tensor)"
        )

    def read_resident(self, storage: Storage) -> np.ndarray:
        self.check_alive("Device.read")
        execution = self.submit_copies(ReadbackLayout.single(storage, self.resident_buffer(storage)))
        return self.collect(execution)[storage]

    # planning ---------------------------------------------------------------------------------

    def prepare(self, launch: Launch) -> None:
        self.pipelines.get(self.form(launch))

    def plan(
        self,
        nodes: Sequence[Node],
        storages: Sequence[Storage],
        scalars: Sequence[Scalar],
        *,
        aliases: Mapping[Storage, Storage] | None = None,
    ) -> WgpuPlan:
        self.check_alive("execute")
        buffers, launches = self.plan_buffers(nodes, storages, aliases)
        layout = plan_launches(launches, self.limits.min_uniform_buffer_offset_alignment)
        uniform_usage = self.wgpu.BufferUsage.UNIFORM | self.wgpu.BufferUsage.COPY_DST
        params_buffer = None
        if layout.params:
            params_buffer = self.device.create_buffer(size=len(layout.params), usage=uniform_usage, label="params")
            self.device.queue.write_buffer(params_buffer, 0, layout.params)
        scalars_buffer = self.device.create_buffer(size=SCALAR_BYTES, usage=uniform_usage, label="scalars")
        own = {"params": params_buffer, "scalars": scalars_buffer}
        dispatches = []
        for planned in layout.launches:
            launch = planned.launch
            pipeline = self.pipelines.get(launch, planned.pipeline)
            bind_group = self._bind_group(pipeline, planned, buffers, own)
            grid = split_groups(launch.groups, self.limits) if isinstance(launch.groups, int) else launch.groups
            dispatches.append((pipeline, bind_group, *grid))
        self.pipelines.disk.dispatched([d[0] for d in dispatches])
        plan = WgpuPlan(buffers, dispatches, params_buffer, scalars_buffer, tuple(scalars))
        plan.direct_calls = DirectEncoder.handles(dispatches) if self.direct is not None else None
        plan.labels = [f"op {launch.label!r} ({launch.describe()})" for launch in launches]
        return plan

    def _bind_group(self, pipeline: Any, planned: LaunchLayout, buffers: dict, own: dict[str, Any]) -> Any:
        """The bind group of ``planned`` (:func:`~.wgpu_plan.bind_entries`): ``own`` holds the plan's
        params and scalars buffers."""
        entries = [
            {
                "binding": entry.slot,
                "resource": {
                    "buffer": buffers[entry.storage] if entry.storage is not None else own[entry.kind],
                    "offset": entry.offset,
                    "size": entry.size,
                },
            }
            for entry in planned.entries
        ]
        layout = self._group_layouts.get(pipeline)
        if layout is None:
            layout = self._group_layouts[pipeline] = pipeline.get_bind_group_layout(0)
        try:
            return self.device.create_bind_group(layout=layout, entries=entries)
        except self.wgpu.GPUError as exc:
            launch = planned.launch
            self.check_alive(f"{launch.label}: binding buffers", probe=True)
            raise DeviceError(f"{launch.label}: binding buffers failed ({launch.describe()}): {exc}") from None

    def carry(self, source: Plan, target: Plan, storages: Sequence[Storage]) -> None:
        assert isinstance(source, WgpuPlan) and isinstance(target, WgpuPlan)
        self.check_alive("execute")
        encoder = self.device.create_command_encoder()
        for storage in storages:
            old, new = source.buffers[storage], target.buffers[storage]
            encoder.copy_buffer_to_buffer(old, 0, new, 0, min(old.size, new.size))
        self._submit(encoder)

    # execution --------------------------------------------------------------------------------

    def run(
        self,
        plan: Plan,
        writes: Sequence[tuple[Storage, np.ndarray]],
        readback: Sequence[Storage],
        scalars: Mapping[str, int | float],
        *,
        profile: Session | None = None,
    ) -> WgpuExecution:
        assert isinstance(plan, WgpuPlan)
        self.check_alive("execute")
        timer = GpuTimer(self, plan, profile, time.perf_counter()) if profile is not None else None
        for storage, data in writes:
            self._write(plan.buffers[storage], data)
        if plan.scalars:
            self.device.queue.write_buffer(plan.scalars_buffer, 0, uniform_bytes(plan.scalars, scalars))
        if timer:
            timer.uploaded()
        encoder = self.device.create_command_encoder()
        if plan.dispatches:
            compute = encoder.begin_compute_pass(**timer.pass_descriptor()) if timer else encoder.begin_compute_pass()
            if timer:
                compute = timer.wrap(compute)  # writes a timestamp before and after each dispatch
            if timer is None and self.direct is not None and plan.direct_calls is not None:
                self.direct.encode(compute, plan.direct_calls)
            else:  # the profiler times each dispatch through wgpu-py's pass object
                encode_plain(compute, plan.dispatches)
            compute.end()
        layout = plan.readback_layout(readback)
        if timer:
            layout = timer.extend_readback(encoder, layout)
        execution = self._encode_copies(encoder, layout)
        if timer:
            timer.encoded()
        try:
            self._submit(encoder)
        except DeviceError as exc:
            execution.abandon()
            culprit = self._failing_dispatch(plan)
            if culprit is None:
                raise
            raise DeviceError(f"execute: {culprit} failed GPU validation: {exc}") from None
        if timer:
            timer.submitted(execution)
        self.stats.dispatches += len(plan.dispatches)
        return execution

    def _encode_copies(self, encoder: Any, layout: ReadbackLayout) -> WgpuExecution:
        parts = []
        for start, size in staging_parts(layout, self.staging.limit):
            parts.append((self.staging.acquire(size), start, size))
        for _, buffer, offset, size in layout.copies:
            staging, start, _ = next(p for p in parts if p[1] <= offset < p[1] + p[2])
            encoder.copy_buffer_to_buffer(buffer, 0, staging, offset - start, size)
        return WgpuExecution(self.staging, parts, layout)

    def _submit(self, encoder: Any) -> None:
        try:
            self.device.queue.submit([encoder.finish()])
        except self.wgpu.GPUError as exc:
            self.check_alive("submit", probe=True)
            raise DeviceError(f"submit failed: {exc}") from None
        self.stats.submits += 1

    def _failing_dispatch(self, plan: WgpuPlan) -> str | None:
        """After a failed submit (error path only): encode each dispatch alone and finish it without
        submitting; the first one wgpu's validation rejects names the op."""
        for dispatch, label in zip(plan.dispatches, plan.labels):
            encoder = self.device.create_command_encoder()
            compute = encoder.begin_compute_pass()
            encode_plain(compute, [dispatch])
            compute.end()
            try:
                encoder.finish()
            except self.wgpu.GPUError:
                return f"{label}, dispatch {'x'.join(map(str, dispatch[2:]))}"
        return None

    # reading (the read path is DeviceExecutor's) -----------------------------------------------

    def submit_copies(self, layout: ReadbackLayout) -> WgpuExecution:
        encoder = self.device.create_command_encoder()
        execution = self._encode_copies(encoder, layout)
        self._submit(encoder)
        return execution

    def wait_staged(self, execution: StagedExecution) -> None:
        """Map every staging part for reading, blocking until the GPU has written them. On the executor's
        worker thread (no event loop there) for asyncio reads: wgpu's map promises are bound to no loop,
        so a loop that closes meanwhile is never called back."""
        for staging, _, size in execution.parts:
            promise = staging.map_async("READ_NOSYNC", 0, size)
            self._wait_settled(promise)
            promise.sync_wait()  # runs the promise's handler (the buffer is mapped) or raises its error

    def _wait_settled(self, promise: Any) -> None:
        """Block until a map ``promise`` settles, checking twice a second that the device still lives:
        wgpu-py's ``GPUDevice.destroy()`` stops the poll thread that settles pending maps (0.32 sets a
        ``_thread_event`` when one settles; without it, wait in ``sync_wait``)."""
        settled = getattr(promise, "_thread_event", None)
        if settled is None:
            return
        while not settled.wait(0.5):
            self.check_alive("read")

    def staged_bytes(self, staging: Any, size: int) -> Any:
        return staging.read_mapped(0, size, copy=False)

    def unstage(self, staging: Any) -> None:
        staging.unmap()
        self.staging.release(staging)

    def check_readable(self) -> None:
        self.check_alive("read")  # a map that resolved while the device was destroyed cannot be read

    def wait_failed(self, exc: Exception) -> Exception:
        self.check_alive("read", probe=True)
        return DeviceError(f"read: mapping the staging buffer failed: {exc}")


def _decrement_live(stats: Stats) -> None:
    stats.buffers_live -= 1
