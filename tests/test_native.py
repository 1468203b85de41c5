"""The native (CUDA/HIP) executor without a GPU: launch validation against device attributes, the
driver tables, and the executor's planning/packing/copy logic over a stand-in driver library.

The stand-in (``FakeCuda``) keeps "device" memory in host buffers and records launches instead of
running them: it checks what the executor asks of the driver (buffers, argument arrays, copies, graph
capture), not what kernels compute. Kernels compile for real with NVRTC when it is installed.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
from typing import ClassVar

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.errors import DeviceError, LimitError, UnsupportedError
from batchgpu.executors import native
from batchgpu.executors.native import (
    ATTRIBUTES,
    CUDA_ONLY,
    FUNCTIONS,
    HIP_ONLY,
    DeviceAttributes,
    Driver,
    NativeExecutor,
    check_native_launch,
)
from batchgpu.kernels import Binding, Kernel, Launch

H100 = DeviceAttributes(
    name="example H100",
    arch="sm_90",
    max_threads_per_block=1024,
    max_block_dim=(1024, 1024, 64),
    max_grid_dim=(2**31 - 1, 65535, 65535),
    max_shared_memory_per_block=48 * 1024,
    max_shared_memory_per_block_optin=227 * 1024,
    warp_size=32,
    multiprocessor_count=132,
    total_memory=80 * 2**30,
)


def _launch(**overrides) -> Launch:
    fields = dict(label="op", entry="main", groups=1, bindings=(), kernel=Kernel("fn main() {}", name="k"))
    fields.update(overrides)
    return Launch(**fields)


# launch validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(workgroup_size=(2048, 1, 1)), "max threads per block exceeded: 2048 > 1024"),
        (dict(workgroup_size=(1, 1, 128)), "max block dim z exceeded: 128 > 64"),
        (dict(workgroup_size=(16, 16, 16)), "max threads per block exceeded: 4096 > 1024"),
        (dict(groups=(1, 70000, 1)), "max grid dim y exceeded: 70000 > 65535"),
        (dict(groups=(1, 1, 65536)), "max grid dim z exceeded: 65536 > 65535"),
        (dict(groups=(2**31 - 1) * 65536), "max grid dim y exceeded: 65536 > 65535"),
        (dict(workgroup_bytes=64 * 1024), r"shared memory per block \(static\) exceeded: 65536 > 49152"),
        (dict(params=b"\0" * 8192), "kernel parameter bytes exceeded: 8192 > 3968"),
    ],
)
def test_launch_over_the_limits_is_refused(overrides, message):
    with pytest.raises(LimitError, match=message) as info:
        check_native_launch(_launch(**overrides), H100)
    assert "example H100" in str(info.value) and "op:" in str(info.value)


def _attention_launch(cache_len: int, head_dim: int = 64) -> Launch:
    dev = bg.Device("reference")
    b = bg.GpuCommandBatch(dev)
    q = b.upload(np.ones((1, 2, head_dim), np.float32))
    cache = b.upload(np.ones((cache_len, 1, head_dim), np.float32))
    b.attention(q, cache, cache, pos=0)
    return b.nodes[-1].launches[0]


def test_dynamic_shared_memory_uses_the_opt_in_limit():
    small = _attention_launch(cache_len=1000)
    grid, dynamic = check_native_launch(small, H100)
    assert grid == (2, 1, 1) and dynamic == 4 * (1000 + 64)
    medium = _attention_launch(cache_len=20000)  # 80 KiB: over 48 KiB, within the 227 KiB opt-in
    assert check_native_launch(medium, H100)[1] == 4 * (20000 + 64)
    large = _attention_launch(cache_len=60000)
    with pytest.raises(LimitError, match=r"shared memory per block \(opt-in\) exceeded: 240512 > 232448"):
        check_native_launch(large, H100)


def test_one_dimensional_groups_split_over_x_and_y():
    assert native.launch_grid(_launch(groups=5), H100) == (5, 1, 1)
    x, y, z = native.launch_grid(_launch(groups=2**31 * 3), H100)
    assert x <= H100.max_grid_dim[0] and x * y >= 2**31 * 3 and z == 1


def test_limits_from_attributes():
    limits = H100.limits()
    assert limits.max_compute_invocations_per_workgroup == 1024
    assert limits.max_compute_workgroup_size_z == 64
    assert limits.max_compute_workgroups_per_dimension == 65535
    assert limits.max_compute_workgroup_storage_size == 227 * 1024
    assert limits.max_storage_buffer_binding_size == 2**32 - 4


# driver tables -----------------------------------------------------------------------------------


def test_driver_tables_name_both_vendors():
    for generic, (cuda, hip, argtypes) in FUNCTIONS.items():
        assert cuda.startswith("cu") and hip.startswith("hip"), generic
        assert isinstance(argtypes, list)
    assert {"func_set_attribute", "get_error_string", "get_error_name"} <= CUDA_ONLY.keys() & HIP_ONLY.keys()
    assert all(len(pair) == 2 for pair in ATTRIBUTES.values())


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_missing_driver_library_is_named(vendor, monkeypatch):
    monkeypatch.setitem(native.LIBRARIES, vendor, ("libdoes-not-exist.so.1",))
    with pytest.raises(UnsupportedError, match=native.MISSING[vendor]):
        Driver(vendor)


class _Symbols:
    """Any attribute is a function returning 0 (a library exporting every symbol)."""

    def __init__(self, missing: set[str] = frozenset()) -> None:
        self._missing = missing

    def __getattr__(self, name: str):
        if name.startswith("_") or name in self._missing:
            raise AttributeError(name)

        def function(*args):
            return 0

        setattr(self, name, function)
        return function


def test_driver_binds_every_symbol_and_reports_missing_ones():
    hip = Driver("hip", lib=_Symbols())
    assert hip.missing == [] and hip.launch_kernel is hip.lib.hipModuleLaunchKernel
    cuda = Driver("cuda", lib=_Symbols({"cuGraphLaunch"}))
    assert cuda.missing == ["cuGraphLaunch"]
    with pytest.raises(UnsupportedError, match="lacks cuGraphLaunch"):
        NativeExecutor("cuda", driver=cuda)


def test_check_names_the_call_and_the_error():
    fake = FakeCuda()
    driver = Driver("cuda", lib=fake)
    driver.check(0, "anything")
    expected = r"cuda: device alloc failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory \(status 2"
    with pytest.raises(DeviceError, match=expected):
        driver.check(2, "device alloc")


# the executor over a stand-in driver -------------------------------------------------------------

CUDA_ATTRIBUTE_VALUES = {
    1: 1024, 2: 1024, 3: 1024, 4: 64, 5: 2**31 - 1, 6: 65535, 7: 65535, 8: 49152,
    10: 32, 16: 132, 75: 9, 76: 0, 97: 232448,
}  # fmt: skip


class FakeCuda:
    """A stand-in libcuda: host memory for device memory, launches recorded, never run."""

    ERRORS: ClassVar[dict] = {2: (b"CUDA_ERROR_OUT_OF_MEMORY", b"out of memory")}

    def __init__(self) -> None:
        self.memory: dict[int, ctypes.Array] = {}
        self.modules: list[bytes] = []
        self.functions: list[bytes] = []
        self.launches: list[tuple] = []
        self.capturing: list[tuple] | None = None
        self.graphs: list[list[tuple]] = []
        self.graph_launches = 0
        self.ids = itertools.count(0x100)

    def _alloc(self, out, size):
        buffer = ctypes.create_string_buffer(size)
        self.memory[ctypes.addressof(buffer)] = buffer
        out._obj.value = ctypes.addressof(buffer)
        return 0

    def _handle(self, out, *rest):
        out._obj.value = next(self.ids)
        return 0

    def _ok(self, *args):
        return 0

    cuInit = cuStreamSynchronize = cuCtxSetCurrent = cuEventRecord = cuEventSynchronize = _ok
    cuEventQuery = cuEventDestroy_v2 = cuGraphDestroy = cuGraphExecDestroy = cuFuncGetAttribute = _ok
    cuFuncSetAttribute = _ok
    cuStreamCreate = cuEventCreate = cuDevicePrimaryCtxRetain = cuGraphInstantiateWithFlags = _handle
    cuMemAlloc_v2 = cuMemAllocHost_v2 = _alloc

    def cuDriverGetVersion(self, out):
        out._obj.value = 13000
        return 0

    def cuDeviceGetCount(self, out):
        out._obj.value = 1
        return 0

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def cuDeviceGetName(self, buffer, size, device):
        buffer.value = b"Fake H100"
        return 0

    def cuDeviceGetAttribute(self, out, attribute, device):
        out._obj.value = CUDA_ATTRIBUTE_VALUES[attribute]
        return 0

    def cuDeviceTotalMem_v2(self, out, device):
        out._obj.value = 80 * 2**30
        return 0

    def cuMemFree_v2(self, pointer):
        self.memory.pop(pointer, None)
        return 0

    cuMemFreeHost = cuMemFree_v2

    def cuMemcpyHtoDAsync_v2(self, dst, src, size, stream):
        ctypes.memmove(dst, src, size)
        return 0

    cuMemcpyDtoHAsync_v2 = cuMemcpyHtoDAsync_v2

    def cuMemsetD8Async(self, dst, value, size, stream):
        ctypes.memset(dst, value, size)
        return 0

    def cuModuleLoadData(self, out, image):
        self.modules.append(image)
        return self._handle(out)

    def cuModuleGetFunction(self, out, module, name):
        self.functions.append(name)
        return self._handle(out)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        record = (function, (gx, gy, gz), (bx, by, bz), shared, params)
        (self.capturing if self.capturing is not None else self.launches).append(record)
        return 0

    def cuStreamBeginCapture_v2(self, stream, mode):
        self.capturing = []
        return 0

    def cuStreamEndCapture(self, stream, out):
        self.graphs.append(self.capturing or [])
        self.capturing = None
        return self._handle(out)

    def cuGraphLaunch(self, executable, stream):
        self.graph_launches += 1
        return 0

    def cuGetErrorName(self, status, out):
        out._obj.value = self.ERRORS.get(status, (b"CUDA_ERROR_UNKNOWN", b""))[0]
        return 0

    def cuGetErrorString(self, status, out):
        out._obj.value = self.ERRORS.get(status, (b"", b"unknown error"))[1]
        return 0


@pytest.fixture
def fake_device(tmp_path, monkeypatch):
    """A Device whose executor is NativeExecutor over FakeCuda (kernels compiled by real NVRTC)."""
    monkeypatch.setenv("BATCHGPU_CACHE_DIR", str(tmp_path))
    from batchgpu import nvrtc

    try:
        nvrtc.compiler("cuda")
    except UnsupportedError as exc:
        pytest.skip(f"NVRTC cannot be loaded: {exc}")
    fake = FakeCuda()
    device = bg.Device.__new__(bg.Device)
    device.kind = "cuda"
    device.executor = NativeExecutor("cuda", driver=Driver("cuda", lib=fake))
    return device, fake


def _argument(params, index: int, nbytes: int = 8) -> bytes:
    return ctypes.string_at(params[index], nbytes)


def test_executor_queries_the_device(fake_device):
    device, _ = fake_device
    assert device.name == "Fake H100 (sm_90)"
    assert device.executor.attrs.max_shared_memory_per_block_optin == 232448
    assert device.limits.max_compute_invocations_per_workgroup == 1024


def test_plan_packs_arguments_once_and_graph_replays(fake_device):
    device, fake = fake_device
    b = bg.GpuCommandBatch(device)
    x = b.upload(np.arange(6, dtype=np.float32).reshape(2, 3))
    y = b.upload(np.ones(3, np.float32))
    z = b.add(x, y)
    b.execute()
    assert fake.modules and fake.modules[0][:4] == b"\x7fELF"  # compiled at plan time: a cubin for sm_90
    assert fake.functions == [b"binary"]
    (_, grid, block, shared, params) = fake.launches[0]
    plan = b._plan
    buffers = plan.buffers
    pointer = int.from_bytes(_argument(params, 0), "little")
    assert pointer == buffers[x.storage].pointer
    assert int.from_bytes(_argument(params, 1), "little") == buffers[y.storage].pointer
    assert int.from_bytes(_argument(params, 2), "little") == buffers[z.storage].pointer
    launch = b.nodes[-1].launches[0]
    assert _argument(params, 3, len(launch.params)) == launch.params  # the Params struct, by value
    assert grid == (1, 1, 1) and block == (256, 1, 1) and shared == 0
    # the uploads landed in device memory; reading an input copies it back
    np.testing.assert_array_equal(b.read_sync(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    # unchanged re-execute: captured once into a graph, then replayed
    b.execute()
    b.execute({x: np.zeros((2, 3), np.float32)})
    assert len(fake.launches) == 1 and len(fake.graphs) == 1 and len(fake.graphs[0]) == 1
    assert fake.graph_launches == 2
    assert fake.functions == [b"binary"]  # nothing recompiled or reloaded
    np.testing.assert_array_equal(b.read_sync(x), np.zeros((2, 3), np.float32))
    # outputs are poison-free zeros here (the fake runs no kernel), read through pinned staging
    assert b.read_sync(z).shape == (2, 3)


def test_scalars_are_written_to_device_memory(fake_device):
    device, fake = fake_device
    b = bg.GpuCommandBatch(device)
    pos = b.scalar("pos")
    q = b.upload(np.ones((1, 2, 8), np.float32))
    b.rope(q, pos)
    b.execute(scalars={"pos": 7})
    (_, _, _, _, params) = fake.launches[0]
    scalars_pointer = int.from_bytes(_argument(params, 6), "little")
    assert scalars_pointer == b._plan.scalars_buffer.pointer
    assert int.from_bytes(ctypes.string_at(scalars_pointer, 4), "little") == 7
    b.execute(scalars={"pos": 9})
    assert int.from_bytes(ctypes.string_at(scalars_pointer, 4), "little") == 9
    assert fake.graph_launches == 1  # same graph, new scalar value through device memory


def test_async_read_and_resident_tensors(fake_device):
    device, _ = fake_device
    w = device.tensor(np.arange(4, dtype=np.int32))
    np.testing.assert_array_equal(device.read(w), np.arange(4, dtype=np.int32))
    device.write(w, np.full(4, 3, np.int32))
    np.testing.assert_array_equal(device.read(w), np.full(4, 3, np.int32))
    b = bg.GpuCommandBatch(device)
    x = b.upload(np.arange(4, dtype=np.int32))
    b.add(x, w)
    b.execute()
    result = asyncio.run(b.read(x))
    np.testing.assert_array_equal(result, np.arange(4, dtype=np.int32))


def test_limits_are_checked_at_record_time(fake_device):
    device, _ = fake_device
    b = bg.GpuCommandBatch(device)
    q = b.upload(np.ones((1, 2, 64), np.float32))
    cache = b.upload(np.ones((60000, 1, 64), np.float32))
    # recording checks the WebGPU-named limits built from the attributes (opt-in shared memory)
    with pytest.raises(LimitError, match=r"max_compute_workgroup_storage_size exceeded: 240512 > 232448 on Fake H100"):
        b.attention(q, cache, cache, pos=0)


def test_binding_slots_cover_every_family():
    assert Binding(0, "read").slot == 0  # argument i is binding slot i
    assert native.cuda_source.FAMILY_ARGS["attention"] == 7
