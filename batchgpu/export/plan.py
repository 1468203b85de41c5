"""The WebGPU program a browser runs, as JSON: buffers, shaders, pipelines and dispatch lists.

One :class:`ProgramPlan` holds what every dispatch list of an export shares: one buffer per storage, one
shader module per distinct WGSL source, one pipeline per (shader, entry, constants, layout), one params
uniform buffer, and the WebGPU limits all of them need. ``export_webgpu`` adds one recorded batch to it;
``export_chat`` adds each step of a decoder (the decode step and the prefill chunks), whose resident
buffers (weights, KV cache) are then one buffer each, shared by every step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..executors.base import padded
from ..executors.wgpu_plan import LaunchLayout, PipelineSpec, WgpuLayout
from ..scalars import SCALAR_BYTES
from ..tensor import Storage

PARAMS_ALIGN = 256
"""Uniform parameter offsets: 256 is the largest minUniformBufferOffsetAlignment WebGPU allows, so the
layout is valid on every browser device."""


def _starting_needs() -> dict[str, int]:
    return {
        "maxStorageBufferBindingSize": 0,
        "maxBufferSize": SCALAR_BYTES,
        "maxStorageBuffersPerShaderStage": 0,
        "maxUniformBufferBindingSize": SCALAR_BYTES,
        "maxComputeWorkgroupStorageSize": 0,
        "maxComputeInvocationsPerWorkgroup": 1,
        "maxComputeWorkgroupSizeX": 1,
        "maxComputeWorkgroupSizeY": 1,
        "maxComputeWorkgroupSizeZ": 1,
        "maxComputeWorkgroupsPerDimension": 1,
    }


class ProgramPlan:
    """Buffers, shaders, pipelines, params and limits shared by the dispatch lists added with :meth:`add`."""

    def __init__(self, storages: Sequence[Storage] = ()) -> None:
        self.storages: list[Storage] = []
        self.index: dict[Storage, int] = {}
        self.shaders: list[dict[str, Any]] = []
        self.sources: list[str] = []
        self.pipelines: list[dict[str, Any]] = []
        self.params = bytearray()
        self.needs = _starting_needs()
        self._shader_index: dict[str, int] = {}
        self._pipeline_index: dict[tuple, int] = {}
        for storage in storages:
            self.buffer(storage)

    def buffer(self, storage: Storage) -> int:
        """The buffer index of ``storage`` (a new buffer the first time)."""
        if storage not in self.index:
            self.index[storage] = len(self.storages)
            self.storages.append(storage)
        return self.index[storage]

    def add(self, layout: WgpuLayout, aliases: Mapping[Storage, Storage] | None = None) -> list[dict[str, Any]]:
        """The dispatches of ``layout`` (one batch's planned launches), in order; their parameters are
        appended to the shared params buffer. ``aliases``: storages that share a buffer (a
        :class:`~batchgpu.memory.BufferPlan`'s), bound by their own size at its start."""
        base = self._append_params(layout.params)
        return [self._dispatch(planned, base, aliases or {}) for planned in layout.launches]

    def _append_params(self, params: bytes) -> int:
        base = -len(self.params) % PARAMS_ALIGN + len(self.params)
        self.params.extend(bytes(base - len(self.params)) + params)
        return base

    def _dispatch(self, planned: LaunchLayout, params_base: int, aliases: Mapping[Storage, Storage]) -> dict[str, Any]:
        launch, pipeline = planned.launch, planned.pipeline
        bindings = []
        storage_count = 0
        for entry in planned.entries:
            if entry.kind == "params":
                offset = params_base + entry.offset
                bindings.append({"binding": entry.slot, "kind": "uniform", "offset": offset, "size": entry.size})
                self._need("maxUniformBufferBindingSize", entry.size)
            elif entry.kind == "scalars":
                bindings.append({"binding": entry.slot, "kind": "scalars"})
            else:
                assert entry.storage is not None
                storage_count += 1
                buffer = self.buffer(aliases.get(entry.storage, entry.storage))
                bindings.append({"binding": entry.slot, "kind": "storage", "buffer": buffer, "size": entry.size})
                self._need("maxStorageBufferBindingSize", entry.size)
        x, y, z = launch.workgroup_size
        self._need("maxStorageBuffersPerShaderStage", storage_count)
        self._need("maxComputeWorkgroupStorageSize", launch.workgroup_bytes)
        self._need("maxComputeInvocationsPerWorkgroup", x * y * z)
        for axis, size in zip("XYZ", (x, y, z)):
            self._need(f"maxComputeWorkgroupSize{axis}", size)
        # a 1-D count g is split over x/y by the page: it fits when the per-dimension limit is >= ceil(sqrt(g))
        grid = (math.isqrt(launch.groups - 1) + 1,) if isinstance(launch.groups, int) else launch.groups
        self._need("maxComputeWorkgroupsPerDimension", *grid)
        return {
            "label": launch.label,
            "pipeline": self._pipeline(pipeline),
            "groups": launch.groups if isinstance(launch.groups, int) else list(launch.groups),
            "bindings": bindings,
        }

    def _pipeline(self, pipeline: PipelineSpec) -> int:
        if pipeline.source not in self._shader_index:
            self._shader_index[pipeline.source] = len(self.shaders)
            self.shaders.append({"file": f"shaders/{len(self.shaders)}.wgsl", "label": pipeline.shader_name})
            self.sources.append(pipeline.source)
        shader = self._shader_index[pipeline.source]
        key = (shader, pipeline.entry, tuple(sorted(pipeline.constants.items())), pipeline.layout)
        if key not in self._pipeline_index:
            self._pipeline_index[key] = len(self.pipelines)
            layout: Any = "auto"
            if pipeline.layout is not None:
                layout = {"storage": pipeline.layout[0], "uniform": pipeline.layout[1]}
            self.pipelines.append(
                {
                    "shader": shader,
                    "entry": pipeline.entry,
                    "constants": pipeline.constants,
                    "layout": layout,
                    "label": pipeline.label,
                }
            )
        return self._pipeline_index[key]

    def _need(self, limit: str, *values: int) -> None:
        self.needs[limit] = max(self.needs[limit], *values)

    def buffer_entries(self, names: Mapping[Storage, str]) -> list[dict[str, Any]]:
        """One entry per buffer: its name (``names``, else kind and id), kind, dtype, padded size and bytes."""
        entries = []
        for storage in self.storages:
            entry = {
                "name": names.get(storage, f"{storage.kind}{storage.id}"),
                "kind": storage.kind,
                "dtype": storage.dtype.name,
                "size": padded(storage.nbytes),
                "bytes": storage.nbytes,
            }
            self._need("maxBufferSize", entry["size"])
            entries.append(entry)
        return entries

    def limits(self) -> dict[str, int]:
        """The WebGPU limits every buffer and dispatch added so far needs (call after :meth:`buffer_entries`)."""
        self._need("maxBufferSize", len(self.params))
        return dict(self.needs)


WEBGPU_DEFAULT_LIMITS = {
    "max_storage_buffer_binding_size": 134217728,
    "max_buffer_size": 268435456,
    "max_storage_buffers_per_shader_stage": 8,
    "max_uniform_buffer_binding_size": 65536,
    "max_compute_workgroup_storage_size": 16384,
    "max_compute_invocations_per_workgroup": 256,
    "max_compute_workgroup_size_x": 256,
    "max_compute_workgroup_size_y": 256,
    "max_compute_workgroup_size_z": 64,
    "max_compute_workgroups_per_dimension": 65535,
}
"""WebGPU's default limits (every adapter offers them): what a program recorded for any browser may assume."""
