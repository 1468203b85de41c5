"""Native CUDA and HIP executors: the vendors' driver APIs through one small ctypes table.

``Device("cuda")`` binds ``libcuda.so.1`` (the CUDA driver API), ``Device("hip")`` binds
``libamdhip64.so`` (HIP's module API); both run the same code: device attributes, a primary context,
device memory, async copies on one stream, modules from NVRTC/hipRTC loaded once, kernel launches with
argument arrays packed once per recorded launch, events, and graph replay.

Modules:

- :mod:`.driver`: the function table for both vendors (:data:`FUNCTIONS`, :data:`CUDA_ONLY`,
  :data:`HIP_ONLY`), enum values, and :class:`Driver` (``CudaDriver`` / ``HipDriver``) with ``check()``
  for every status a call returns.
- :mod:`.attributes`: :class:`DeviceAttributes` (queried limits, turned into
  :class:`~batchgpu.limits.Limits`) and :func:`check_native_launch`, run before any launch is planned.
- :mod:`.memory`: device buffers and pooled pinned host buffers (staging), freed when unreferenced;
  :class:`~.memory.Event`, an owning driver event.
- :mod:`.programs`: compiled modules (disk cache in :mod:`batchgpu.nvrtc`), each a
  :class:`~.programs.Module` unloaded when dropped, and the function cache.
- :mod:`.executor`: :class:`NativeExecutor` (the executor protocol, on the skeleton of
  :class:`~batchgpu.executors.base.DeviceExecutor`) and its vendors, :class:`CudaExecutor` and
  :class:`HipExecutor`. ``plan`` allocates every buffer and packs every launch's arguments once;
  ``run`` enqueues uploads, every launch (or the captured graph) and the readback copies on one stream
  with no host sync, and records an event; ``read`` waits on that event, ``read_async`` in a worker thread.

The CUDA executor has run on an NVIDIA H100 (2026-11-23): the native test modules passed there (312
passed: the op suites, SmolLM2 greedy ids, event profiling, graph replay, DLPack/CAI interop), and
SmolLM2-135M decoded at 1.46 ms/token quantized with graph replay (docs/executors.md, "Native CUDA and HIP";
benchmarks/RESULTS.md). HIP has not run on AMD hardware: its table is checked against
``hip_runtime_api.h`` and ``libamdhip64``, and hipRTC compiles every kernel, without a GPU.
"""

from __future__ import annotations

from .attributes import PARAM_BYTES, DeviceAttributes, check_native_launch, launch_grid
from .driver import (
    ATTRIBUTES,
    CAPTURE_MODE_THREAD_LOCAL,
    CUDA_ONLY,
    EVENT_DISABLE_TIMING,
    FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
    FUNCTIONS,
    HIP_ONLY,
    LIBRARIES,
    MISSING,
    NOT_READY,
    POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    STREAM_NON_BLOCKING,
    CudaDriver,
    Driver,
    HipDriver,
    load_library,
)
from .executor import (
    ENV_GRAPHS,
    EXECUTORS,
    CudaExecutor,
    GraphExec,
    HipExecutor,
    NativeExecution,
    NativeExecutor,
    NativePlan,
    PackedLaunch,
)
from .memory import Allocator, DeviceBuffer, Event, HostBuffer, PinnedPool
from .programs import Module, Programs, nvrtc_target

__all__ = [
    "ATTRIBUTES",
    "CAPTURE_MODE_THREAD_LOCAL",
    "CUDA_ONLY",
    "ENV_GRAPHS",
    "EVENT_DISABLE_TIMING",
    "EXECUTORS",
    "FUNCTIONS",
    "FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "HIP_ONLY",
    "LIBRARIES",
    "MISSING",
    "NOT_READY",
    "PARAM_BYTES",
    "POINTER_ATTRIBUTE_DEVICE_ORDINAL",
    "STREAM_NON_BLOCKING",
    "Allocator",
    "CudaDriver",
    "CudaExecutor",
    "DeviceAttributes",
    "DeviceBuffer",
    "Driver",
    "Event",
    "GraphExec",
    "HipDriver",
    "HipExecutor",
    "HostBuffer",
    "Module",
    "NativeExecution",
    "NativeExecutor",
    "NativePlan",
    "PackedLaunch",
    "PinnedPool",
    "Programs",
    "check_native_launch",
    "launch_grid",
    "load_library",
    "nvrtc_target",
]
