"""Native CUDA and HIP executors: the vendors' driver APIs through one small ctypes table.

``Device("cuda")`` binds ``libcuda.so.1`` (the CUDA driver API), ``Device("hip")`` binds
``libamdhip64.so`` (HIP's module API); both run the same code below: device attributes, a primary
context, device memory, async copies on one stream, modules from NVRTC/hipRTC loaded once, kernel
launches with argument arrays packed once per recorded launch, events, and graph replay.

Parts:

- :class:`Driver`: the function table for one vendor, and ``check()`` for every status it returns.
- :class:`DeviceAttributes`: queried limits, turned into :class:`~batchgpu.limits.Limits` and checked
  by :func:`check_native_launch` before any launch is planned.
- :class:`Allocator`: device buffers and pinned host buffers (staging), freed when unreferenced.
- :class:`Programs`: compiled modules (disk cache in :mod:`batchgpu.nvrtc`) and the function cache.
- :class:`NativeExecutor`: the executor protocol. ``plan`` allocates every buffer and packs every
  launch's arguments once; ``run`` enqueues uploads, every launch (or the captured graph) and the
  readback copies on one stream with no host sync, and records an event; ``read`` waits on that
  event in a worker thread.

Nothing here has run on a GPU yet (see README, "Native CUDA and HIP").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import math
import os
import re
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import cuda_source
from ..dtypes import SUPPORTED
from ..errors import DeviceError, DeviceMismatchError, LimitError, UnsupportedError
from ..interop import KDL_CUDA, KDL_CUDA_MANAGED, KDL_ROCM, ForeignArray, device_name
from ..kernels import Launch
from ..limits import Limits
from ..ops import Node
from ..scalars import SCALAR_BYTES, Scalar
from ..scalars import pack as pack_scalars
from ..tensor import Storage
from .base import Execution, Executor, Plan, ReadbackLayout, Stats, alias_buffers
from .blocking import BlockingWorker, wait_future
from .native_timing import EventTimer

if TYPE_CHECKING:
    from ..profiling import Session

ENV_GRAPHS = "BATCHGPU_GRAPHS"
POISON_BYTE = 0x7F

# ctypes shorthands
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_I = ctypes.c_int
_U = ctypes.c_uint
_SZ = ctypes.c_size_t
_PI = ctypes.POINTER(ctypes.c_int)

# generic name: (CUDA driver symbol, HIP symbol, argtypes). Signatures from the CUDA driver API and
# HIP runtime API references; both return an int status (CUresult / hipError_t, 0 = success).
FUNCTIONS: dict[str, tuple[str, str, list]] = {
    "init": ("cuInit", "hipInit", [_U]),
    "driver_version": ("cuDriverGetVersion", "hipDriverGetVersion", [_PI]),
    "device_count": ("cuDeviceGetCount", "hipGetDeviceCount", [_PI]),
    "device_get": ("cuDeviceGet", "hipDeviceGet", [_PI, _I]),
    "device_name": ("cuDeviceGetName", "hipDeviceGetName", [ctypes.c_char_p, _I, _I]),
    "device_attribute": ("cuDeviceGetAttribute", "hipDeviceGetAttribute", [_PI, _I, _I]),
    "device_total_mem": ("cuDeviceTotalMem_v2", "hipDeviceTotalMem", [ctypes.POINTER(_SZ), _I]),
    "mem_alloc": ("cuMemAlloc_v2", "hipMalloc", [_PP, _SZ]),
    "mem_free": ("cuMemFree_v2", "hipFree", [_P]),
    "host_free": ("cuMemFreeHost", "hipHostFree", [_P]),
    "memcpy_htod_async": ("cuMemcpyHtoDAsync_v2", "hipMemcpyHtoDAsync", [_P, _P, _SZ, _P]),
    "memcpy_dtoh_async": ("cuMemcpyDtoHAsync_v2", "hipMemcpyDtoHAsync", [_P, _P, _SZ, _P]),
    "memcpy_dtod_async": ("cuMemcpyDtoDAsync_v2", "hipMemcpyDtoDAsync", [_P, _P, _SZ, _P]),
    "memset_d8_async": ("cuMemsetD8Async", "hipMemsetD8Async", [_P, ctypes.c_ubyte, _SZ, _P]),
    "stream_create": ("cuStreamCreate", "hipStreamCreateWithFlags", [_PP, _U]),
    "stream_synchronize": ("cuStreamSynchronize", "hipStreamSynchronize", [_P]),
    "module_load_data": ("cuModuleLoadData", "hipModuleLoadData", [_PP, ctypes.c_char_p]),
    "module_get_function": ("cuModuleGetFunction", "hipModuleGetFunction", [_PP, _P, ctypes.c_char_p]),
    "launch_kernel": ("cuLaunchKernel", "hipModuleLaunchKernel", [_P, _U, _U, _U, _U, _U, _U, _U, _P, _PP, _PP]),
    "event_create": ("cuEventCreate", "hipEventCreateWithFlags", [_PP, _U]),
    "event_record": ("cuEventRecord", "hipEventRecord", [_P, _P]),
    "event_synchronize": ("cuEventSynchronize", "hipEventSynchronize", [_P]),
    "event_query": ("cuEventQuery", "hipEventQuery", [_P]),
    "event_destroy": ("cuEventDestroy_v2", "hipEventDestroy", [_P]),
    "stream_begin_capture": ("cuStreamBeginCapture_v2", "hipStreamBeginCapture", [_P, _I]),
    "stream_end_capture": ("cuStreamEndCapture", "hipStreamEndCapture", [_P, _PP]),
    "graph_instantiate": ("cuGraphInstantiateWithFlags", "hipGraphInstantiateWithFlags", [_PP, _P, ctypes.c_ulonglong]),
    "graph_launch": ("cuGraphLaunch", "hipGraphLaunch", [_P, _P]),
    "graph_destroy": ("cuGraphDestroy", "hipGraphDestroy", [_P]),
    "graph_exec_destroy": ("cuGraphExecDestroy", "hipGraphExecDestroy", [_P]),
    "event_elapsed_time": ("cuEventElapsedTime", "hipEventElapsedTime", [ctypes.POINTER(ctypes.c_float), _P, _P]),
}

# Vendor-only entry points: (symbol, argtypes, restype or None for int status).
CUDA_ONLY: dict[str, tuple[str, list, Any]] = {
    "primary_ctx_retain": ("cuDevicePrimaryCtxRetain", [_PP, _I], None),
    "ctx_set_current": ("cuCtxSetCurrent", [_P], None),
    "mem_alloc_host": ("cuMemAllocHost_v2", [_PP, _SZ], None),
    "func_set_attribute": ("cuFuncSetAttribute", [_P, _I, _I], None),
    "get_error_string": ("cuGetErrorString", [_I, ctypes.POINTER(ctypes.c_char_p)], None),
    "get_error_name": ("cuGetErrorName", [_I, ctypes.POINTER(ctypes.c_char_p)], None),
    "pointer_get_attribute": ("cuPointerGetAttribute", [_P, _I, _P], None),
}
HIP_ONLY: dict[str, tuple[str, list, Any]] = {
    "set_device": ("hipSetDevice", [_I], None),
    "host_malloc": ("hipHostMalloc", [_PP, _SZ, _U], None),
    "get_error_string": ("hipGetErrorString", [_I], ctypes.c_char_p),
    "get_error_name": ("hipGetErrorName", [_I], ctypes.c_char_p),
    "device_properties": ("hipGetDevicePropertiesR0600", [ctypes.c_char_p, _I], None),
}

# Device attribute enums: CUdevice_attribute (cuda.h) and hipDeviceAttribute_t (hip_runtime_api.h, ROCm 6).
ATTRIBUTES: dict[str, tuple[int, int]] = {
    "max_threads_per_block": (1, 56),
    "max_block_dim_x": (2, 26),
    "max_block_dim_y": (3, 27),
    "max_block_dim_z": (4, 28),
    "max_grid_dim_x": (5, 29),
    "max_grid_dim_y": (6, 30),
    "max_grid_dim_z": (7, 31),
    "max_shared_memory_per_block": (8, 74),
    "warp_size": (10, 87),
    "multiprocessor_count": (16, 63),
    "compute_capability_major": (75, 23),
    "compute_capability_minor": (76, 61),
    "max_shared_memory_per_block_optin": (97, 75),
}
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_* / hipFuncAttribute*: same value
STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING / hipStreamNonBlocking
EVENT_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING / hipEventDisableTiming
CAPTURE_MODE_THREAD_LOCAL = 1  # CU_STREAM_CAPTURE_MODE_THREAD_LOCAL / hipStreamCaptureModeThreadLocal
NOT_READY = 600  # CUDA_ERROR_NOT_READY / hipErrorNotReady
POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9  # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
IMPORTABLE = {"cuda": (KDL_CUDA, KDL_CUDA_MANAGED), "hip": (KDL_ROCM,)}  # DLPack device types copied directly

LIBRARIES = {
    "cuda": ("libcuda.so.1", "libcuda.so"),
    "hip": (
        "libamdhip64.so",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
        os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "lib/libamdhip64.so"),
    ),
}
MISSING = {
    "cuda": "libcuda.so.1 not found: no NVIDIA driver on this machine",
    "hip": "libamdhip64.so not found: no ROCm/HIP runtime on this machine",
}


def load_library(vendor: str) -> ctypes.CDLL:
    """The vendor's driver library, or UnsupportedError naming what is missing."""
    errors = []
    for name in LIBRARIES[vendor]:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise UnsupportedError(f"{MISSING[vendor]} ({'; '.join(errors)})")


class Driver:
    """One vendor's driver API as ctypes functions named generically (``drv.mem_alloc``...); every
    status goes through :meth:`check`."""

    def __init__(self, vendor: str) -> None:
        if vendor not in LIBRARIES:
            raise UnsupportedError(f"native executor: unknown vendor {vendor!r} (expected 'cuda' or 'hip')")
        self.vendor = vendor
        self.lib = load_library(vendor)
        column = 0 if vendor == "cuda" else 1
        self.missing: list[str] = []
        # CUDA only: HIP's hipFuncSetAttribute takes a host kernel pointer, not a module function, and
        # AMD devices have no opt-in shared memory beyond the per-block limit.
        self.func_set_attribute: Any = None
        for generic, (*symbols, argtypes) in FUNCTIONS.items():
            self._bind(generic, symbols[column], argtypes, None)
        for generic, (symbol, argtypes, restype) in (CUDA_ONLY if vendor == "cuda" else HIP_ONLY).items():
            self._bind(generic, symbol, argtypes, restype)

    def _bind(self, generic: str, symbol: str, argtypes: list, restype: Any) -> None:
        try:
            function = getattr(self.lib, symbol)
        except AttributeError:
            if generic == "device_properties":  # ROCm 5 names it without the R0600 suffix
                return self._bind(generic, "hipGetDeviceProperties", argtypes, restype)
            self.missing.append(symbol)
            function = None
        else:
            function.argtypes = argtypes
            function.restype = restype if restype is not None else ctypes.c_int
        setattr(self, generic, function)

    def error_string(self, status: int) -> str:
        if self.vendor == "hip":
            name, text = self.lib.hipGetErrorName(status), self.lib.hipGetErrorString(status)
            return f"{(name or b'?').decode()}: {(text or b'unknown error').decode()}"
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.get_error_name(status, ctypes.byref(name))
        self.get_error_string(status, ctypes.byref(text))
        return f"{(name.value or b'?').decode()}: {(text.value or b'unknown error').decode()}"

    def check(self, status: int, what: str) -> None:
        """Raise DeviceError naming the call and the driver's error string for a non-zero status."""
        if status != 0:
            raise DeviceError(f"{self.vendor}: {what} failed: {self.error_string(status)} (status {status})")

    def attribute(self, name: str, device: int) -> int:
        value = ctypes.c_int()
        enum = ATTRIBUTES[name][0 if self.vendor == "cuda" else 1]
        self.check(self.device_attribute(ctypes.byref(value), enum, device), f"device attribute {name}")
        return value.value

    def alloc_host(self, nbytes: int) -> int:
        """Page-locked host memory (for async copies)."""
        pointer = ctypes.c_void_p()
        if self.vendor == "cuda":
            self.check(self.mem_alloc_host(ctypes.byref(pointer), nbytes), f"cuMemAllocHost({nbytes})")
        else:
            self.check(self.host_malloc(ctypes.byref(pointer), nbytes, 0), f"hipHostMalloc({nbytes})")
        return int(pointer.value or 0)


# device attributes and launch validation -----------------------------------------------------


@dataclass(frozen=True)
class DeviceAttributes:
    """The queried numbers launches are checked against."""

    name: str
    arch: str  # "sm_90" for CUDA, the gcnArchName ("gfx90a:sramecc+:xnack-") for HIP
    max_threads_per_block: int
    max_block_dim: tuple[int, int, int]
    max_grid_dim: tuple[int, int, int]
    max_shared_memory_per_block: int
    max_shared_memory_per_block_optin: int
    warp_size: int = 32
    multiprocessor_count: int = 0
    total_memory: int = 0

    @classmethod
    def query(cls, driver: Driver, device: int, name: str, arch: str, total_memory: int) -> DeviceAttributes:
        get = driver.attribute
        shared = get("max_shared_memory_per_block", device)
        try:
            optin = get("max_shared_memory_per_block_optin", device)
        except DeviceError:
            optin = shared
        return cls(
            name=name,
            arch=arch,
            max_threads_per_block=get("max_threads_per_block", device),
            max_block_dim=tuple(get(f"max_block_dim_{a}", device) for a in "xyz"),  # type: ignore[arg-type]
            max_grid_dim=tuple(get(f"max_grid_dim_{a}", device) for a in "xyz"),  # type: ignore[arg-type]
            max_shared_memory_per_block=shared,
            max_shared_memory_per_block_optin=max(optin, shared),
            warp_size=get("warp_size", device),
            multiprocessor_count=get("multiprocessor_count", device),
            total_memory=total_memory,
        )

    def limits(self) -> Limits:
        """The WebGPU-named limits batch recording checks. Kernels index elements with 32-bit
        unsigned ints, so a buffer stays below 4 GiB; 1-D group counts split over grid x and y."""
        buffer = min(self.total_memory or 2**32 - 4, 2**32 - 4)
        return Limits(
            max_storage_buffer_binding_size=buffer,
            max_buffer_size=buffer,
            max_compute_workgroups_per_dimension=min(self.max_grid_dim),
            max_compute_invocations_per_workgroup=self.max_threads_per_block,
            max_compute_workgroup_size_x=self.max_block_dim[0],
            max_compute_workgroup_size_y=self.max_block_dim[1],
            max_compute_workgroup_size_z=self.max_block_dim[2],
            max_compute_workgroup_storage_size=self.max_shared_memory_per_block_optin,
            max_storage_buffers_per_shader_stage=256,
            max_uniform_buffer_binding_size=PARAM_BYTES,
        )


PARAM_BYTES = 4096 - 8 * 16
"""Bytes a launch's by-value params struct may take: CUDA's 4 KiB kernel parameter space, less room
for the pointer arguments."""


def launch_grid(launch: Launch, attrs: DeviceAttributes) -> tuple[int, int, int]:
    """Grid of ``launch``: an explicit 3-tuple, or a 1-D count split over x and y (kernels recover
    the linear block index as ``blockIdx.x + blockIdx.y * gridDim.x``)."""
    if not isinstance(launch.groups, int):
        return launch.groups
    per_x = attrs.max_grid_dim[0]
    if launch.groups <= per_x:
        return (max(launch.groups, 1), 1, 1)
    y = math.ceil(launch.groups / per_x)
    return (math.ceil(launch.groups / y), y, 1)


def check_native_launch(launch: Launch, attrs: DeviceAttributes) -> tuple[tuple[int, int, int], int]:
    """Validate ``launch`` against ``attrs``; returns (grid, dynamic shared bytes).

    Raises LimitError naming the op, the limit, the requested and the allowed value.
    """

    def fail(limit: str, actual: int, allowed: int) -> None:
        raise LimitError(
            f"{launch.label}: {limit} exceeded: {actual} > {allowed} on {attrs.name} ({launch.describe()})"
        )

    block = launch.workgroup_size
    threads = math.prod(block)
    if threads > attrs.max_threads_per_block:
        fail("max threads per block", threads, attrs.max_threads_per_block)
    for axis, size, allowed in zip("xyz", block, attrs.max_block_dim):
        if size > allowed:
            fail(f"max block dim {axis}", size, allowed)
    grid = launch_grid(launch, attrs)
    for axis, count, allowed in zip("xyz", grid, attrs.max_grid_dim):
        if count > allowed:
            fail(f"max grid dim {axis}", count, allowed)
    dynamic = cuda_source.dynamic_shared_bytes(launch)
    shared = max(launch.workgroup_bytes, dynamic)
    if shared > attrs.max_shared_memory_per_block_optin:
        fail("shared memory per block (opt-in)", shared, attrs.max_shared_memory_per_block_optin)
    if shared > attrs.max_shared_memory_per_block and dynamic == 0:
        fail("shared memory per block (static)", shared, attrs.max_shared_memory_per_block)
    if len(launch.params) > PARAM_BYTES:
        fail("kernel parameter bytes", len(launch.params), PARAM_BYTES)
    return grid, dynamic


# memory --------------------------------------------------------------------------------------


class DeviceBuffer:
    """Device memory freed when the last reference goes."""

    __slots__ = ("pointer", "nbytes", "__weakref__")

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes


class HostBuffer:
    """Pinned host memory with a numpy byte view."""

    __slots__ = ("pointer", "nbytes", "array", "event", "__weakref__")

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.pointer = pointer
        self.nbytes = nbytes
        self.array = np.frombuffer((ctypes.c_char * nbytes).from_address(pointer), np.uint8)
        self.event: int | None = None  # when set, the buffer is busy until this event completes


class Allocator:
    """Device buffers and pooled pinned staging buffers of one device. ``make_current`` binds the
    device to the calling thread: buffers may be freed from any thread (a DLPack consumer's, say)."""

    def __init__(
        self, driver: Driver, stats: Stats, make_current: Callable[[], None], max_idle_per_size: int = 4
    ) -> None:
        self.driver = driver
        self.stats = stats
        self.make_current = make_current
        self._idle: dict[int, list[HostBuffer]] = {}
        self._max_idle = max_idle_per_size

    def alloc(self, nbytes: int) -> DeviceBuffer:
        size = max(4, -(-nbytes // 4) * 4)
        pointer = ctypes.c_void_p()
        self.driver.check(self.driver.mem_alloc(ctypes.byref(pointer), size), f"device alloc of {size} bytes")
        buffer = DeviceBuffer(int(pointer.value or 0), size)
        self.stats.buffers_created += 1
        self.stats.buffers_live += 1
        weakref.finalize(buffer, self._free_device, self.driver, buffer.pointer, self.stats, self.make_current)
        return buffer

    @staticmethod
    def _free_device(driver: Driver, pointer: int, stats: Stats, make_current: Callable[[], None]) -> None:
        with contextlib.suppress(DeviceError):  # a lost device: the memory went with it
            make_current()
        driver.mem_free(pointer)
        stats.buffers_live -= 1

    def host(self, nbytes: int) -> HostBuffer:
        """A pinned buffer of at least ``nbytes`` (power-of-two buckets), reused once its event is done."""
        size = max(256, 1 << (max(nbytes, 1) - 1).bit_length())
        bucket = self._idle.get(size, [])
        for i, buffer in enumerate(bucket):
            if buffer.event is None or self.driver.event_query(buffer.event) == 0:
                self.stats.staging_idle -= 1
                if buffer.event is not None:
                    self.driver.event_destroy(buffer.event)
                    buffer.event = None
                return bucket.pop(i)
        buffer = HostBuffer(self.driver.alloc_host(size), size)
        self.stats.buffers_created += 1
        weakref.finalize(buffer, self.driver.host_free, buffer.pointer)
        return buffer

    def release(self, buffer: HostBuffer) -> None:
        bucket = self._idle.setdefault(buffer.nbytes, [])
        if len(bucket) < self._max_idle:
            bucket.append(buffer)
            self.stats.staging_idle += 1


# programs ------------------------------------------------------------------------------------


class Programs:
    """Modules loaded once per source (compiled through the disk cache), functions cached by entry."""

    def __init__(self, driver: Driver, attrs: DeviceAttributes, stats: Stats) -> None:
        from ..nvrtc import compiler

        self.driver = driver
        self.attrs = attrs
        self.stats = stats
        self.compiler = compiler(driver.vendor)
        self.target = ""
        if driver.vendor == "cuda":
            self.arch, self.target = _nvrtc_target(self.compiler, attrs.arch)  # type: ignore[arg-type]
        else:
            self.arch = attrs.arch
        self._modules: dict[str, int] = {}
        self._functions: dict[tuple[str, str], int] = {}
        self._dynamic: dict[int, int] = {}  # function -> dynamic shared bytes allowed so far

    def function(self, launch: Launch) -> int:
        source, name = cuda_source.render(launch)
        entry = cuda_source.entry_name(launch)
        key = (source, entry)
        function = self._functions.get(key)
        if function is None:
            module = self._modules.get(source)
            if module is None:
                options = ["-default-device"] if self.driver.vendor == "cuda" else []
                image = self.compiler.compile(source, name, self.arch, options, self.target)
                handle = ctypes.c_void_p()
                self.driver.check(self.driver.module_load_data(ctypes.byref(handle), image), f"loading module {name}")
                module = self._modules[source] = int(handle.value or 0)
                self.stats.pipelines_compiled += 1
            handle = ctypes.c_void_p()
            self.driver.check(
                self.driver.module_get_function(ctypes.byref(handle), module, entry.encode()),
                f"{launch.label}: kernel {entry!r} in {name}",
            )
            function = self._functions[key] = int(handle.value or 0)
        return function

    def allow_dynamic_shared(self, function: int, nbytes: int) -> None:
        """Opt a function in to more than the default 48 KiB of dynamic shared memory (CUDA)."""
        if nbytes <= self.attrs.max_shared_memory_per_block or nbytes <= self._dynamic.get(function, 0):
            return
        if self.driver.func_set_attribute is not None:
            self.driver.check(
                self.driver.func_set_attribute(function, FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes),
                f"allowing {nbytes} bytes of dynamic shared memory",
            )
        self._dynamic[function] = nbytes


def _nvrtc_target(nvrtc: Any, arch: str) -> tuple[str, str]:
    """cubin for the device's own arch when this NVRTC knows it, else PTX of the newest arch below."""
    number = int(arch.removeprefix("sm_"))
    supported = nvrtc.supported_archs()
    if number in supported:
        return arch, "cubin"
    older = [a for a in supported if a <= number]
    if not older:
        raise UnsupportedError(f"nvrtc {nvrtc.version}: cannot compile for {arch} (supports {supported})")
    return f"sm_{max(older)}", "ptx"


# plans and executions ------------------------------------------------------------------------


class PackedLaunch:
    """One launch with its argument array built once: ``kernelParams[i]`` points at argument ``i``;
    ``call`` is the whole argument tuple of the launch function for ``stream``."""

    __slots__ = ("label", "function", "grid", "block", "shared", "slots", "params", "call")

    def __init__(
        self, label: str, function: int, grid: tuple, block: tuple, shared: int, slots: list, stream: int
    ) -> None:
        self.label = label
        self.function = function
        self.grid = grid
        self.block = block
        self.shared = shared
        self.slots = slots  # the ctypes objects the array points into, kept alive here
        self.params = (ctypes.c_void_p * max(len(slots), 1))(*(ctypes.addressof(s) for s in slots))
        self.call = (function, *grid, *block, shared, stream, ctypes.cast(self.params, _PP), None)


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
        self.upload_event: int | None = None
        self.runs = 0
        self.graph_exec: int | None = None


class NativeExecution(Execution):
    def __init__(self, allocator: Allocator, staging: HostBuffer | None, layout: ReadbackLayout, event: int) -> None:
        self.allocator = allocator
        self.staging = staging
        self.layout = layout
        self.event: int | None = event
        self.results: dict[Storage, np.ndarray] | None = None
        self.waiting: concurrent.futures.Future | None = None  # an async read's wait, on the executor's worker

    def abandon(self) -> None:
        if self.results is not None or self.event is None:
            return
        if self.waiting is not None and not self.waiting.done():
            return  # the worker still waits on the event: leave it and the buffer to the garbage collector
        if self.staging is not None:
            self.staging.event = self.event  # the buffer owns the event now: reusable once it is done
            self.allocator.release(self.staging)
            self.staging = None
        else:
            self.allocator.driver.event_destroy(self.event)
        self.event = None


class NativeExecutor(Executor):
    """The executor protocol over :class:`Driver` (``kind`` is ``"cuda"`` or ``"hip"``)."""

    def __init__(self, vendor: str, *, device: int = 0, poison: bool = False, driver: Driver | None = None) -> None:
        self.kind = vendor
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
        self._context = ctypes.c_void_p()
        self._make_current = True
        self.make_current()
        name = ctypes.create_string_buffer(256)
        drv.check(drv.device_name(name, 256, self.device), "device name")
        total = ctypes.c_size_t()
        drv.check(drv.device_total_mem(ctypes.byref(total), self.device), "device memory")
        self.attrs = DeviceAttributes.query(drv, self.device, name.value.decode(), self._arch(), total.value)
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
        self.programs = Programs(drv, self.attrs, self.stats)
        self._resident: dict[int, DeviceBuffer] = {}

    def make_current(self) -> None:
        """Bind this device to the calling thread (the primary context on CUDA)."""
        drv = self.driver
        if drv.vendor == "cuda":
            if not self._context.value:
                drv.check(drv.primary_ctx_retain(ctypes.byref(self._context), self.device), "primary context")
            drv.check(drv.ctx_set_current(self._context), "set current context")
        else:
            drv.check(drv.set_device(self.device), "set device")

    def _arch(self) -> str:
        if self.driver.vendor == "cuda":
            major = self.driver.attribute("compute_capability_major", self.device)
            minor = self.driver.attribute("compute_capability_minor", self.device)
            return f"sm_{major}{minor}"
        # hipDeviceProp_t's layout changes across ROCm versions; gcnArchName is the one "gfx..." string.
        props = ctypes.create_string_buffer(16384)
        self.driver.check(self.driver.device_properties(props, self.device), "device properties")
        match = re.search(rb"gfx[0-9a-f]+(?::[a-z0-9]+[+-])*", props.raw)
        if not match:
            raise DeviceError("hip: gcnArchName not found in the device properties")
        return match.group().decode()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "arch": self.attrs.arch, "graphs": self.graphs}

    def supports(self, dtype: np.dtype) -> bool:
        return dtype in SUPPORTED

    # memory -------------------------------------------------------------------------------------

    def _upload_sync(self, buffer: DeviceBuffer, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.driver.check(
            self.driver.memcpy_htod_async(buffer.pointer, raw.ctypes.data, raw.nbytes, self.stream), "upload"
        )
        self.driver.check(self.driver.stream_synchronize(self.stream), "upload sync")
        self.stats.bytes_uploaded += raw.nbytes

    def alloc_resident(self, storage: Storage, data: np.ndarray) -> None:
        buffer = self.allocator.alloc(storage.nbytes)
        self._resident[storage.id] = buffer
        weakref.finalize(storage, self._resident.pop, storage.id, None)
        self._upload_sync(buffer, data)

    def write_resident(self, storage: Storage, data: np.ndarray) -> None:
        self._upload_sync(self._resident[storage.id], data)

    def read_resident(self, storage: Storage) -> np.ndarray:
        out = np.empty(storage.nbytes, np.uint8)
        buffer = self._resident[storage.id]
        self.driver.check(
            self.driver.memcpy_dtoh_async(out.ctypes.data, buffer.pointer, storage.nbytes, self.stream), "read"
        )
        self.driver.check(self.driver.stream_synchronize(self.stream), "read sync")
        self.stats.bytes_read += storage.nbytes
        return out.view(storage.dtype)

    # interop (batchgpu.interop) -------------------------------------------------------------------

    def dlpack_device(self) -> tuple[int, int]:
        return (KDL_CUDA if self.kind == "cuda" else KDL_ROCM, self.ordinal)

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]:
        """The resident buffer (the owner keeps it allocated), after our stream has drained: the
        consumer may read it on any stream. ``copy``: a new buffer, copied device to device."""
        self.make_current()
        buffer = self._resident[storage.id]
        if copy:
            source, buffer = buffer, self.allocator.alloc(storage.nbytes)
            self.driver.check(
                self.driver.memcpy_dtod_async(buffer.pointer, source.pointer, storage.nbytes, self.stream),
                "export copy",
            )
        self.driver.check(self.driver.stream_synchronize(self.stream), "export sync")
        return buffer.pointer, buffer

    def import_stream(self, device_type: int, device_id: int | None) -> int | None:
        accepted = IMPORTABLE[self.kind]
        if device_type not in accepted:
            names = " or ".join(device_name(t) for t in accepted)
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
        if foreign.device_id is None and drv.vendor == "cuda":  # __cuda_array_interface__ names no device
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
        if foreign.stream is not None:
            drv.check(drv.stream_synchronize(foreign.stream), "waiting for the producer's stream")
        buffer = self.allocator.alloc(storage.nbytes)
        drv.check(drv.memcpy_dtod_async(buffer.pointer, foreign.pointer, foreign.nbytes, self.stream), "import copy")
        drv.check(drv.stream_synchronize(self.stream), "import sync")
        self._resident[storage.id] = buffer
        weakref.finalize(storage, self._resident.pop, storage.id, None)

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
        buffers: dict[Storage, DeviceBuffer] = {}
        for storage in storages:
            buffers[storage] = self.allocator.alloc(storage.nbytes)
            if self.poison and storage.kind in ("output", "scratch"):
                buffer = buffers[storage]
                drv.check(drv.memset_d8_async(buffer.pointer, POISON_BYTE, buffer.nbytes, self.stream), "poison fill")
        alias_buffers(buffers, aliases)
        launches = [self.form(launch) for node in nodes for launch in node.launches]
        for launch in launches:
            for binding in launch.bindings:
                if binding.storage is not None and binding.storage not in buffers:
                    buffers[binding.storage] = self._resident[binding.storage.id]
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
        self.programs.allow_dynamic_shared(function, dynamic)
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

    def _new_event(self) -> int:
        event = ctypes.c_void_p()
        self.driver.check(self.driver.event_create(ctypes.byref(event), EVENT_DISABLE_TIMING), "event create")
        handle = int(event.value or 0)
        return handle

    def _uploads(self, plan: NativePlan, writes: Sequence[tuple[Storage, np.ndarray]], scalar_bytes: bytes) -> None:
        """Copy writes and scalars into the plan's pinned upload buffer, then enqueue async H2D copies.
        The host waits only for the previous execute's uploads out of that buffer (not its kernels)."""
        drv = self.driver
        total = sum(-(-data.nbytes // 256) * 256 for _, data in writes) + len(scalar_bytes)
        if total == 0:
            return
        if plan.upload_event is not None:
            drv.check(drv.event_synchronize(plan.upload_event), "waiting for the previous uploads")
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
            plan.upload_event = self._new_event()
        drv.check(drv.event_record(plan.upload_event, self.stream), "event record")

    def _launch_all(self, plan: NativePlan) -> None:
        launch_kernel = self.driver.launch_kernel
        for packed in plan.launches:
            status = launch_kernel(*packed.call)
            if status:
                self._launch_failed(packed, status)

    def _launch(self, packed: PackedLaunch) -> None:
        status = self.driver.launch_kernel(*packed.call)
        if status:
            self._launch_failed(packed, status)

    def _launch_failed(self, packed: PackedLaunch, status: int) -> None:
        self.driver.check(status, f"{packed.label}: launch (grid {packed.grid}, block {packed.block})")

    def _capture(self, plan: NativePlan) -> int:
        """Record the plan's launches into a graph once; returns the instantiated graph."""
        drv = self.driver
        drv.check(drv.stream_begin_capture(self.stream, CAPTURE_MODE_THREAD_LOCAL), "begin graph capture")
        graph = ctypes.c_void_p()
        try:
            self._launch_all(plan)
        finally:
            drv.check(drv.stream_end_capture(self.stream, ctypes.byref(graph)), "end graph capture")
        executable = ctypes.c_void_p()
        drv.check(drv.graph_instantiate(ctypes.byref(executable), graph, 0), "graph instantiate")
        drv.graph_destroy(graph)
        handle = int(executable.value or 0)
        weakref.finalize(plan, drv.graph_exec_destroy, handle)
        return handle

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
        Profiled: eager launches with timing events around each (:mod:`.native_timing`)."""
        assert isinstance(plan, NativePlan)
        drv = self.driver
        started = time.perf_counter()
        self.make_current()
        timer = EventTimer(self, plan, profile, started) if profile is not None else None
        self._uploads(plan, writes, pack_scalars(plan.scalars, scalars) if plan.scalars else b"")
        if timer is not None:
            timer.uploaded()
            if plan.launches:
                timer.launch_all(plan)
        elif plan.launches:
            if self.graphs and plan.runs >= 1 and plan.graph_exec is None:
                plan.graph_exec = self._capture(plan)
            if plan.graph_exec is not None:
                drv.check(drv.graph_launch(plan.graph_exec, self.stream), "graph launch")
            else:
                self._launch_all(plan)
        plan.runs += 1
        self.stats.dispatches += len(plan.launches)
        self.stats.submits += 1
        execution = self._copies(plan.readback_layout(readback))
        if timer is not None:
            timer.submitted(execution)
        return execution

    def _copies(self, layout: ReadbackLayout) -> NativeExecution:
        drv = self.driver
        staging = self.allocator.host(layout.total) if layout.total else None
        for _, buffer, offset, size in layout.copies:
            assert staging is not None
            drv.check(drv.memcpy_dtoh_async(staging.pointer + offset, buffer.pointer, size, self.stream), "readback")
        event = self._new_event()
        drv.check(drv.event_record(event, self.stream), "event record")
        return NativeExecution(self.allocator, staging, layout, event)

    def _extra_execution(self, plan: NativePlan, storage: Storage) -> NativeExecution:
        return self._copies(ReadbackLayout([(storage, plan.buffers[storage], 0, storage.nbytes)], storage.nbytes))

    def _copy_out(self, execution: NativeExecution) -> dict[Storage, np.ndarray]:
        staging = execution.staging
        results = {}
        for storage, _, offset, size in execution.layout.copies:
            assert staging is not None
            results[storage] = staging.array[offset : offset + size].copy().view(storage.dtype)
        self.stats.bytes_read += sum(size for *_, size in execution.layout.copies)
        if staging is not None:
            self.allocator.release(staging)
            execution.staging = None
        if execution.event is not None:
            self.driver.event_destroy(execution.event)
            execution.event = None
        return results

    def _wait(self, execution: NativeExecution) -> None:
        if execution.event is None:
            raise DeviceError(f"{self.kind}: read of an execute that a newer execute superseded")
        self.make_current()
        self.driver.check(self.driver.event_synchronize(execution.event), "waiting for the execute")

    def read_sync(self, plan: Plan, execution: Execution, storage: Storage) -> np.ndarray:
        assert isinstance(plan, NativePlan) and isinstance(execution, NativeExecution)
        if not any(s is storage for s, *_ in execution.layout.copies):
            execution = self._extra_execution(plan, storage)
        if execution.results is None:
            if execution.waiting is not None:  # an async read's wait (perhaps cancelled) is in flight
                execution.waiting.result()
            else:
                self._wait(execution)
            if execution.results is None:
                execution.results = self._copy_out(execution)
        return execution.results[storage]

    async def read(self, plan: Plan, execution: Execution, storage: Storage) -> np.ndarray:
        """Waits for the execute's event on the executor's worker thread, which keeps waiting if this
        await is cancelled (a later read gets the result)."""
        assert isinstance(plan, NativePlan) and isinstance(execution, NativeExecution)
        if not any(s is storage for s, *_ in execution.layout.copies):
            execution = self._extra_execution(plan, storage)
        if execution.results is None:
            if execution.waiting is None:
                execution.waiting = self.waits.submit(self._wait, execution)
            await wait_future(execution.waiting)
            if execution.results is None:
                execution.results = self._copy_out(execution)
        return execution.results[storage]
