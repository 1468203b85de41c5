"""One WebGPU program of an exported app (model.json's plan, its f16 variant, the f16 self-test): named steps,
each a recorded batch fused, its buffers shared and its launches planned as the wgpu executor runs them, over
one set of buffers (a storage two steps use is one buffer); the page's ``plan.js`` ``Program`` builds and runs
it. ``write_programs`` gives each program its files (shader texts shared between programs where equal).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..executors.wgpu_plan import plan_launches
from ..fusion import fuse
from ..limits import Limits
from ..memory import share_buffers
from ..runtime import BatchView
from ..scalars import SCALAR_BYTES
from ..tensor import Storage, Tensor
from .plan import PARAMS_ALIGN, ProgramPlan
from .webgpu import required_features, storage_names


class RecordedBatch(Protocol):
    """A recorded batch (a :class:`~batchgpu.GpuCommandBatch`, a layer above this module)."""

    def view(self) -> BatchView: ...


@dataclass
class ProgramStep:
    """One step of a program: its batch, its inputs and outputs by name (the page writes and reads them), for a
    chat step the tokens it takes, and ``half``: its launches in their half forms
    (:meth:`~batchgpu.kernels.Launch.for_half`: f16 products, which need WebGPU's ``shader-f16``)."""

    batch: RecordedBatch
    inputs: Mapping[str, Tensor]
    outputs: Mapping[str, Tensor]
    tokens: int | None = None
    half: bool = False


@dataclass
class Program:
    """A program's JSON entry (``features``, ``limits``, ``buffers``, ``shaders``, ``pipelines``, ``params``,
    ``data``, ``scalar_bytes``, ``steps``), its plan (shader sources, params bytes) and its data.bin bytes."""

    entry: dict[str, Any]
    plan: ProgramPlan
    data: bytearray = field(default_factory=bytearray)


def build_program(
    steps: Mapping[str, ProgramStep],
    limits: Limits,
    read_resident: Callable[[Storage], np.ndarray],
    *,
    sources: Mapping[Storage, Any] | None = None,
    offered: set[str] = frozenset(),  # type: ignore[assignment]
    gpu_kernels: bool = True,
    what: str = "export_chat",
) -> Program:
    """The program of ``steps``, recorded for a device of ``limits``. ``sources``: where a weight buffer's bytes
    come from in the model file (no data.bin copy); other buffers that start nonzero (inputs, constants,
    resident tensors, read with ``read_resident``) are in data.bin. ``gpu_kernels``: the launches' GPU forms.
    ``offered``: the WebGPU features the target browsers offer (a kernel needing another raises
    UnsupportedError naming ``what``)."""
    sources = sources or {}
    plan = ProgramPlan()
    required: set[str] = set()
    plans: dict[str, Any] = {}
    host: dict[Storage, np.ndarray] = {}
    names: dict[Storage, str] = {}
    for name, step in steps.items():
        view = step.batch.view()
        keep = frozenset(t.storage for t in step.outputs.values())
        fused = fuse(view.nodes, keep, limits, "wgpu", view.host)  # as the executors run it
        shared = share_buffers(fused.nodes, [s for s in view.storages if s not in fused.eliminated], keep)
        launches = [launch.for_gpu() if gpu_kernels else launch for node in fused.nodes for launch in node.launches]
        if step.half:
            launches = [launch.for_half() for launch in launches]
        layout = plan_launches(launches, PARAMS_ALIGN)
        required |= required_features(layout.launches, offered, what)
        for storage in view.storages:
            if storage.kind in ("input", "const"):
                host[storage] = view.host[storage]
        for storage, label in storage_names(view, step.inputs.values(), step.outputs.values()).items():
            names.setdefault(storage, label)
        entry: dict[str, Any] = {} if step.tokens is None else {"tokens": step.tokens}
        plans[name] = {
            **entry,
            "dispatches": plan.add(layout, shared.aliases),
            "inputs": {
                key: {"buffer": plan.buffer(t.storage), "dtype": t.dtype.name, "shape": list(t.shape)}
                for key, t in step.inputs.items()
            },
            "scalars": [{"name": s.name, "dtype": s.dtype, "slot": s.slot} for s in view.scalars],
            "outputs": {
                key: {"buffer": plan.buffer(t.storage), "dtype": t.dtype.name, "bytes": t.nbytes}
                for key, t in step.outputs.items()
            },
        }
    buffers = plan.buffer_entries(names)
    data = bytearray()
    for entry, storage in zip(buffers, plan.storages):
        if storage in sources:
            entry["source"] = sources[storage]
            continue
        if storage in host:
            initial = np.ascontiguousarray(host[storage])
        elif storage.kind == "resident":
            initial = read_resident(storage)
        else:
            continue  # a step's own buffer: zeros, as WebGPU creates it
        raw = initial.reshape(-1).view(np.uint8)[: storage.nbytes]
        if raw.any():
            entry["data"] = {"offset": len(data), "bytes": int(raw.size)}
            data += raw.tobytes() + bytes(-raw.size % 4)
    program = {
        "features": sorted(required),
        "limits": plan.limits(),
        "buffers": buffers,
        "shaders": plan.shaders,
        "pipelines": plan.pipelines,
        "params": {"file": "params.bin", "size": len(plan.params)},
        "data": {"file": "data.bin", "size": len(data)},
        "scalar_bytes": SCALAR_BYTES,
        "steps": plans,
    }
    return Program(program, plan, data)


def write_programs(out: Path, programs: Sequence[tuple[str, Program]]) -> None:
    """Write each program's params.bin and data.bin under its folder (``""``: ``out`` itself, else e.g.
    ``"f16/"``) and every shader text once, as ``shaders/<n>.wgsl`` (programs share the files of equal texts),
    setting the file names in their entries."""
    shutil.rmtree(out / "shaders", ignore_errors=True)
    (out / "shaders").mkdir(parents=True)
    files: dict[str, str] = {}
    for folder, program in programs:
        if folder:
            shutil.rmtree(out / folder, ignore_errors=True)
            (out / folder).mkdir(parents=True)
        for shader, source in zip(program.entry["shaders"], program.plan.sources):
            if source not in files:
                files[source] = f"shaders/{len(files)}.wgsl"
                (out / files[source]).write_text(source, encoding="utf-8")
            shader["file"] = files[source]
        program.entry["params"]["file"] = f"{folder}params.bin"
        program.entry["data"]["file"] = f"{folder}data.bin"
        (out / f"{folder}params.bin").write_bytes(bytes(program.plan.params))
        (out / f"{folder}data.bin").write_bytes(bytes(program.data))
