"""Device limits, queried from the device, and the checks every launch passes before submit."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from .errors import ArgumentError, LimitError

if TYPE_CHECKING:
    from .kernels import Launch

UNLIMITED = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    """The compute limits batchgpu checks; names follow WebGPU's ``GPUSupportedLimits``."""

    max_storage_buffer_binding_size: int = UNLIMITED
    max_buffer_size: int = UNLIMITED
    max_compute_workgroups_per_dimension: int = UNLIMITED
    max_compute_invocations_per_workgroup: int = UNLIMITED
    max_compute_workgroup_size_x: int = UNLIMITED
    max_compute_workgroup_size_y: int = UNLIMITED
    max_compute_workgroup_size_z: int = UNLIMITED
    max_compute_workgroup_storage_size: int = UNLIMITED
    max_storage_buffers_per_shader_stage: int = UNLIMITED
    max_uniform_buffer_binding_size: int = UNLIMITED
    min_uniform_buffer_offset_alignment: int = 1

    @classmethod
    def from_mapping(cls, values: dict[str, int]) -> Limits:
        """Build from a mapping with WebGPU names, dashed (``max-buffer-size``) or underscored."""
        normalized = {key.replace("-", "_"): value for key, value in values.items()}
        return cls(**{f.name: int(normalized[f.name]) for f in fields(cls) if f.name in normalized})

    def lowered(self, wanted: Mapping[str, int] | None, device_name: str) -> Limits:
        """These limits with the ``max_*`` ones ``wanted`` names (WebGPU names, dashed or underscored) lowered
        to its values: a device that behaves like a smaller one (a browser's 128 MiB storage binding on a
        desktop GPU, or tests reaching a size-dependent path with small data). ArgumentError for an unknown
        or non-``max_*`` name or a value that is not a positive int; LimitError for a value above what
        ``device_name`` has."""
        if wanted is None:
            return self
        if not isinstance(wanted, Mapping):
            raise ArgumentError(f"Device: limits must be a mapping of limit names to ints, got {type(wanted).__name__}")
        lowerable = [f.name for f in fields(self) if f.name.startswith("max_")]
        changes = {}
        for key, value in wanted.items():
            name = key.replace("-", "_") if isinstance(key, str) else key
            if name not in lowerable:
                raise ArgumentError(
                    f"Device: limits: {key!r} is not a limit that can be lowered; one of {', '.join(lowerable)}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(f"Device: limits: {name} must be an int >= 1, got {value!r}")
            if value > getattr(self, name):
                raise LimitError(
                    f"Device: limits: {name} {value} is above the {getattr(self, name)} of {device_name}; "
                    f"limits can only be lowered"
                )
            changes[name] = value
        return replace(self, **changes)


def split_groups(groups: int, per_dim: Limits | int) -> tuple[int, int, int]:
    """Spread a 1-D workgroup count over x and y so neither exceeds the per-dimension limit: ``per_dim``,
    or a :class:`Limits`' ``max_compute_workgroups_per_dimension`` (the native executors pass their
    grid's x limit, :func:`batchgpu.executors.native.launch_grid`).

    Kernels recover the linear index as ``wg.x + wg.y * num_workgroups.x`` and bounds-check it.
    """
    if isinstance(per_dim, Limits):
        per_dim = per_dim.max_compute_workgroups_per_dimension
    if groups <= per_dim:
        return (max(groups, 1), 1, 1)
    y = math.ceil(groups / per_dim)
    x = math.ceil(groups / y)
    return (x, y, 1)


def check_launch(launch: Launch, limits: Limits, device_name: str) -> None:
    """Raise LimitError naming the op, the limit and both values if ``launch`` exceeds ``limits``."""

    def fail(limit: str, actual: int, allowed: int) -> None:
        raise LimitError(
            f"{launch.label}: {limit} exceeded: {actual} > {allowed} on {device_name} ({launch.describe()})"
        )

    for axis, size in zip("xyz", launch.workgroup_size):
        allowed = getattr(limits, f"max_compute_workgroup_size_{axis}")
        if size > allowed:
            fail(f"max_compute_workgroup_size_{axis}", size, allowed)
    invocations = math.prod(launch.workgroup_size)
    if invocations > limits.max_compute_invocations_per_workgroup:
        fail("max_compute_invocations_per_workgroup", invocations, limits.max_compute_invocations_per_workgroup)
    if launch.workgroup_bytes > limits.max_compute_workgroup_storage_size:
        fail("max_compute_workgroup_storage_size", launch.workgroup_bytes, limits.max_compute_workgroup_storage_size)
    storage_count = sum(1 for b in launch.bindings if b.kind in ("read", "write"))
    if storage_count > limits.max_storage_buffers_per_shader_stage:
        fail("max_storage_buffers_per_shader_stage", storage_count, limits.max_storage_buffers_per_shader_stage)
    per_dim = limits.max_compute_workgroups_per_dimension
    grid = split_groups(launch.groups, limits) if isinstance(launch.groups, int) else launch.groups
    for axis, count in zip("xyz", grid):
        if count > per_dim:
            fail(f"max_compute_workgroups_per_dimension ({axis})", count, per_dim)
    for binding in launch.bindings:
        kind = "uniform" if binding.kind in ("uniform", "scalars") else "storage"
        allowed = getattr(limits, f"max_{kind}_buffer_binding_size")
        if binding.nbytes > allowed:
            fail(f"max_{kind}_buffer_binding_size (binding {binding.slot})", binding.nbytes, allowed)
