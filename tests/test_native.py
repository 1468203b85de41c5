"""The native (CUDA/HIP) executor without a GPU: launch validation against device attributes and the
driver tables. Nothing here stands in for a driver: what needs libcuda/libamdhip64 runs in
tests/test_native_ops.py on a machine that has one, and skips elsewhere with the reason."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import cuda_source
from batchgpu.errors import LimitError, UnsupportedError
from batchgpu.executors import native
from batchgpu.executors.native import (
    ATTRIBUTES,
    CUDA_ONLY,
    FUNCTIONS,
    HIP_ONLY,
    DeviceAttributes,
    Driver,
    check_native_launch,
)
from batchgpu.kernels import Binding, Kernel, Launch
from batchgpu.limits import split_groups

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


def _attention_launches(cache_len: int, head_dim: int = 64) -> list[Launch]:
    dev = bg.Device("reference")
    b = bg.GpuCommandBatch(dev)
    q = b.upload(np.ones((1, 2, head_dim), np.float32))
    cache = b.upload(np.ones((cache_len, 1, head_dim), np.float32))
    b.attention(q, cache, cache, pos=0)
    return b.nodes[-1].launches


def test_dynamic_shared_memory_uses_the_opt_in_limit():
    (small,) = _attention_launches(cache_len=1000)
    grid, dynamic = check_native_launch(small, H100)
    assert grid == (2, 1, 1) and dynamic == 4 * (1000 + 64)
    # a long cache is taken in blocks of rows: its scores stay within WebGPU's default 16 KiB
    partial = _attention_launches(cache_len=20000)[0]
    assert partial.entry == "attention_partial" and check_native_launch(partial, H100)[1] <= 16384
    # the opt-in path, for a launch asking more than the 48 KiB static limit
    medium = replace(small, constants=(("SMAX", 20000), ("HEAD_DIM", 64)))
    assert check_native_launch(medium, H100)[1] == 4 * (20000 + 64)
    large = replace(small, constants=(("SMAX", 60000), ("HEAD_DIM", 64)))
    with pytest.raises(LimitError, match=r"shared memory per block \(opt-in\) exceeded: 240256 > 232448"):
        check_native_launch(large, H100)


def test_one_dimensional_groups_split_over_x_and_y():
    assert native.launch_grid(_launch(groups=5), H100) == (5, 1, 1)
    x, y, z = native.launch_grid(_launch(groups=2**31 * 3), H100)
    assert x <= H100.max_grid_dim[0] and x * y >= 2**31 * 3 and z == 1
    # one split rule for wgpu and the native executors: split_groups with the grid's x limit
    for groups in (1, 4095, 4096, 4097, 10**6, 2**31 * 3):
        assert native.launch_grid(_launch(groups=groups), H100) == split_groups(groups, H100.max_grid_dim[0])
    assert native.launch_grid(_launch(groups=(3, 2, 1)), H100) == (3, 2, 1)


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
    assert {"get_error_string", "get_error_name"} <= CUDA_ONLY.keys() & HIP_ONLY.keys()
    assert "func_set_attribute" in CUDA_ONLY
    assert all(len(pair) == 2 for pair in ATTRIBUTES.values())


def test_one_executor_and_driver_class_per_vendor():
    assert {kind: cls.kind for kind, cls in native.EXECUTORS.items()} == {"cuda": "cuda", "hip": "hip"}
    assert all(issubclass(cls, native.NativeExecutor) for cls in (native.CudaExecutor, native.HipExecutor))
    assert (native.CudaDriver.vendor, native.HipDriver.vendor) == ("cuda", "hip")
    assert {"module_unload", "event_destroy", "graph_exec_destroy"} <= FUNCTIONS.keys()  # owning objects' frees
    with pytest.raises(UnsupportedError, match="unknown vendor 'metal'"):
        Driver("metal")


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_missing_driver_library_is_named(vendor, monkeypatch):
    monkeypatch.setitem(native.LIBRARIES, vendor, ("libdoes-not-exist.so.1",))
    with pytest.raises(UnsupportedError, match=native.MISSING[vendor]):
        Driver(vendor)


def test_binding_slots_cover_every_family():
    assert Binding(0, "read").slot == 0  # argument i is binding slot i
    assert cuda_source.argument_count(_attention_launches(cache_len=8)[0]) == 15  # the 15 slots of the family
