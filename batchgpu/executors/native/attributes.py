"""What launches are checked against on a native device: its queried attributes, the WebGPU-named
limits batch recording checks, and :func:`check_native_launch`, run before any launch is planned."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ... import cuda_source
from ...errors import DeviceError, LimitError
from ...kernels import Launch
from ...limits import Limits, split_groups
from .driver import Driver


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
    return split_groups(launch.groups, attrs.max_grid_dim[0])


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
