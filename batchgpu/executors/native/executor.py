"""The executor protocol over :class:`~.driver.Driver`: :class:`NativeExecutor` runs everything the
vendors share; :class:`CudaExecutor` and :class:`HipExecutor` hold what differs (context, architecture,
compiler settings, DLPack device types).

``plan`` allocates every buffer and packs every launch's arguments once; ``run`` enqueues uploads,
every launch (or, from a plan's second run on, its captured graph) and the readback copies on one
stream with no host sync, and records an event; reads wait on that event (asyncio reads on the
executor's worker thread: :class:`~batchgpu.executors.base.DeviceExecutor`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ... import cuda_source
from ...dtypes import SUPPORTED
from ...errors import DeviceError, DeviceMismatchError, UnsupportedError
from ...interop import KDL_CUDA, KDL_CUDA_MANAGED, KDL_ROCM, ForeignArray, device_name
from ...kernels import Launch
from ...nvrtc import compiler
from ...ops import Node
from ...scalars import SCALAR_BYTES, Scalar, uniform_bytes
from ...tensor import Storage
from ..base import POISON_BYTE, DeviceExecutor, Plan, ReadbackLayout, StagedExecution, Stats
from ..blocking import BlockingWorker
from ..native_timing import EventTimer
from .attributes import DeviceAttributes, check_native_launch
from .driver import (
    CAPTURE_MODE_THREAD_LOCAL,
    POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    STREAM_NON_BLOCKING,
    Driver,
)
from .memory import Allocator, DeviceBuffer, Event, HostBuffer
from .programs import Function, Programs, nvrtc_target

if TYPE_CHECKING:
    from ...profiling import Session

ENV_GRAPHS = "BATCHGPU_GRAPHS"


class PackedLaunch:
    """One launch with its argument array built once: ``kernelParams[i]`` points at argument ``i``;
    ``call`` is the whole argument tuple of the launch function for ``stream``."""

    __slots__ = ("label", "function", "grid", "block", "shared", "slots", "params", "call", "module")

    def __init__(
        self, label: str, function: Function, grid: tuple, block: tuple, shared: int, slots: list, stream: int
    ) -> None:
        self.label = label
        self.function = function.handle
        self.module = function.module  # keeps the function loaded
        self.grid = grid
        self.block = block
        self.shared = shared
        self.slots = slots  # the ctypes objects the array points into, kept alive here
        self.params = (ctypes.c_void_p * max(len(slots), 1))(*(ctypes.addressof(s) for s in slots))
        pointers = ctypes.cast(self.params, ctypes.POINTER(ctypes.c_void_p))
        self.call = (self.function, *grid, *block, shared, stream, pointers, None)


class GraphExec:
    """An instantiated graph of a plan's launches (captured from the stream), destroyed when dropped."""

    __slots__ = ("driver", "handle")

    def __init__(self, driver: Driver, handle: int) -> None:
        self.driver = driver
        self.handle = handle

    def launch(self, stream: int) -> None:
        self.driver.check(self.driver.graph_launch(self.handle, stream), "graph launch")

    def __del__(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            with contextlib.suppress(Exception):  # the interpreter shutting down
                self.driver.graph_exec_destroy(handle)


class NativePlan(Plan):
    readback_align = 256  # pinned staging offsets kept DMA-friendly

    def __init__(
        self,
        buffers: dict[Storage, DeviceBuffer],
        launches: list[PackedLaunch],
        scalars_buffer: DeviceBuffer,
        scalars: tuple[Scalar, ...],
    ) -> None:
        self.buffers = buffers
        self.launches = launches
        self.scalars_buffer = scalars_buffer
        self.scalars = scalars
        self.upload: HostBuffer | None = None
        self.upload_event: Event | None = None  # the previous execute's uploads out of ``upload``
        self.runs = 0
        self.graph_exec: GraphExec | None = None


class NativeExecution(StagedExecution):
    """One execute's readback: at most one pinned staging buffer (``parts``) and the event recorded
    after its copies."""

    def __init__(
        self, allocator: Allocator, parts: list[tuple[Any, int, int]], layout: ReadbackLayout, event: Event
    ) -> None:
        super().__init__(layout, parts)
        self.allocator = allocator
        self.event: Event | None = event

    def abandon(self) -> None:
        if self.results is not None or self.event is None:
            return
        if self.waiting is not None and not self.waiting.done():
            return  # the worker still waits on the event: leave it and the buffer to the garbage collector
        if self.parts:
            staging = self.parts[0][0]
            staging.event = self.event  # the buffer owns the event now: reusable once it is done
            self.allocator.release(staging)
            self.parts = []
        else:
            self.event.close()
        self.event = None

    def close(self) -> None:
        if self.event is not None:
            self.event.close()
            self.event = None


class NativeExecutor(DeviceExecutor):
    """The executor protocol over :class:`~.driver.Driver`; subclasses name the vendor (``kind``)."""

    concurrent = True

    dlpack_type: ClassVar[int]  # DLPack device type of this executor's memory
    importable: ClassVar[tuple[int, ...]]  # DLPack device types copied directly (device to device)

    def __init__(self, *, device: int = 0, poison: bool = False, driver: Driver | None = None) -> None:
        super().__init__()
        vendor = self.kind
        self.driver = drv = driver or Driver(vendor)
        if drv.missing:
            raise UnsupportedError(f"{vendor}: driver library lacks {', '.join(drv.missing)}")
        drv.check(drv.init(0), "init (the driver library loaded; is a GPU visible to this process?)")
        count = ctypes.c_int()
        drv.check(drv.device_count(ctypes.byref(count)), "device count")
        if not 0 <= device < count.value:
            raise DeviceError(f"{vendor}: device {device} out of range ({count.value} devices)")
        handle = ctypes.c_int()
        drv.check(drv.device_get(ctypes.byref(handle), device), f"device {device}")
        self.device = handle.value
        self.ordinal = device
        self.make_current()
        name = ctypes.create_string_buffer(256)
        drv.check(drv.device_name(name, 256, self.device), "device name")
        total = ctypes.c_size_t()
        drv.check(drv.device_total_mem(ctypes.byref(total), self.device), "device memory")
        self.attrs = DeviceAttributes.query(drv, self.device, name.value.decode(), self.arch(), total.value)
        self.name = f"{self.attrs.name} ({self.attrs.arch})"
        self.limits = self.attrs.limits()
        self.features = frozenset({"shader-f16"})
        self.stats = Stats()
        self.poison = poison
        self.graphs = os.environ.get(ENV_GRAPHS, "1") != "0"
        self.waits = BlockingWorker(f"batchgpu-{vendor}-readback")  # event waits of async reads
        stream = ctypes.c_void_p()
        drv.check(drv.stream_create(ctypes.byref(stream), STREAM_NON_BLOCKING), "stream create")
        self.stream = int(stream.value or 0)
        self.allocator = Allocator(drv, self.stats, self.make_current)
        self.staging = self.allocator.pinned
        self.programs = Programs(drv, self.attrs, self.stats, *self.compiler_settings())

    # what differs between vendors ------------------------------------------------------------------

    def make_current(self) -> None:
        """Bind this device to the calling thread."""
        raise NotImplementedError

    def arch(self) -> str:
        """The device's architecture name, as the runtime compiler takes it."""
        raise NotImplementedError

    def compiler_settings(self) -> tuple[Any, str, str, list[str]]:
        """The runtime compiler, the architecture and target it compiles for, and its options."""
        raise NotImplementedError

    def check_foreign_device(self, foreign: ForeignArray) -> None:
        """Raise DeviceMismatchError when ``foreign`` (device memory to import) lives on another device."""

    # --------------------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "arch": self.attrs.arch, "graphs": self.graphs}

    def supports(self, dtype: np.dtype) -> bool:
        return dtype in SUPPORTED

    # memory -------------------------------------------------------------------------------------

    def allocate(self, storage: Storage) -> DeviceBuffer:
        return self.allocator.alloc(storage.nbytes)

    def poison_fill(self, buffer: DeviceBuffer) -> None:
        drv = self.driver
        drv.check(drv.memset_d8_async(buffer.pointer, POISON_BYTE, buffer.nbytes, self.stream), "poison fill")

    def _upload(self, buffer: DeviceBuffer, data: np.ndarray) -> None:
        """Copy ``data`` into ``buffer`` and wait until it is there."""
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.driver.check(
            self.driver.memcpy_htod_async(buffer.pointer, raw.ctypes.data, raw.nbytes, self.stream), "upload"
        )
        self.driver.check(self.driver.stream_synchronize(self.stream), "upload sync")
        self.stats.bytes_uploaded += raw.nbytes

    def alloc_resident(self, storage: Storage, data: np.ndarray) -> None:
        buffer = self.allocator.alloc(storage.nbytes)
        self.keep_resident(storage, buffer)
        self._upload(buffer, data)

    def write_resident(self, storage: Storage, data: np.ndarray) -> None:
        self._upload(self.resident_buffer(storage), data)

    def read_resident(self, storage: Storage) -> np.ndarray:
        out = np.empty(storage.nbytes, np.uint8)
        buffer = self.resident_buffer(storage)
        self.driver.check(
            self.driver.memcpy_dtoh_async(out.ctypes.data, buffer.pointer, storage.nbytes, self.stream), "read"
        )
        self.driver.check(self.driver.stream_synchronize(self.stream), "read sync")
        self.stats.bytes_read += storage.nbytes
        return out.view(storage.dtype)

    # interop (batchgpu.interop) -------------------------------------------------------------------

    def dlpack_device(self) -> tuple[int, int]:
        return (self.dlpack_type, self.ordinal)

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]:
        """The resident buffer (the owner keeps it allocated), after our stream has drained: the
        consumer may read it on any stream. ``copy``: a new buffer, copied device to device."""
        self.make_current()
        buffer = self.resident_buffer(storage)
        if copy:
            source, buffer = buffer, self.allocator.alloc(storage.nbytes)
            self.driver.check(
                self.driver.memcpy_dtod_async(buffer.pointer, source.pointer, storage.nbytes, self.stream),
                "export copy",
            )
        self.driver.check(self.driver.stream_synchronize(self.stream), "export sync")
        return buffer.pointer, buffer

    def import_stream(self, device_type: int, device_id: int | None) -> int | None:
        if device_type not in self.importable:
            names = " or ".join(device_name(t) for t in self.importable)
            raise DeviceMismatchError(f"Device({self.kind!r}) copies directly only from {names} memory")
        if device_id is not None and device_id != self.ordinal:
            raise DeviceMismatchError(
                f"this Device({self.kind!r}) is device {self.ordinal}, the array is on {device_id}"
            )
        return self.stream

    def alloc_resident_from_device(self, storage: Storage, foreign: ForeignArray) -> None:
        """Device-to-device copy on our stream. A DLPack producer ordered its work before our stream
        (we passed it to ``__dlpack__``); a ``__cuda_array_interface__`` stream is synchronized first."""
        drv = self.driver
        self.make_current()
        self.check_foreign_device(foreign)
        if foreign.stream is not None:
            drv.check(drv.stream_synchronize(foreign.stream), "waiting for the producer's stream")
        buffer = self.allocator.alloc(storage.nbytes)
        drv.check(drv.memcpy_dtod_async(buffer.pointer, foreign.pointer, foreign.nbytes, self.stream), "import copy")
        drv.check(drv.stream_synchronize(self.stream), "import sync")
        self.keep_resident(storage, buffer)

    # planning -----------------------------------------------------------------------------------

    def form(self, launch: Launch) -> Launch:
        return launch.for_native()

    def prepare(self, launch: Launch) -> None:
        launch = self.form(launch)
        check_native_launch(launch, self.attrs)
        self.programs.function(launch)

    def plan(
        self,
        nodes: Sequence[Node],
        storages: Sequence[Storage],
        scalars: Sequence[Scalar],
        *,
        aliases: Mapping[Storage, Storage] | None = None,
    ) -> NativePlan:
        drv = self.driver
        buffers, launches = self.plan_buffers(nodes, storages, aliases)
        scalars_buffer = self.allocator.alloc(SCALAR_BYTES)
        drv.check(drv.memset_d8_async(scalars_buffer.pointer, 0, SCALAR_BYTES, self.stream), "scalar buffer fill")
        packed = [self._pack(launch, buffers, scalars_buffer) for launch in launches]
        return NativePlan(buffers, packed, scalars_buffer, tuple(scalars))

    def carry(self, source: Plan, target: Plan, storages: Sequence[Storage]) -> None:
        assert isinstance(source, NativePlan) and isinstance(target, NativePlan)
        self.make_current()
        for storage in storages:
            old, new = source.buffers[storage], target.buffers[storage]
            size = min(old.nbytes, new.nbytes)
            self.driver.check(self.driver.memcpy_dtod_async(new.pointer, old.pointer, size, self.stream), "carry")

    def _pack(self, launch: Launch, buffers: dict[Storage, DeviceBuffer], scalars_buffer: DeviceBuffer) -> PackedLaunch:
        grid, dynamic = check_native_launch(launch, self.attrs)
        function = self.programs.function(launch)
        self.programs.allow_dynamic_shared(function.handle, dynamic)
        slots: list[Any] = [ctypes.c_void_p(0) for _ in range(cuda_source.argument_count(launch))]
        for binding in launch.bindings:
            if binding.kind == "uniform":
                # the Params struct, passed by value: the argument points at its bytes
                slots[binding.slot] = (ctypes.c_char * max(len(launch.params), 4)).from_buffer_copy(
                    launch.params.ljust(4, b"\0")
                )
            elif binding.kind == "scalars":
                slots[binding.slot] = ctypes.c_void_p(scalars_buffer.pointer)
            else:
                slots[binding.slot] = ctypes.c_void_p(buffers[binding.storage].pointer)  # type: ignore[index]
        return PackedLaunch(launch.label, function, grid, launch.workgroup_size, dynamic, slots, self.stream)

    # execution ----------------------------------------------------------------------------------

    def _uploads(self, plan: NativePlan, writes: Sequence[tuple[Storage, np.ndarray]], scalar_bytes: bytes) -> None:
        """Copy writes and scalars into the plan's pinned upload buffer, then enqueue async H2D copies.
        The host waits only for the previous execute's uploads out of that buffer (not its kernels)."""
        drv = self.driver
        total = sum(-(-data.nbytes // 256) * 256 for _, data in writes) + len(scalar_bytes)
        if total == 0:
            return
        if plan.upload_event is not None:
            plan.upload_event.synchronize("waiting for the previous uploads")
        if plan.upload is None or plan.upload.nbytes < total:
            plan.upload = self.allocator.host(total)
        staging, offset = plan.upload, 0
        for storage, data in writes:
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            staging.array[offset : offset + raw.nbytes] = raw
            target = plan.buffers[storage].pointer
            drv.check(drv.memcpy_htod_async(target, staging.pointer + offset, raw.nbytes, self.stream), "upload")
            offset += -(-raw.nbytes // 256) * 256
            self.stats.bytes_uploaded += raw.nbytes
        if scalar_bytes:
            staging.array[offset : offset + len(scalar_bytes)] = np.frombuffer(scalar_bytes, np.uint8)
            target = plan.scalars_buffer.pointer
            drv.check(
                drv.memcpy_htod_async(target, staging.pointer + offset, len(scalar_bytes), self.stream), "scalar upload"
            )
        if plan.upload_event is None:
            plan.upload_event = Event(drv)
        plan.upload_event.record(self.stream)

    def _launch_all(self, plan: NativePlan) -> None:
        launch_kernel = self.driver.launch_kernel
        for packed in plan.launches:
            status = launch_kernel(*packed.call)
            if status:
                self._launch_failed(packed, status)

    def launch(self, packed: PackedLaunch) -> None:
        """Enqueue one packed launch on the executor's stream (profiled executes launch one by one)."""
        status = self.driver.launch_kernel(*packed.call)
        if status:
            self._launch_failed(packed, status)

    def _launch_failed(self, packed: PackedLaunch, status: int) -> None:
        self.driver.check(status, f"{packed.label}: launch (grid {packed.grid}, block {packed.block})")

    def _capture(self, plan: NativePlan) -> GraphExec:
        """Record the plan's launches into a graph once; returns the instantiated graph."""
        drv = self.driver
        drv.check(drv.stream_begin_capture(self.stream, CAPTURE_MODE_THREAD_LOCAL), "begin graph capture")
        graph = ctypes.c_void_p()
        try:
            self._launch_all(plan)
        finally:
            drv.check(drv.stream_end_capture(self.stream, ctypes.byref(graph)), "end graph capture")
        executable = ctypes.c_void_p()
        try:
            drv.check(drv.graph_instantiate(ctypes.byref(executable), graph, 0), "graph instantiate")
        finally:
            drv.graph_destroy(graph)
        return GraphExec(drv, int(executable.value or 0))

    def run(
        self,
        plan: Plan,
        writes: Sequence[tuple[Storage, np.ndarray]],
        readback: Sequence[Storage],
        scalars: Mapping[str, int | float],
        *,
        profile: Session | None = None,
    ) -> NativeExecution:
        """Enqueue uploads, the launches (the captured graph from the second run on) and the readback.
        Profiled: eager launches with timing events around each (:mod:`..native_timing`)."""
        assert isinstance(plan, NativePlan)
        started = time.perf_counter()
        self.make_current()
        timer = EventTimer(self, plan, profile, started) if profile is not None else None
        self._uploads(plan, writes, uniform_bytes(plan.scalars, scalars) if plan.scalars else b"")
        if timer is not None:
            timer.uploaded()
            if plan.launches:
                timer.launch_all(plan)
        elif plan.launches:
            if self.graphs and plan.runs >= 1 and plan.graph_exec is None:
                plan.graph_exec = self._capture(plan)
            if plan.graph_exec is not None:
                plan.graph_exec.launch(self.stream)
            else:
                self._launch_all(plan)
        plan.runs += 1
        self.stats.dispatches += len(plan.launches)
        self.stats.submits += 1
        execution = self.submit_copies(plan.readback_layout(readback))
        if timer is not None:
            timer.submitted(execution)
        return execution

    # reading (the read path is DeviceExecutor's) ----------------------------------------------------

    def submit_copies(self, layout: ReadbackLayout) -> NativeExecution:
        drv = self.driver
        parts: list[tuple[Any, int, int]] = []
        if layout.total:
            staging = self.allocator.host(layout.total)
            parts.append((staging, 0, layout.total))
            for _, buffer, offset, size in layout.copies:
                target = staging.pointer + offset
                drv.check(drv.memcpy_dtoh_async(target, buffer.pointer, size, self.stream), "readback")
        event = Event(drv)
        event.record(self.stream)
        return NativeExecution(self.allocator, parts, layout, event)

    def wait_staged(self, execution: StagedExecution) -> None:
        assert isinstance(execution, NativeExecution)
        if execution.event is None:
            raise DeviceError(f"{self.kind}: read of an execute nothing holds any more (every read holds its own)")
        self.make_current()
        execution.event.synchronize("waiting for the execute")

    def staged_bytes(self, staging: HostBuffer, size: int) -> Any:
        return staging.array

    def unstage(self, staging: HostBuffer) -> None:
        self.allocator.release(staging)


class CudaExecutor(NativeExecutor):
    """NVIDIA GPUs through the CUDA driver API (``libcuda.so.1``), kernels compiled by NVRTC."""

    kind = "cuda"
    dlpack_type = KDL_CUDA
    importable = (KDL_CUDA, KDL_CUDA_MANAGED)

    def __init__(self, *, device: int = 0, poison: bool = False, driver: Driver | None = None) -> None:
        self._context = ctypes.c_void_p()  # the device's primary context, retained once
        super().__init__(device=device, poison=poison, driver=driver)

    def make_current(self) -> None:
        """Bind this device's primary context to the calling thread."""
        drv = self.driver
        if not self._context.value:
            drv.check(drv.primary_ctx_retain(ctypes.byref(self._context), self.device), "primary context")
        drv.check(drv.ctx_set_current(self._context), "set current context")

    def arch(self) -> str:
        major = self.driver.attribute("compute_capability_major", self.device)
        minor = self.driver.attribute("compute_capability_minor", self.device)
        return f"sm_{major}{minor}"

    def compiler_settings(self) -> tuple[Any, str, str, list[str]]:
        nvrtc = compiler("cuda")
        arch, target = nvrtc_target(nvrtc, self.attrs.arch)
        return nvrtc, arch, target, ["-default-device"]

    def check_foreign_device(self, foreign: ForeignArray) -> None:
        """``__cuda_array_interface__`` names no device: ask the driver where the pointer lives."""
        if foreign.device_id is not None:
            return
        drv = self.driver
        ordinal = ctypes.c_int(-1)
        drv.check(
            drv.pointer_get_attribute(ctypes.byref(ordinal), POINTER_ATTRIBUTE_DEVICE_ORDINAL, foreign.pointer),
            "querying the array's device",
        )
        if ordinal.value != self.ordinal:
            raise DeviceMismatchError(
                f"Device.tensor: the array is on CUDA device {ordinal.value}, this Device('cuda') is "
                f"device {self.ordinal}"
            )


class HipExecutor(NativeExecutor):
    """AMD GPUs through HIP's module API (``libamdhip64.so``), kernels compiled by hipRTC."""

    kind = "hip"
    dlpack_type = KDL_ROCM
    importable = (KDL_ROCM,)

    def make_current(self) -> None:
        self.driver.check(self.driver.set_device(self.device), "set device")

    def arch(self) -> str:
        """The gcnArchName (``gfx90a:sramecc+:xnack-``): hipDeviceProp_t's layout changes across ROCm
        versions, and this is its one "gfx..." string."""
        props = ctypes.create_string_buffer(16384)
        self.driver.check(self.driver.device_properties(props, self.device), "device properties")
        match = re.search(rb"gfx[0-9a-f]+(?::[a-z0-9]+[+-])*", props.raw)
        if not match:
            raise DeviceError("hip: gcnArchName not found in the device properties")
        return match.group().decode()

    def compiler_settings(self) -> tuple[Any, str, str, list[str]]:
        return compiler("hip"), self.attrs.arch, "", []


EXECUTORS: dict[str, type[NativeExecutor]] = {"cuda": CudaExecutor, "hip": HipExecutor}
