"""Tensors: shape, dtype and the storage they view. Executor-neutral: no device objects here."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from .errors import ArgumentError, ExportError, ShapeError
from .interop import KDL_CPU, to_dlpack_capsule

_storage_ids = itertools.count()


StorageKind = Literal["input", "resident", "const", "output", "scratch"]


class Storage:
    """A span of device memory. Several tensors (reshape views) may share one storage.

    ``kind`` is one of ``"input"`` (fed by execute), ``"resident"`` (owned by the device),
    ``"const"`` (a literal recorded into the batch), ``"output"`` (written by an op, or ``batch.empty``)
    or ``"scratch"`` (an op's temporary, or a buffer shared by several storages).
    """

    __slots__ = ("id", "nbytes", "kind", "dtype", "__weakref__")

    def __init__(self, nbytes: int, kind: StorageKind, dtype: np.dtype) -> None:
        self.id = next(_storage_ids)
        self.nbytes = nbytes
        self.kind = kind
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"Storage#{self.id}({self.kind}, {self.nbytes} B)"


class TensorBatch(Protocol):
    """The batch a tensor belongs to, as tensors use it: a :class:`~batchgpu.GpuCommandBatch` (a layer above
    this module). Its name, and the ops that operators and methods record (``x + y`` is ``batch.add(x, y)``;
    those named in strings are looked up with ``getattr``)."""

    name: str

    def slice(self, x: Tensor, key: Any, *, name: str = "") -> Tensor: ...

    def cast(self, x: Tensor, dtype: Any, *, name: str = "") -> Tensor: ...


class MemoryExporter(Protocol):
    """A device's executor, as a resident tensor exports its memory through it (DLPack, CUDA array interface)."""

    kind: str

    def dlpack_device(self) -> tuple[int, int]: ...

    def export_resident(self, storage: Storage, *, copy: bool = False) -> tuple[int, Any]: ...


class TensorDevice(Protocol):
    """The device a tensor lives on, as tensors use it: a :class:`~batchgpu.Device` (a layer above this
    module). Its owning thread, its executor's memory export, and reads of resident tensors."""

    kind: str

    @property
    def executor(self) -> MemoryExporter: ...

    def check_thread(self, what: str) -> None: ...

    def read(self, tensor: Tensor) -> np.ndarray: ...


class Tensor:
    """A typed, shaped view of a storage, recorded in a batch or resident on a device.

    Tensors are handles: they hold no data on the host. Read a batch tensor with
    ``batch.read(t)`` / ``await batch.read_async(t)`` and a resident tensor with ``device.read(t)``.
    Resident tensors also export their memory without a copy through ``__dlpack__`` (reference,
    CUDA and HIP devices) and ``__cuda_array_interface__`` (CUDA).
    """

    __slots__ = ("shape", "dtype", "storage", "batch", "device", "name", "__weakref__")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: np.dtype,
        storage: Storage,
        *,
        device: TensorDevice,
        batch: TensorBatch | None = None,
        name: str = "",
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.storage = storage
        self.device = device
        self.batch = batch
        self.name = name or f"t{storage.id}"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def resident(self) -> bool:
        return self.batch is None

    def describe(self) -> str:
        """Short text naming the tensor for error messages."""
        where = "resident" if self.resident else "batch"
        return f"{self.name} ({where}, shape {self.shape}, {self.dtype.name})"

    def __repr__(self) -> str:
        return f"Tensor({self.describe()})"

    # numpy defers to the Tensor's reflected operators (``array + t`` calls ``t.__radd__``, and so do numpy
    # scalars: ``np.sqrt(d) * t``), which take numpy scalars and 0-d arrays as constants and refuse arrays
    # with dimensions with a clear error instead of numpy building an object array of Tensors.
    __array_ufunc__ = None

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise ArgumentError(
            f"np.asarray: {self.describe()} is a handle, not host data; read it with "
            + ("Device.read(t)" if self.resident else "batch.read(t) (or await batch.read_async(t))")
        )

    def __getitem__(self, key: Any) -> Tensor:
        return self._require_batch("[]").slice(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        raise ArgumentError(
            f"{self.describe()}[{key!r}] = ...: tensors are not assigned in place; record a new tensor (batch.where, "
            "batch.concat) or write rows with batch.scatter_rows"
        )

    def _require_batch(self, op: str, other: Any = None) -> TensorBatch:
        """The batch that records ``op``: this tensor's, else the other operand's."""
        batch = self.batch if self.batch is not None else (other.batch if isinstance(other, Tensor) else None)
        if batch is None:
            raise ArgumentError(
                f"{op}: {self.describe()} is resident on the device; record ops on it through a batch "
                f"(batch.{op}(...)) or combine it with a tensor of a batch"
            )
        return batch

    def _binary(self, op: str, other: Any, *, reverse: bool = False) -> Tensor:
        """``batch.op(self, other)`` (``op(other, self)`` with ``reverse``) in the batch of either tensor."""
        batch = self._require_batch(op, other)
        left, right = (other, self) if reverse else (self, other)
        return getattr(batch, op)(left, right)

    def __add__(self, other: Any) -> Tensor:
        return self._binary("add", other)

    def __radd__(self, other: Any) -> Tensor:
        return self._binary("add", other, reverse=True)

    def __sub__(self, other: Any) -> Tensor:
        return self._binary("sub", other)

    def __rsub__(self, other: Any) -> Tensor:
        return self._binary("sub", other, reverse=True)

    def __mul__(self, other: Any) -> Tensor:
        return self._binary("mul", other)

    def __rmul__(self, other: Any) -> Tensor:
        return self._binary("mul", other, reverse=True)

    def __truediv__(self, other: Any) -> Tensor:
        return self._binary("div", other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return self._binary("div", other, reverse=True)

    def __matmul__(self, other: Any) -> Tensor:
        return self._binary("matmul", other)

    def __neg__(self) -> Tensor:
        return self._method("neg")

    def __pow__(self, other: Any) -> Tensor:
        return self._binary("pow", other)

    def __rpow__(self, other: Any) -> Tensor:
        return self._binary("pow", other, reverse=True)

    def __abs__(self) -> Tensor:
        return self._method("abs")

    # Comparisons give uint32 0/1 masks. ``==`` and ``!=`` stay identity tests (tensors are dict keys of
    # ``execute`` feeds); use ``batch.equal`` / ``batch.not_equal`` for elementwise equality.
    def __lt__(self, other: Any) -> Tensor:
        return self._binary("less", other)

    def __le__(self, other: Any) -> Tensor:
        return self._binary("less_equal", other)

    def __gt__(self, other: Any) -> Tensor:
        return self._binary("greater", other)

    def __ge__(self, other: Any) -> Tensor:
        return self._binary("greater_equal", other)

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise ArgumentError(
            f"bool({self.describe()}): a tensor is a handle recorded into a batch, its values unknown until it "
            "runs; read it first (batch.read(t)) to branch on them"
        )

    # numpy / torch style methods: each records the batch op of the same name -----------------------------

    def _method(self, op: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._require_batch(op), op)(self, *args, **kwargs)

    @property
    def T(self) -> Tensor:
        """The axes reversed (``batch.transpose``)."""
        return self._method("transpose")

    def reshape(self, *shape: int | Sequence[int], name: str = "") -> Tensor:
        """``batch.reshape(self, shape)``: one dim may be -1."""
        return self._method("reshape", *shape, name=name)

    def transpose(self, *axes: int, name: str = "") -> Tensor:
        """The axes permuted (reversed without ``axes``), as ``numpy.transpose``."""
        return self._method("transpose", axes or None, name=name)

    def astype(self, dtype: Any, *, name: str = "") -> Tensor:
        """``batch.cast(self, dtype)``."""
        return self._require_batch("cast").cast(self, dtype, name=name)

    def sum(self, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = "") -> Tensor:
        return self._method("sum", axis, keepdims=keepdims, name=name)

    def mean(self, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = "") -> Tensor:
        return self._method("mean", axis, keepdims=keepdims, name=name)

    def max(self, axis: int | Sequence[int] | None = None, *, keepdims: bool = False, name: str = "") -> Tensor:
        return self._method("max", axis, keepdims=keepdims, name=name)

    def argmax(self, axis: int | None = None, *, name: str = "") -> Tensor:
        """The index of the largest value along ``axis`` (None: of the flattened tensor, as numpy)."""
        if axis is None:
            return self.reshape(-1)._method("argmax", -1, name=name)
        return self._method("argmax", axis, name=name)

    def clip(self, lo: Any = None, hi: Any = None, *, name: str = "") -> Tensor:
        return self._method("clip", lo, hi, name=name)

    def abs(self, *, name: str = "") -> Tensor:
        return self._method("abs", name=name)

    def exp(self, *, name: str = "") -> Tensor:
        return self._method("exp", name=name)

    def log(self, *, name: str = "") -> Tensor:
        return self._method("log", name=name)

    def sqrt(self, *, name: str = "") -> Tensor:
        return self._method("sqrt", name=name)

    def tanh(self, *, name: str = "") -> Tensor:
        return self._method("tanh", name=name)

    def sigmoid(self, *, name: str = "") -> Tensor:
        return self._method("sigmoid", name=name)

    def relu(self, *, name: str = "") -> Tensor:
        return self._method("relu", name=name)

    def sin(self, *, name: str = "") -> Tensor:
        return self._method("sin", name=name)

    def cos(self, *, name: str = "") -> Tensor:
        return self._method("cos", name=name)

    def floor(self, *, name: str = "") -> Tensor:
        return self._method("floor", name=name)

    def ceil(self, *, name: str = "") -> Tensor:
        return self._method("ceil", name=name)

    def round(self, *, name: str = "") -> Tensor:
        return self._method("round", name=name)

    def erf(self, *, name: str = "") -> Tensor:
        return self._method("erf", name=name)

    def softmax(self, axis: int = -1, *, name: str = "") -> Tensor:
        return self._method("softmax", axis, name=name)

    # interop: DLPack and __cuda_array_interface__ (see batchgpu.interop) ----------------------------

    def _exported_storage(self, what: str) -> Storage:
        if self.batch is not None:
            raise ExportError(
                f"{what}: {self.describe()} is a batch tensor, whose buffers are the batch's own; read it "
                f"with batch.read(t) / batch.read(t), or upload data with Device.tensor to share it"
            )
        if isinstance(self, QuantTensor):
            raise ExportError(f"{what}: {self.describe()} holds packed {self.qtype} blocks and cannot be exported")
        self.device.check_thread(what)
        return self.storage

    def __dlpack_device__(self) -> tuple[int, int]:
        """DLPack ``(device_type, device_id)``: kDLCPU (1) on the reference device, kDLCUDA (2) /
        kDLROCM (10) on native ones, kDLWebGPU (15) on wgpu (which cannot export)."""
        return self.device.executor.dlpack_device()

    def __dlpack__(
        self, *, stream: Any = None, max_version: tuple[int, int] | None = None, dl_device: Any = None, copy: Any = None
    ) -> Any:
        """A DLPack capsule sharing this resident tensor's memory (zero copy unless ``copy=True``).

        Native devices drain their stream before returning, so the data is ready on any consumer
        ``stream`` (accepted, not needed). Later ``Device.write`` calls, and batches writing the tensor
        in place, change what the consumer sees; the memory stays allocated while the consumer holds it.
        ``max_version >= (1, 0)`` gives a DLPack 1.0 versioned capsule."""
        storage = self._exported_storage("__dlpack__")
        executor = self.device.executor
        device = executor.dlpack_device()
        if stream == 0 and device[0] != KDL_CPU:  # DLPack: 0 is ambiguous on CUDA/ROCm and disallowed
            raise ExportError(f"__dlpack__: stream=0 is disallowed for {self.describe()} (use 1, 2 or a stream handle)")
        if dl_device is not None and tuple(int(x) for x in dl_device) != device:
            raise ExportError(
                f"__dlpack__: {self.describe()} lives on DLPack device {device}, dl_device={tuple(dl_device)} "
                f"was asked; cross-device export is not supported (use Device.read for a host copy)"
            )
        pointer, owner = executor.export_resident(storage, copy=bool(copy))
        versioned = max_version is not None and int(max_version[0]) >= 1
        return to_dlpack_capsule(
            pointer, self.shape, self.dtype, *device, owner, versioned=versioned, copied=bool(copy)
        )

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3 interface of a resident tensor on ``Device("cuda")``. ``stream`` is None: our
        stream is drained before the dict is returned. The consumer must keep this tensor alive."""
        if self.device.executor.kind != "cuda":
            raise AttributeError(
                f"__cuda_array_interface__: {self.describe()} is not in CUDA memory ({self.device!r}); "
                f"use __dlpack__ or Device.read"
            )
        storage = self._exported_storage("__cuda_array_interface__")
        pointer, _ = self.device.executor.export_resident(storage)
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (pointer, False),
            "strides": None,
            "descr": [("", self.dtype.str)],
            "stream": None,
            "version": 3,
        }


class QuantTensor(Tensor):
    """A resident (rows, K) weight matrix stored as GGUF blocks (``qtype``: a format of
    ``batchgpu/quant.py``'s table, such as ``"q4_k"``).

    ``shape``/``dtype`` are the logical float32 matrix; the storage holds the packed words. Use it as
    ``b`` of ``matmul(x, w, transpose_b=True)`` (rows are output features, like a Linear weight) or as
    an ``embedding`` table; kernels dequantize in registers.
    """

    __slots__ = ("qtype",)

    def __init__(
        self, shape: tuple[int, ...], storage: Storage, qtype: str, *, device: TensorDevice, name: str = ""
    ) -> None:
        super().__init__(shape, np.dtype(np.float32), storage, device=device, name=name)
        self.qtype = qtype

    @property
    def nbytes(self) -> int:
        return self.storage.nbytes

    def describe(self) -> str:
        return f"{self.name} (resident {self.qtype}, shape {self.shape})"


def as_shape(shape: Any, *, what: str) -> tuple[int, ...]:
    """A shape given as an int or a sequence of ints (numpy ints too) as a tuple; anything else (floats,
    strings, bools, nested sequences) raises ShapeError naming ``what``."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    if isinstance(dims, (str, bytes)) or not isinstance(dims, (tuple, list, np.ndarray)):
        raise ShapeError(f"{what}: shape must be an int or a sequence of ints, got {shape!r}")
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in dims):
        raise ShapeError(f"{what}: shape {tuple(dims)!r} must hold ints only")
    return tuple(int(d) for d in dims)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements."""
    strides = []
    step = 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))
