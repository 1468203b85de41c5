"""Foreign array protocols: DLPack (``__dlpack__``) and ``__cuda_array_interface__``.

Import: :func:`foreign_device` says where an object's memory lives without touching it;
:func:`foreign_array` reads a device array's pointer, shape, dtype and strides through either protocol
(DLPack first) into a :class:`ForeignArray`, which owns the producer's DLPack capsule until
:meth:`ForeignArray.release`. Host data (numpy arrays, lists, DLPack objects on ``kDLCPU``) gives
``None``: the host path handles it.

Export: :func:`to_dlpack_capsule` wraps a pointer in a ``"dltensor"`` (DLPack 0.x) or
``"dltensor_versioned"`` (1.x) capsule whose deleter releases the Python object that keeps the memory
alive. Pure ctypes: the DLPack structs below and the ``PyCapsule`` C API through ``ctypes.pythonapi``.
"""

from __future__ import annotations

import ctypes
import math
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ArgumentError, DTypeError, ExportError, ShapeError

# DLDeviceType (dlpack.h)
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_OPENCL = 4
KDL_VULKAN = 7
KDL_METAL = 8
KDL_ROCM = 10
KDL_ROCM_HOST = 11
KDL_CUDA_MANAGED = 13
KDL_ONEAPI = 14
KDL_WEBGPU = 15
DEVICE_NAMES = {
    KDL_CPU: "CPU",
    KDL_CUDA: "CUDA",
    KDL_CUDA_HOST: "CUDA pinned host",
    KDL_OPENCL: "OpenCL",
    KDL_VULKAN: "Vulkan",
    KDL_METAL: "Metal",
    KDL_ROCM: "ROCm",
    KDL_ROCM_HOST: "ROCm pinned host",
    KDL_CUDA_MANAGED: "CUDA managed",
    KDL_ONEAPI: "oneAPI",
    KDL_WEBGPU: "WebGPU",
}

# DLDataTypeCode (dlpack.h)
KDL_INT, KDL_UINT, KDL_FLOAT, KDL_BFLOAT, KDL_COMPLEX, KDL_BOOL = 0, 1, 2, 4, 5, 6
_CODE_OF_KIND = {"i": KDL_INT, "u": KDL_UINT, "f": KDL_FLOAT, "c": KDL_COMPLEX, "b": KDL_BOOL}
_KIND_OF_CODE = {code: kind for kind, code in _CODE_OF_KIND.items()}

FLAG_READ_ONLY = 1 << 0  # DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_IS_COPIED = 1 << 1  # DLPACK_FLAG_BITMASK_IS_COPIED
DLPACK_VERSION = (1, 0)  # the DLManagedTensorVersioned layout below


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),  # in elements; NULL means row-major contiguous
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*deleter)(DLManagedTensor[Versioned]* self)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# PyCapsule C API. Own prototypes (never the argtypes of the shared ``ctypes.pythonapi`` attributes).
# PYFUNCTYPE keeps the GIL held during the call, as the C API requires.
def _api(name: str, restype: Any, *argtypes: Any) -> Any:
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_new = _api("PyCapsule_New", ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_capsule_get_pointer = _api("PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)
_capsule_set_name = _api("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_is_valid = _api("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_incref = _api("Py_IncRef", None, ctypes.py_object)


def _immortal(obj: Any) -> Any:
    """Take one reference that is never dropped: capsule names (PyCapsule keeps the ``char*``, not a
    copy) and the deleter callback must outlive every capsule, even ones freed at interpreter shutdown."""
    _incref(obj)
    return obj


NAME = _immortal(b"dltensor")
USED_NAME = _immortal(b"used_dltensor")
VERSIONED_NAME = _immortal(b"dltensor_versioned")
USED_VERSIONED_NAME = _immortal(b"used_dltensor_versioned")


# ---------------------------------------------------------------------------------------------
# import


@dataclass(eq=False)
class ForeignArray:
    """A device array another library owns: where it is and how to read it.

    ``strides`` are in bytes as the producer reported them (``None``: row-major contiguous).
    ``stream`` is a producer stream to synchronize before reading (``__cuda_array_interface__`` v3
    only; DLPack orders the producer's work through the consumer's stream instead). Call
    :meth:`release` (or use ``with``) once the memory is no longer read; a DLPack capsule taken over
    from the producer is handed back through its deleter then (or when this object is collected).
    """

    pointer: int
    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...] | None
    device_type: int
    device_id: int | None  # None: the protocol does not say (__cuda_array_interface__)
    stream: int | None = None
    readonly: bool = False
    protocol: str = "dlpack"
    owner: Any = field(default=None, repr=False)  # keeps the producer's memory alive
    _finalizer: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        """Row-major contiguous (extents of 1 may carry any stride)."""
        if self.strides is None:
            return True
        step = self.dtype.itemsize
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != step:
                return False
            step *= extent
        return True

    @property
    def device_name(self) -> str:
        return device_name(self.device_type, self.device_id)

    def release(self) -> None:
        """Stop using the memory: call the DLPack deleter (once) and drop the producer object."""
        if self._finalizer is not None:
            self._finalizer()
        self.owner = None

    def __enter__(self) -> ForeignArray:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def device_name(device_type: int, device_id: int | None = None) -> str:
    """``"CUDA device 0"``-style text for error messages."""
    kind = DEVICE_NAMES.get(device_type, f"DLPack device type {device_type}")
    return kind if device_id is None else f"{kind} device {device_id}"


def foreign_device(obj: Any) -> tuple[int, int | None] | None:
    """(DLPack device type, device id) of an object's memory, or None for host data. Reads only
    ``__dlpack_device__`` or the presence of ``__cuda_array_interface__``: nothing is consumed."""
    if isinstance(obj, np.ndarray):
        return None
    query = getattr(obj, "__dlpack_device__", None)
    if query is not None and hasattr(obj, "__dlpack__"):
        device_type, device_id = query()
        device_type, device_id = int(device_type), int(device_id)
        return None if device_type == KDL_CPU else (device_type, device_id)
    if hasattr(obj, "__cuda_array_interface__"):
        return (KDL_CUDA, None)
    return None


def foreign_array(obj: Any, *, stream: int | None = None, what: str = "foreign array") -> ForeignArray | None:
    """Read a device array through ``__dlpack__`` (preferred) or ``__cuda_array_interface__``.

    None for host data. ``stream`` is the consumer's stream handle passed to ``__dlpack__`` so the
    producer orders its pending work before it (CUDA: a ``CUstream`` other than 0; 1 is the legacy
    default stream; None means the legacy default too). The result owns the producer's capsule:
    call :meth:`ForeignArray.release` when done.
    """
    if foreign_device(obj) is None:
        return None
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        try:
            capsule = obj.__dlpack__(stream=stream, max_version=DLPACK_VERSION)
        except TypeError:  # a producer older than DLPack 1.0 (no max_version keyword)
            capsule = obj.__dlpack__(stream=stream)
        return parse_capsule(capsule, what=what)
    return parse_cuda_array_interface(obj.__cuda_array_interface__, owner=obj, what=what)


def parse_capsule(capsule: Any, *, what: str = "foreign array") -> ForeignArray:
    """Take over a DLPack capsule (``"dltensor"`` or ``"dltensor_versioned"``): read the tensor,
    rename the capsule to ``"used_..."`` and return a ForeignArray whose release calls the deleter.

    Everything is validated before the capsule is renamed, so on error it is still the producer's
    and its own destructor frees it."""
    if _capsule_is_valid(capsule, VERSIONED_NAME):
        address = _capsule_get_pointer(capsule, VERSIONED_NAME)
        managed: Any = DLManagedTensorVersioned.from_address(address)
        if managed.version.major != 1:
            raise ExportError(
                f"{what}: DLPack capsule of version {managed.version.major}.{managed.version.minor}; "
                f"this consumer reads major version 1"
            )
        used, readonly = USED_VERSIONED_NAME, bool(managed.flags & FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, NAME):
        address = _capsule_get_pointer(capsule, NAME)
        managed = DLManagedTensor.from_address(address)
        used, readonly = USED_NAME, False
    else:
        raise ExportError(f"{what}: expected an unconsumed DLPack capsule ('dltensor'), got {capsule!r}")
    tensor = managed.dl_tensor
    dtype = dlpack_dtype(tensor.dtype, what=what)
    ndim = int(tensor.ndim)
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    strides = tuple(int(tensor.strides[i]) * dtype.itemsize for i in range(ndim)) if tensor.strides else None
    array = ForeignArray(
        pointer=int(tensor.data or 0) + int(tensor.byte_offset),
        shape=shape,
        dtype=dtype,
        strides=strides,
        device_type=int(tensor.device.device_type),
        device_id=int(tensor.device.device_id),
        readonly=readonly,
    )
    if _capsule_set_name(capsule, used) != 0:
        raise ExportError(f"{what}: could not mark the DLPack capsule as consumed")
    array._finalizer = weakref.finalize(array, _call_deleter, address, managed.deleter)
    return array


def _call_deleter(address: int, deleter: int | None) -> None:
    if deleter:
        DELETER(deleter)(address)


def dlpack_dtype(dtype: DLDataType, *, what: str = "foreign array") -> np.dtype:
    """The numpy dtype of a DLDataType, or DTypeError naming the type (e.g. bfloat16)."""
    code, bits, lanes = int(dtype.code), int(dtype.bits), int(dtype.lanes)
    if lanes != 1:
        raise DTypeError(f"{what}: DLPack vector dtype (code {code}, {bits} bits, {lanes} lanes) is not supported")
    if code == KDL_BFLOAT:
        raise DTypeError(f"{what}: dtype bfloat{bits} is not supported (expected one of {_supported_names()})")
    kind = _KIND_OF_CODE.get(code)
    try:
        if kind is None or bits % 8:
            raise TypeError
        return np.dtype(f"{kind}{bits // 8}")
    except TypeError:
        raise DTypeError(
            f"{what}: DLPack dtype (code {code}, {bits} bits) has no numpy equivalent and is not supported "
            f"(expected one of {_supported_names()})"
        ) from None


def _supported_names() -> str:
    from .dtypes import SUPPORTED

    return ", ".join(d.name for d in SUPPORTED)


def parse_cuda_array_interface(interface: Any, *, owner: Any = None, what: str = "foreign array") -> ForeignArray:
    """Read a ``__cuda_array_interface__`` dict (versions 2 and 3; masks are refused). ``owner``
    (the producer object) is kept alive until release: the protocol has no other lifetime."""
    if not isinstance(interface, dict):
        raise ArgumentError(f"{what}: __cuda_array_interface__ must be a dict, got {type(interface).__name__}")
    version = interface.get("version")
    if version not in (2, 3):
        raise ExportError(f"{what}: __cuda_array_interface__ version {version!r} is not supported (expected 2 or 3)")
    for key in ("shape", "typestr", "data"):
        if key not in interface:
            raise ExportError(f"{what}: __cuda_array_interface__ lacks the required entry {key!r}")
    if interface.get("mask") is not None:
        raise ExportError(f"{what}: masked arrays (__cuda_array_interface__ 'mask') are not supported")
    shape = tuple(int(e) for e in interface["shape"])
    if any(e < 0 for e in shape):
        raise ShapeError(f"{what}: __cuda_array_interface__ shape {shape} has a negative extent")
    try:
        dtype = np.dtype(interface["typestr"])
    except TypeError:
        raise DTypeError(f"{what}: __cuda_array_interface__ typestr {interface['typestr']!r} is not a dtype") from None
    if not dtype.isnative:
        raise DTypeError(f"{what}: typestr {interface['typestr']!r} is not in this machine's byte order")
    data = interface["data"]
    if not (isinstance(data, tuple | list) and len(data) == 2):
        raise ExportError(f"{what}: __cuda_array_interface__ 'data' must be (pointer, readonly), got {data!r}")
    pointer, readonly = int(data[0] or 0), bool(data[1])
    if pointer == 0 and math.prod(shape) != 0:
        raise ExportError(f"{what}: __cuda_array_interface__ of shape {shape} has a null data pointer")
    strides = interface.get("strides")
    if strides is not None:
        strides = tuple(int(s) for s in strides)
        if len(strides) != len(shape):
            raise ShapeError(f"{what}: __cuda_array_interface__ strides {strides} do not match shape {shape}")
    stream = interface.get("stream") if version >= 3 else None
    if stream is not None:
        stream = int(stream)
        if stream == 0:
            raise ExportError(f"{what}: __cuda_array_interface__ stream 0 is disallowed (ambiguous); see the v3 spec")
    return ForeignArray(
        pointer=pointer,
        shape=shape,
        dtype=dtype,
        strides=strides,
        device_type=KDL_CUDA,
        device_id=None,
        stream=stream,
        readonly=readonly,
        protocol="cuda_array_interface",
        owner=owner,
    )


# ---------------------------------------------------------------------------------------------
# export


@dataclass(eq=False)
class _Export:
    """Everything a consumer of one exported capsule may still read, kept until the deleter runs."""

    managed: Any  # the DLManagedTensor[Versioned]
    dims: Any  # its shape array
    owner: Any  # keeps the memory alive
    name: bytes  # the capsule's unconsumed name
    capsule: Any = None  # None once consumed (the consumer then owns it and calls the deleter)
    baseline: int = 0  # refcount() of the capsule when only this entry referenced it

    def refcount(self) -> int:
        """``sys.getrefcount`` of the capsule, always measured the same way (a local name, then the
        call), so comparing with ``baseline`` holds whatever the interpreter's own counting."""
        capsule = self.capsule
        count = sys.getrefcount(capsule)
        del capsule
        return count


_EXPORTS: dict[int, _Export] = {}
"""address of a live DLManagedTensor[Versioned] -> its export. No manual reference counting: the dict
holds everything."""


def _deleter(address: int) -> None:
    """DLManagedTensor::deleter: the consumer is done; drop the struct, the owner and the capsule (once)."""
    _EXPORTS.pop(address, None)


def _sweep() -> None:
    """Release exports whose capsule was dropped unconsumed (still named "dltensor", referenced only
    here); the DLPack spec gives their producer the duty to call the deleter.

    Capsules get no destructor on purpose: a consumer that refuses a capsule (``np.from_dlpack`` of a
    CUDA tensor) frees it with its exception already set, and any Python callback run then replaces
    that exception with a SystemError. So the registry keeps each capsule and this sweep, run at every
    export and by :func:`live_exports`, finds the abandoned ones."""
    for address, export in list(_EXPORTS.items()):
        if export.capsule is None:
            continue
        if not _capsule_is_valid(export.capsule, export.name):
            export.capsule = None  # consumed: the consumer calls the deleter; the capsule itself may go
        elif export.refcount() <= export.baseline:  # no references beyond the ones counted at export
            _EXPORTS.pop(address, None)


_DELETER = _immortal(DELETER(_deleter))
_DELETER_ADDRESS = ctypes.cast(_DELETER, ctypes.c_void_p).value


def to_dlpack_capsule(
    pointer: int,
    shape: tuple[int, ...],
    dtype: np.dtype,
    device_type: int,
    device_id: int,
    owner: Any,
    *,
    versioned: bool = False,
    copied: bool = False,
) -> Any:
    """A DLPack capsule viewing ``pointer`` as a row-major ``shape``/``dtype`` array.

    ``owner`` is kept alive until the consumer calls the deleter, or, for a capsule dropped
    unconsumed, until the next export (or :func:`live_exports`) notices it (see :func:`_sweep`).
    ``versioned`` gives a DLPack 1.0 ``"dltensor_versioned"`` capsule (for consumers that
    passed ``max_version >= (1, 0)``), else a 0.x ``"dltensor"`` one. The memory is shared writable.
    """
    dtype = np.dtype(dtype)
    code = _CODE_OF_KIND.get(dtype.kind)
    if code is None:
        raise DTypeError(f"DLPack export: dtype {dtype.name} has no DLPack type code")
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    managed: Any = DLManagedTensorVersioned() if versioned else DLManagedTensor()
    tensor = managed.dl_tensor
    tensor.data = pointer
    tensor.device = DLDevice(device_type, device_id)
    tensor.ndim = ndim
    tensor.dtype = DLDataType(code, dtype.itemsize * 8, 1)
    tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # row-major contiguous (allowed since DLPack 0.x; 1.x recommends NULL for compact)
    tensor.byte_offset = 0
    managed.deleter = _DELETER_ADDRESS
    if versioned:
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = FLAG_IS_COPIED if copied else 0
    _sweep()
    address = ctypes.addressof(managed)
    name = VERSIONED_NAME if versioned else NAME
    export = _EXPORTS[address] = _Export(managed, dims, owner, name)
    try:
        export.capsule = _capsule_new(address, name, None)
    except BaseException:
        _EXPORTS.pop(address, None)
        raise
    export.baseline = export.refcount()
    return export.capsule


def live_exports() -> int:
    """How many exported capsules are not yet released (for tests and leak checks)."""
    _sweep()
    return len(_EXPORTS)
