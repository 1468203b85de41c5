"""The wgpu planning rules, in one place: what each launch compiles to and what it binds.

The wgpu executor (:meth:`WgpuExecutor.plan <batchgpu.executors.wgpu.WgpuExecutor.plan>` and its
pipeline cache) and the WebGPU export derive pipelines, the params uniform buffer and bind groups from
these functions, so a browser runs exactly what the executor runs:

- :func:`pipeline_spec`: a launch's WGSL source (custom kernel or rendered family), the shader's display
  name, entry point, override constants, bind group layout (``"auto"``, or explicit for custom kernels)
  and the pipeline cache key.
- :func:`params_layout`: every launch's parameters packed into one uniform buffer, each at an offset
  aligned to ``min_uniform_buffer_offset_alignment``.
- :func:`bind_entries`: a launch's bind group entries: binding slot -> params range, the scalars
  buffer, or a storage with the bytes bound.
- :func:`plan_launches`: all three for a list of launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..kernels import Launch
from ..scalars import SCALAR_BYTES
from ..shaders import render_wgsl
from ..tensor import Storage
from .base import padded

MIN_PARAMS_BYTES = 16
"""Bytes a launch's slot in the params buffer takes at least (before alignment)."""


class PipelineSpec(NamedTuple):
    """What one launch's compute pipeline is made of."""

    key: tuple
    """The pipeline cache key: ``(source, entry, constants, layout or False)``; equal keys share a
    pipeline (the on-disk pipeline index hashes it too, see :mod:`batchgpu.cache`)."""
    source: str
    """The WGSL source: a custom kernel's, or the family rendered with its type aliases and snippets."""
    shader_name: str
    """``"shaders/wgsl/<family>.wgsl"`` or ``"kernel <name>"``: shader module label, error messages."""
    entry: str
    constants: dict[str, float]
    """Override constants as the pipeline descriptor takes them."""
    layout: tuple[int, bool] | None
    """Custom kernels: an explicit layout of ``(storage bindings, whether a uniform follows them)``,
    bindings ``0..n-1`` read_write storage then the uniform at ``n``; None: ``layout="auto"``."""
    label: str
    """``"<op label>:<entry>"``, the pipeline's label."""


class BindEntry(NamedTuple):
    """One entry of a launch's bind group (group 0)."""

    slot: int
    kind: str
    """``"params"`` (a range of the params buffer), ``"scalars"`` (the per-execute scalars buffer, whole)
    or ``"storage"`` (a storage's buffer from offset 0)."""
    offset: int
    """Byte offset in the params buffer (``"params"``); 0 otherwise."""
    size: int
    """Bytes bound: the launch's params, :data:`~batchgpu.scalars.SCALAR_BYTES`, or the storage's bytes
    padded to whole words (a shared buffer may be larger)."""
    storage: Storage | None = None


class LaunchLayout(NamedTuple):
    """A launch as wgpu runs it: its pipeline, its slot in the params buffer and its bind group entries."""

    launch: Launch
    pipeline: PipelineSpec
    params_offset: int
    entries: tuple[BindEntry, ...]


class WgpuLayout(NamedTuple):
    """:func:`plan_launches`' result."""

    launches: tuple[LaunchLayout, ...]
    params: bytes
    """The params uniform buffer's contents (empty: no launch has parameters, no buffer needed)."""


def wgsl_source(launch: Launch) -> str:
    """The WGSL ``launch`` compiles: its custom kernel's, or its family rendered (types, snippets)."""
    return launch.kernel.wgsl if launch.kernel else render_wgsl(launch.family, launch.types, launch.snippets)


def shader_name(launch: Launch) -> str:
    return f"kernel {launch.kernel.name}" if launch.kernel else f"shaders/wgsl/{launch.family}.wgsl"


def custom_layout(launch: Launch) -> tuple[int, bool] | None:
    """A custom kernel's explicit bind group layout ``(storage bindings, has uniform)``; None for
    built-in kernels (``layout="auto"``)."""
    if launch.kernel is None:
        return None
    uniform = any(b.kind == "uniform" for b in launch.bindings)
    return (len(launch.bindings) - uniform, uniform)


def pipeline_key(launch: Launch, source: str | None = None) -> tuple:
    """The pipeline cache key of ``launch`` (``source``: its :func:`wgsl_source`, when known)."""
    if source is None:
        source = wgsl_source(launch)
    return (source, launch.entry, launch.constants, launch.kernel is not None and custom_layout(launch))


def pipeline_spec(launch: Launch) -> PipelineSpec:
    """Everything ``launch``'s compute pipeline is made of (see :class:`PipelineSpec`)."""
    source = wgsl_source(launch)
    return PipelineSpec(
        key=pipeline_key(launch, source),
        source=source,
        shader_name=shader_name(launch),
        entry=launch.entry,
        constants={name: float(value) for name, value in launch.constants},
        layout=custom_layout(launch),
        label=f"{launch.label}:{launch.entry}",
    )


def params_layout(launches: Sequence[Launch], align: int) -> tuple[list[int], bytes]:
    """The params uniform buffer of ``launches``: each launch's offset, and the packed bytes.

    A launch with parameters (or a uniform binding) takes ``max(len(params), 16)`` bytes rounded up to
    ``align`` (the device's ``min_uniform_buffer_offset_alignment``; an export for any browser uses
    256, WebGPU's largest); a launch without takes none (its offset is where the next slot starts).
    Empty bytes: no launch has parameters."""
    offsets, total = [], 0
    for launch in launches:
        offsets.append(total)
        if launch.params or any(b.kind == "uniform" for b in launch.bindings):
            total += -(-max(len(launch.params), MIN_PARAMS_BYTES) // align) * align
    data = bytearray(total)
    for launch, offset in zip(launches, offsets):
        data[offset : offset + len(launch.params)] = launch.params
    return offsets, bytes(data)


def bind_entries(launch: Launch, params_offset: int) -> tuple[BindEntry, ...]:
    """``launch``'s bind group entries, in binding order, with its params at ``params_offset``."""
    entries = []
    for binding in launch.bindings:
        if binding.kind == "uniform":
            entries.append(BindEntry(binding.slot, "params", params_offset, len(launch.params)))
        elif binding.kind == "scalars":
            entries.append(BindEntry(binding.slot, "scalars", 0, SCALAR_BYTES))
        else:
            assert binding.storage is not None
            entries.append(BindEntry(binding.slot, "storage", 0, padded(binding.storage.nbytes), binding.storage))
    return tuple(entries)


def plan_launches(launches: Sequence[Launch], align: int) -> WgpuLayout:
    """Pipelines, params buffer and bind group entries of ``launches`` (already in the form the device
    runs: :meth:`Launch.for_gpu` on GPU adapters), params offsets aligned to ``align``."""
    offsets, params = params_layout(launches, align)
    planned = tuple(
        LaunchLayout(launch, pipeline_spec(launch), offset, bind_entries(launch, offset))
        for launch, offset in zip(launches, offsets)
    )
    return WgpuLayout(planned, params)
