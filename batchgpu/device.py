"""Device: one executor, its limits and counters, and the tensors resident on it."""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import arguments
from .dtypes import SUPPORTED, as_dtype, host_array
from .errors import ArgumentError, BatchError, DeviceMismatchError, DTypeError, LimitError, ShapeError, UnsupportedError
from .executors import Executor, Stats, create_executor
from .interop import device_name, foreign_array, foreign_device
from .limits import Limits
from .quant import block_bytes, dequantize_words, to_device_words
from .tensor import QuantTensor, Storage, Tensor, TensorDevice, as_shape

ENV_DEVICE = "BATCHGPU_DEVICE"


_device_numbers = itertools.count(1)
"""Devices are numbered in creation order (``Device('wgpu' #2, ...)``)."""


class Device:
    """A compute device behind one executor.

    ``Device()`` uses ``$BATCHGPU_DEVICE`` or else ``"wgpu"`` on the best adapter;
    ``Device("reference")`` is the numpy executor. ``adapter`` picks a wgpu adapter by index,
    summary substring or object. ``poison=True`` fills new output buffers with a sentinel so tests
    catch elements a kernel never writes. ``limits`` lowers ``max_*`` limits below the device's own
    (``{"max_storage_buffer_binding_size": 2**27}``: a browser's binding size on a desktop GPU;
    :meth:`batchgpu.limits.Limits.lowered`).
    """

    def __init__(
        self,
        kind: str | None = None,
        *,
        adapter: Any = None,
        poison: bool = False,
        limits: Mapping[str, int] | None = None,
    ) -> None:
        if kind is not None and not isinstance(kind, str):
            raise ArgumentError(f"Device: kind must be a str such as 'wgpu' or 'reference', got {type(kind).__name__}")
        self.kind = kind or os.environ.get(ENV_DEVICE) or "wgpu"
        self.executor: Executor = create_executor(self.kind, adapter=adapter, poison=poison, limits=limits)
        self.thread = threading.get_ident()  # the one thread allowed to use this device and its batches
        self.number = next(_device_numbers)  # tells apart devices of one kind in reprs and errors

    def check_thread(self, what: str) -> None:
        """Raise BatchError when called from another thread than the one that created the device:
        executors, their caches and counters are not locked, so a Device and its batches belong to one
        thread (run several asyncio tasks on it, or give each thread its own Device)."""
        if threading.get_ident() != self.thread:
            raise BatchError(
                f"{what}: {self!r} was created in thread {self.thread} and is used from thread "
                f"{threading.get_ident()} ({threading.current_thread().name}); a Device and its batches are "
                f"not thread-safe: use them from one thread, or create a Device per thread"
            )

    @property
    def name(self) -> str:
        return self.executor.name

    @property
    def limits(self) -> Limits:
        return self.executor.limits

    @property
    def features(self) -> frozenset[str]:
        return self.executor.features

    @property
    def stats(self) -> Stats:
        """Counters: pipelines_compiled, submits, dispatches, bytes_uploaded, bytes_read, buffers."""
        return self.executor.stats

    def __repr__(self) -> str:
        return f"Device({self.kind!r} #{self.number}, {self.name!r})"

    def check_storable(self, what: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        """Raise if a tensor of ``shape``/``dtype`` cannot live on this device."""
        if not self.executor.supports(dtype):
            raise DTypeError(f"{what}: dtype {dtype.name} is not supported on {self.name} (feature shader-f16 missing)")
        if any(extent <= 0 for extent in shape):
            raise ShapeError(f"{what}: shape {shape} has a zero or negative extent; tensors must be non-empty")
        nbytes = math.prod(shape) * dtype.itemsize
        limit = self.limits.max_storage_buffer_binding_size
        if nbytes > limit:
            raise LimitError(
                f"{what}: tensor of shape {shape} {dtype.name} is {nbytes} bytes; "
                f"max_storage_buffer_binding_size of {self.name} is {limit}"
            )

    def tensor(self, data: Any, dtype: Any = None, *, name: str = "") -> Tensor:
        """Upload ``data`` once as a resident tensor (weights) usable by every batch on this device.

        ``data`` may also be a device array (``__dlpack__`` / ``__cuda_array_interface__``: a torch CUDA
        tensor, a CuPy array) on the same CUDA/ROCm device as a native ``Device("cuda")`` /
        ``Device("hip")``: it is copied device to device, without a host round trip. A resident batchgpu
        tensor of another device is copied through the host (device to device between native devices)."""
        self.check_thread("Device.tensor")
        arguments.text("Device.tensor", "name", name)
        if isinstance(data, Tensor) and not (data.resident and self._same_native_kind(data.device)):
            data = self._host_copy_of(data, name)
        where = foreign_device(data)
        if where is not None:
            return self._tensor_from_device(data, where, dtype, name)
        if hasattr(data, "__dlpack__") and not hasattr(data, "__array__"):
            data = np.from_dlpack(data)  # host memory shared through DLPack only
        array = host_array(data, dtype, what=f"Device.tensor {name}".strip())
        self.check_storable(f"Device.tensor {name}".strip(), array.shape, array.dtype)
        storage = Storage(array.nbytes, "resident", array.dtype)
        self.executor.alloc_resident(storage, array)
        return Tensor(array.shape, array.dtype, storage, device=self, name=name)

    def _same_native_kind(self, other: TensorDevice) -> bool:
        return self.kind in ("cuda", "hip") and other.kind == self.kind

    @staticmethod
    def _host_copy_of(tensor: Tensor, name: str) -> np.ndarray:
        """A resident tensor's values (of this or another device) read to the host; batch tensors have no
        value outside their batch."""
        if not tensor.resident:
            raise ArgumentError(
                f"Device.tensor {name}: {tensor.describe()} is a batch tensor; read its value with "
                f"batch.read(t) and pass that array"
            )
        return tensor.device.read(tensor)

    def _tensor_from_device(self, data: Any, where: tuple[int, int | None], dtype: Any, name: str) -> Tensor:
        """Device.tensor of device memory: checks, then the executor's device-to-device copy."""
        what = f"Device.tensor {name}".strip()
        try:
            stream = self.executor.import_stream(*where)
        except DeviceMismatchError as exc:
            raise DeviceMismatchError(
                f"{what}: got a {type(data).__name__} in {device_name(*where)} memory, which {self!r} cannot "
                f"read ({exc}); copy it to the host first (torch: t.cpu().numpy(), CuPy: cupy.asnumpy(a), batchgpu: "
                f"Device.read(t)) or create the tensor on a matching Device('cuda') / Device('hip')"
            ) from None
        foreign = foreign_array(data, stream=stream, what=what)
        assert foreign is not None
        with foreign:  # hands the producer's memory back once copied (or on error)
            source = f"{device_name(foreign.device_type, foreign.device_id)} array"
            if foreign.dtype not in SUPPORTED:
                raise DTypeError(
                    f"{what}: the {source} has dtype {foreign.dtype.name}; expected one of "
                    f"{', '.join(d.name for d in SUPPORTED)} (device arrays are not cast: convert it first, "
                    f"e.g. t.to(torch.float32) / a.astype(cupy.float32))"
                )
            if dtype is not None and as_dtype(dtype, what=what) != foreign.dtype:
                raise DTypeError(
                    f"{what}: the {source} has dtype {foreign.dtype.name}, dtype={np.dtype(dtype).name} was "
                    f"asked; device arrays are not cast: convert it first"
                )
            if not foreign.contiguous:
                raise ShapeError(
                    f"{what}: the {source} of shape {foreign.shape} is not contiguous (byte strides "
                    f"{foreign.strides}); pass a contiguous array (torch: t.contiguous(), CuPy: "
                    f"cupy.ascontiguousarray(a))"
                )
            self.check_storable(what, foreign.shape, foreign.dtype)
            storage = Storage(foreign.nbytes, "resident", foreign.dtype)
            self.executor.alloc_resident_from_device(storage, foreign)
        return Tensor(foreign.shape, foreign.dtype, storage, device=self, name=name)

    def quantized(self, blocks: Any, qtype: str, shape: tuple[int, int], *, name: str = "") -> QuantTensor:
        """Upload a (rows, K) matrix given as GGUF block bytes (a format of :data:`batchgpu.quant.FORMATS`:
        ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, ``"q8_0"``, ``"q4_k"``, ``"q5_k"``, ``"q6_k"``, ``"f16"``,
        ``"bf16"``; a uint8 array, ``bytes`` or ``memoryview``, as GGUF
        readers hand them out) once; kernels read the blocks and dequantize in registers."""
        self.check_thread("Device.quantized")
        arguments.text("Device.quantized", "name", name)
        arguments.text("Device.quantized", "qtype", qtype)
        what = f"Device.quantized {name}".strip()
        dims = as_shape(shape, what=what)
        if len(dims) != 2 or min(dims) <= 0:
            raise ShapeError(f"{what}: shape must be (rows, K) with positive extents, got {shape!r}")
        words = to_device_words(block_bytes(blocks, what), qtype, dims)
        self.check_storable(what, words.shape, words.dtype)
        storage = Storage(words.nbytes, "resident", words.dtype)
        self.executor.alloc_resident(storage, words)
        return QuantTensor(dims, storage, qtype.lower(), device=self, name=name)

    def _check_resident(self, what: str, tensor: Tensor) -> None:
        self.check_thread(what)
        if not isinstance(tensor, Tensor) or not tensor.resident:
            raise BatchError(f"{what}: expected a resident tensor from Device.tensor, got {tensor!r}")
        if tensor.device is not self:
            raise DeviceMismatchError(
                f"{what}: {tensor.describe()} lives on another device ({tensor.device!r}), not on this one ({self!r})"
            )

    def write(self, tensor: Tensor, data: Any) -> None:
        """Overwrite a resident tensor with new data of the same shape and dtype."""
        self._check_resident("Device.write", tensor)
        if isinstance(tensor, QuantTensor):
            raise UnsupportedError(
                f"Device.write: {tensor.describe()} holds packed blocks; upload new blocks with Device.quantized"
            )
        array = host_array(data, what=f"Device.write {tensor.name}")
        if array.dtype != tensor.dtype:
            raise DTypeError(
                f"Device.write: {tensor.describe()} expects dtype {tensor.dtype.name}, got {array.dtype.name}"
            )
        if array.shape != tensor.shape:
            raise ShapeError(f"Device.write: {tensor.describe()} expects shape {tensor.shape}, got {array.shape}")
        self.executor.write_resident(tensor.storage, array)

    def read(self, tensor: Tensor) -> np.ndarray:
        """Copy a resident tensor to a numpy array (blocking); quantized weights come back dequantized to
        float32, the values their kernels compute with."""
        self._check_resident("Device.read", tensor)
        flat = self.executor.read_resident(tensor.storage)
        if isinstance(tensor, QuantTensor):
            return dequantize_words(flat, tensor.qtype, tensor.shape)
        return flat[: tensor.size].reshape(tensor.shape)

    async def read_async(self, tensor: Tensor) -> np.ndarray:
        """:meth:`read` for asyncio code, named like the batch's pair (a resident tensor's copy is
        immediate)."""
        return self.read(tensor)
