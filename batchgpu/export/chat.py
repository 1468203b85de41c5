"""``export_chat``: a GGUF model as a static WebGPU chat app (``python -m batchgpu export-chat``).

The folder it writes::

    out/
      index.html      the chat page: a chat box, or a run set by URL parameters (prompt, max_tokens,
                      temperature, top_k, top_p, seed, raw=1), whose result ``window.batchgpuChat`` resolves to
      batchgpu.js     ES module: loadModel(base, {onProgress}) -> model; model.generate(ids, options)
      plan.js         the program runtime: buffers, pipelines, bind groups, one submit per step
      io.js           file reading (fetch, or the disk under Node)
      tokenizer.js    the model's tokenizer and chat template in JavaScript, with vendor/ (its libraries)
      model.json      the plan: buffers (each weight's place in model.gguf), shaders, pipelines, and per step
                      (decode, prefill_1 ... prefill_<chunk>) its dispatches, inputs, scalars and outputs
      shaders/*.wgsl  the WGSL of every kernel the steps run, as the wgpu executor compiles them
      params.bin      every launch's uniform parameters
      data.bin        the few buffers not taken from the GGUF file as it is (constants, derived weights)
      model.gguf      the model file itself: the page fetches it once and builds each weight buffer from it
      tokenizer.json, chat.json   the vocabulary and the chat template

The steps are :class:`~batchgpu.export.chat_steps.ChatSteps`, recorded for WebGPU's default limits (any
adapter has them) on the numpy reference device; the same batches run in Python give the page's ids.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from ..arguments import linked_within, within
from ..device import Device
from ..errors import ArgumentError, UnsupportedError
from ..executors.wgpu_plan import plan_launches
from ..fusion import fuse
from ..memory import share_buffers
from ..models.gguf_file import GGUFWeights
from ..models.llama import loading, upload_weights
from ..models.loader import open_weights
from ..progress import Stages
from ..scalars import SCALAR_BYTES
from ..tensor import Storage
from .chat_steps import ChatSteps
from .plan import PARAMS_ALIGN, WEBGPU_DEFAULT_LIMITS, ProgramPlan
from .text_assets import write_text_assets
from .webgpu import check_out_dir, required_features, storage_names
from .weight_sources import Source, weight_sources

FORMAT = "batchgpu-chat/1"
APP_FILES = (
    "index.html",
    "batchgpu.js",
    "plan.js",
    "io.js",
    "node_gpu.js",
    "package.json",
    "tokenizer.js",
    "chat_template.js",
)
"""The app's own files, copied from the package as they are (``batchgpu/export/app``), with its ``vendor/``."""
MODEL_FILE = "model.gguf"
MANIFEST = "model.json"
"""The plan's file: a folder holding it is an earlier export, which an export may write over."""


def export_chat(
    model: str | Path,
    out_dir: str | Path,
    *,
    max_context: int = 1024,
    chunk: int = 64,
    features: Sequence[str] = (),
    gpu_kernels: bool = True,
    copy_model: bool = True,
    limits: Mapping[str, int] | None = None,
) -> Path:
    """Write the chat app of the GGUF file ``model`` into ``out_dir`` (empty, or an earlier export) and return
    its path. ``max_context``: the KV cache's positions (prompt and reply); ``chunk``: the largest prefill
    step (a power of two); ``features``: the optional WebGPU features the target browsers offer (default: core
    WebGPU); ``gpu_kernels``: the GPU forms of kernels that have one (``False``: the CPU-driver forms, faster on
    a CPU WebGPU such as SwiftShader); ``copy_model``: copy the GGUF file in (``False``: a hard link where the
    file system allows, else a copy); ``limits``: WebGPU limits (``max_*``, underscored) lower than its defaults
    that the target devices have (a matrix over ``max_storage_buffer_binding_size`` is held as row pieces).

    Bad arguments raise ArgumentError, a non-GGUF model UnsupportedError, before anything is written; so does
    a model that writing into ``out`` would reach (:func:`check_model_apart`): an export never deletes or
    overwrites its own input."""
    out = Path(out_dir)
    path = Path(model)
    check_model_apart(path, out)
    if not path.is_file():
        raise ArgumentError(f"export_chat: {path} is not a file; pass a GGUF model file")
    for name, value in (("max_context", max_context), ("chunk", chunk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArgumentError(f"export_chat: {name} must be an int >= 1, got {value!r}")
    if chunk > max_context or chunk & (chunk - 1):
        raise ArgumentError(f"export_chat: chunk must be a power of two <= max_context={max_context}, got {chunk}")
    lowered = {**WEBGPU_DEFAULT_LIMITS, **(limits or {})}
    if any(lowered[name] > WEBGPU_DEFAULT_LIMITS.get(name, lowered[name]) for name in lowered):
        raise ArgumentError(f"export_chat: limits may only lower WebGPU's defaults {WEBGPU_DEFAULT_LIMITS}")
    device = Device("reference", limits=lowered)
    with loading(path) as stages:
        weights = open_weights(path)
        if not isinstance(weights, GGUFWeights):
            raise UnsupportedError(f"export_chat: {path} is not a GGUF file; the app reads its weights from one")
        trained = weights.config.context or max_context
        if max_context > trained:
            raise ArgumentError(f"export_chat: max_context must be <= {trained} (the model's trained length)")
        uploaded = upload_weights(device, weights, fuse=True, stages=stages)
        steps = ChatSteps(device, weights.config, uploaded, max_context=max_context, chunk=chunk)
        stages.phase("planning the steps", name="planning")
        read = device.executor.read_resident
        sources = weight_sources(weights.file, weights.config, uploaded, lambda s: read(s).tobytes())
        manifest, plan, data = _manifest(steps, sources, {str(f) for f in features}, gpu_kernels)
        manifest["model"] = _model_entry(weights, max_context, chunk)
        manifest["weights"] = {"file": MODEL_FILE, "bytes": path.stat().st_size}
        codec = weights.codec()
        _write(out, manifest, plan, data)
        write_text_assets(codec, out)
        _place_model(path, out / MODEL_FILE, copy=copy_model, stages=stages)
    return out


def check_model_apart(model: Path, out: Path) -> None:
    """ArgumentError (naming ``export_chat``) unless ``out`` is a folder to export into (empty, or an earlier
    export: :func:`~batchgpu.export.webgpu.check_out_dir`) that the model file is not part of: not under it (an
    earlier export's model.gguf, the model's own folder, either through a symbolic link) nor linked from it
    (a hard or symbolic link there, as ``--link`` leaves)."""
    inside = within(model, out)
    if inside is not None:
        raise ArgumentError(f"export_chat: the model {model} lies in the output folder (as {inside}); export to "
                            f"another folder, or move the model out first")  # fmt: skip
    check_out_dir(out, "export_chat", MANIFEST)
    linked = linked_within(model, out)
    if linked is not None:
        raise ArgumentError(f"export_chat: the model {model} is the same file as {linked} in the output folder; "
                            f"export to another folder, or remove {linked} first")  # fmt: skip


def _model_entry(weights: GGUFWeights, max_context: int, chunk: int) -> dict[str, Any]:
    config = weights.config
    return {
        "name": weights.path.stem,
        "architecture": config.architecture,
        "vocab": config.vocab,
        "layers": config.layers,
        "hidden": config.hidden,
        "max_context": max_context,
        "chunk": chunk,
    }


# the plan ------------------------------------------------------------------------------------------


def _manifest(
    steps: ChatSteps, sources: Mapping[Storage, Source], offered: set[str], gpu_kernels: bool
) -> tuple[dict[str, Any], ProgramPlan, bytearray]:
    """model.json's plan of every step, the shared program and data.bin's bytes."""
    plan = ProgramPlan()
    required: set[str] = set()
    plans: dict[str, Any] = {}
    host: dict[Storage, np.ndarray] = {}
    names: dict[Storage, str] = {}
    for name, step in steps.steps.items():
        view = step.batch.view()
        keep = frozenset({step.next_id.storage})
        fused = fuse(view.nodes, keep, steps.device.limits, "wgpu", view.host)  # as the executors run it
        shared = share_buffers(fused.nodes, [s for s in view.storages if s not in fused.eliminated], keep)
        launches = [launch.for_gpu() if gpu_kernels else launch for node in fused.nodes for launch in node.launches]
        layout = plan_launches(launches, PARAMS_ALIGN)
        required |= required_features(layout.launches, offered, "export_chat")
        for storage in view.storages:
            if storage.kind in ("input", "const"):
                host[storage] = view.host[storage]
        for storage, label in storage_names(view, step.inputs.values(), [step.next_id]).items():
            names.setdefault(storage, label)
        plans[name] = {
            "tokens": step.tokens,
            "dispatches": plan.add(layout, shared.aliases),
            "inputs": {
                key: {"buffer": plan.buffer(t.storage), "dtype": t.dtype.name, "shape": list(t.shape)}
                for key, t in step.inputs.items()
            },
            "scalars": [{"name": s.name, "dtype": s.dtype, "slot": s.slot} for s in view.scalars],
            "outputs": {
                "next_id": {"buffer": plan.buffer(step.next_id.storage), "dtype": "int32", "bytes": step.next_id.nbytes}
            },
        }
    buffers = plan.buffer_entries(names)
    data = bytearray()
    executor = steps.device.executor
    for entry, storage in zip(buffers, plan.storages):
        if storage in sources:
            entry["source"] = sources[storage]
            continue
        if storage in host:
            initial = np.ascontiguousarray(host[storage])
        elif storage.kind == "resident":
            initial = executor.read_resident(storage)
        else:
            continue  # a step's own buffer: zeros, as WebGPU creates it
        raw = initial.reshape(-1).view(np.uint8)[: storage.nbytes]
        if raw.any():
            entry["data"] = {"offset": len(data), "bytes": int(raw.size)}
            data += raw.tobytes() + bytes(-raw.size % 4)
    manifest = {
        "format": FORMAT,
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
    return manifest, plan, data


# writing ---------------------------------------------------------------------------------------------


def _write(out: Path, manifest: dict[str, Any], plan: ProgramPlan, data: bytearray) -> None:
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "shaders", ignore_errors=True)
    (out / "shaders").mkdir()
    for shader, source in zip(plan.shaders, plan.sources):
        (out / shader["file"]).write_text(source, encoding="utf-8")
    (out / "params.bin").write_bytes(bytes(plan.params))
    (out / "data.bin").write_bytes(bytes(data))
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    app = resources.files("batchgpu.export") / "app"
    for name in APP_FILES:
        (out / name).write_text((app / name).read_text(encoding="utf-8"), encoding="utf-8")
    vendor = out / "vendor"
    shutil.rmtree(vendor, ignore_errors=True)
    vendor.mkdir()
    for item in (app / "vendor").iterdir():
        if item.is_file():
            (vendor / item.name).write_bytes(item.read_bytes())


def _place_model(source: Path, target: Path, *, copy: bool, stages: Stages) -> None:
    """The model at ``target`` (a hard link where asked and the file system allows, else a copy), through
    ``<target>.partial`` renamed over an earlier export's: ``target`` is whole or as it was, never missing."""
    partial = target.with_name(target.name + ".partial")
    partial.unlink(missing_ok=True)
    stages.phase(f"copying {source.name}", name="copying")
    try:
        if copy or not _linked(source, partial):
            shutil.copyfile(source, partial)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _linked(source: Path, target: Path) -> bool:
    """Whether ``target`` could be made a hard link of ``source`` (not across file systems)."""
    try:
        os.link(source, target)
    except OSError:
        return False
    return True
