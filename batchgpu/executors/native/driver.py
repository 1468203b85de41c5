"""The vendors' driver APIs as one ctypes table: CUDA's driver API (``libcuda.so.1``) and HIP's module
API (``libamdhip64.so``), named generically (``drv.mem_alloc``...), every status checked by
:meth:`Driver.check`. ``tests/test_native_abi.py`` compares the table with ``cuda.h`` and
``hip_runtime_api.h``."""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

from ...errors import DeviceError, UnsupportedError

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
    "module_unload": ("cuModuleUnload", "hipModuleUnload", [_P]),
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
    status goes through :meth:`check`. ``Driver("cuda")`` / ``Driver("hip")`` make a :class:`CudaDriver`
    / :class:`HipDriver`, which hold what differs: the symbol column, the vendor-only entry points,
    error strings and pinned host allocation."""

    vendor: ClassVar[str]
    column: ClassVar[int]  # the FUNCTIONS column of this vendor's symbols, and the ATTRIBUTES column
    only: ClassVar[dict[str, tuple[str, list, Any]]]  # the vendor-only entry points
    fallbacks: ClassVar[dict[str, str]] = {}  # symbol -> older name bound when the library lacks it

    def __new__(cls, vendor: str | None = None) -> Driver:
        if cls is Driver:
            if vendor not in DRIVERS:
                raise UnsupportedError(f"native executor: unknown vendor {vendor!r} (expected 'cuda' or 'hip')")
            cls = DRIVERS[vendor]
        return super().__new__(cls)

    def __init__(self, vendor: str | None = None) -> None:
        self.lib = load_library(self.vendor)
        self.missing: list[str] = []
        # CUDA only: HIP's hipFuncSetAttribute takes a host kernel pointer, not a module function, and
        # AMD devices have no opt-in shared memory beyond the per-block limit.
        self.func_set_attribute: Any = None
        for generic, (*symbols, argtypes) in FUNCTIONS.items():
            self._bind(generic, symbols[self.column], argtypes, None)
        for generic, (symbol, argtypes, restype) in self.only.items():
            self._bind(generic, symbol, argtypes, restype)

    @property
    def library(self) -> str:
        """The file name the driver library was loaded by (``libcuda.so.1``...)."""
        return self.lib._name

    def _bind(self, generic: str, symbol: str, argtypes: list, restype: Any) -> None:
        try:
            function = getattr(self.lib, symbol)
        except AttributeError:
            if symbol in self.fallbacks:
                return self._bind(generic, self.fallbacks[symbol], argtypes, restype)
            self.missing.append(symbol)
            function = None
        else:
            function.argtypes = argtypes
            function.restype = restype if restype is not None else ctypes.c_int
        setattr(self, generic, function)

    def error_string(self, status: int) -> str:
        """``"<error name>: <description>"`` of a status."""
        raise NotImplementedError

    def check(self, status: int, what: str) -> None:
        """Raise DeviceError naming the call and the driver's error string for a non-zero status."""
        if status != 0:
            raise DeviceError(f"{self.vendor}: {what} failed: {self.error_string(status)} (status {status})")

    def attribute(self, name: str, device: int) -> int:
        value = ctypes.c_int()
        enum = ATTRIBUTES[name][self.column]
        self.check(self.device_attribute(ctypes.byref(value), enum, device), f"device attribute {name}")
        return value.value

    def alloc_host(self, nbytes: int) -> int:
        """Page-locked host memory (for async copies)."""
        raise NotImplementedError


class CudaDriver(Driver):
    vendor = "cuda"
    column = 0
    only = CUDA_ONLY

    def error_string(self, status: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self.get_error_name(status, ctypes.byref(name))
        self.get_error_string(status, ctypes.byref(text))
        return f"{(name.value or b'?').decode()}: {(text.value or b'unknown error').decode()}"

    def alloc_host(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self.check(self.mem_alloc_host(ctypes.byref(pointer), nbytes), f"cuMemAllocHost({nbytes})")
        return int(pointer.value or 0)


class HipDriver(Driver):
    vendor = "hip"
    column = 1
    only = HIP_ONLY
    fallbacks: ClassVar[dict[str, str]] = {"hipGetDevicePropertiesR0600": "hipGetDeviceProperties"}  # ROCm 5

    def error_string(self, status: int) -> str:
        name, text = self.get_error_name(status), self.get_error_string(status)
        return f"{(name or b'?').decode()}: {(text or b'unknown error').decode()}"

    def alloc_host(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self.check(self.host_malloc(ctypes.byref(pointer), nbytes, 0), f"hipHostMalloc({nbytes})")
        return int(pointer.value or 0)


DRIVERS: dict[str, type[Driver]] = {"cuda": CudaDriver, "hip": HipDriver}
