"""``export_chat``: a GGUF model as a static WebGPU chat app (``python -m batchgpu export-chat``).

The folder it writes::

    out/
      index.html      the chat page: a chat box, or a run set by URL parameters (prompt, max_tokens,
                      temperature, top_k, top_p, seed, raw=1, api=1, speculative=K, worker=0, cache=...), whose
                      result ``window.batchgpuChat`` resolves to
      engine.js       ES module: createEngine(base, {worker, cache, f16}) -> an engine with an OpenAI-shaped API
                      (engine.chat.completions.create, engine.completions.create) running the model in worker.js
      batchgpu.js     ES module, the low level: loadModel(base, {onProgress}) -> model; model.generate(ids, options)
      storage.js      the model file kept in browser storage (OPFS, else the Cache API), resumed downloads, SHA-256
      precision.js    the f16 kernels chosen after their self-test, where the adapter offers shader-f16
      plan.js         the program runtime: buffers, pipelines, bind groups, one submit per step
      io.js           file reading (fetch, or the disk under Node)
      tokenizer.js    the model's tokenizer and chat template in JavaScript, with vendor/ (its libraries)
      model.json      the plan: buffers (each weight's place in model.gguf), shaders, pipelines, and per step
                      (decode, prefill_1 ... prefill_<chunk>, verify_2 ... verify_<K+1>) its dispatches, inputs,
                      scalars and outputs; the f16
                      variant (variants.f16) and its self-test (self_test); the model file's size and SHA-256
      shaders/*.wgsl  the WGSL of every kernel the programs run, as the wgpu executor compiles them
      params.bin      every launch's uniform parameters (f16/, self_test/: the variant's and the self-test's)
      data.bin        the few buffers not taken from the GGUF file as it is (constants, derived weights)
      model.gguf      the model file itself: the page fetches it once and builds each weight buffer from it
      tokenizer.json, chat.json   the vocabulary and the chat template

The steps are :class:`~batchgpu.export.chat_steps.ChatSteps`, recorded for WebGPU's default limits (any
adapter has them) on the numpy reference device; the same batches run in Python give the page's ids.
"""

from __future__ import annotations

import hashlib
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
from ..models.gguf_file import GGUFWeights
from ..models.llama import loading, upload_weights
from ..models.loader import open_weights
from ..progress import Stages
from .chat_steps import SPECULATIVE_TOKENS, ChatSteps, check_speculative_tokens
from .plan import WEBGPU_DEFAULT_LIMITS
from .precision import self_test_program, self_test_shapes
from .program import Program, ProgramStep, build_program, write_programs
from .text_assets import write_text_assets
from .webgpu import check_out_dir
from .weight_sources import weight_sources

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
    "storage.js",
    "precision.js",
    "engine.js",
    "worker.js",
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
    f16: bool = True,
    speculative_tokens: int = SPECULATIVE_TOKENS,
) -> Path:
    """Write the chat app of the GGUF file ``model`` into ``out_dir`` (empty, or an earlier export) and return
    its path. ``max_context``: the KV cache's positions (prompt and reply); ``chunk``: the largest prefill
    step (a power of two); ``features``: the optional WebGPU features the target browsers offer (default: core
    WebGPU); ``gpu_kernels``: the GPU forms of kernels that have one (``False``: the CPU-driver forms, faster on
    a CPU WebGPU such as SwiftShader); ``copy_model``: copy the GGUF file in (``False``: a hard link where the
    file system allows, else a copy); ``limits``: WebGPU limits (``max_*``, underscored) lower than its defaults
    that the target devices have (a matrix over ``max_storage_buffer_binding_size`` is held as row pieces);
    ``f16``: also write the f16 variant and its self-test (:mod:`batchgpu.export.precision`), which the page
    runs where the adapter offers ``shader-f16`` and the self-test passes; ``speculative_tokens``: the most tokens
    the page's speculative decoding (prompt lookup) drafts per step, whose verify steps of 2 to
    ``speculative_tokens`` + 1 rows the export holds (0: none, and no ``speculative`` option in the page).

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
    check_speculative_tokens(speculative_tokens, max_context, "export_chat")
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
        shape = {"max_context": max_context, "chunk": chunk, "speculative_tokens": speculative_tokens}
        steps = ChatSteps(device, weights.config, uploaded, **shape)
        stages.phase("planning the steps", name="planning")
        read = device.executor.read_resident
        sources = weight_sources(weights.file, weights.config, uploaded, lambda s: read(s).tobytes())
        offered = {str(f) for f in features}
        plan = dict(sources=sources, offered=offered, gpu_kernels=gpu_kernels)
        main = build_program(_program_steps(steps), device.limits, read, **plan)  # type: ignore[arg-type]
        programs = [("", main)]
        manifest: dict[str, Any] = {"format": FORMAT, **main.entry}
        expected = b""
        if f16:
            stages.phase("planning the f16 variant", name="planning f16")
            halves = ChatSteps(device, weights.config, uploaded, **shape, kv_dtype=np.float16)
            plan["offered"] = offered | {"shader-f16"}
            variant = build_program(_program_steps(halves, half=True), device.limits, read, **plan)  # type: ignore[arg-type]
            variant.entry["kv_dtype"] = "float16"
            shapes = self_test_shapes(weights.config, uploaded, max_context)
            test, expected = self_test_program(device, shapes, read, gpu_kernels=gpu_kernels, offered=plan["offered"])
            programs += [("f16/", variant), ("self_test/", test)]
            manifest["variants"] = {"f16": variant.entry}
            manifest["self_test"] = test.entry
        manifest["model"] = {**_model_entry(weights, max_context, chunk), "speculative_tokens": speculative_tokens}
        manifest["weights"] = {"file": MODEL_FILE, "bytes": path.stat().st_size, "sha256": _sha256(path, stages)}
        codec = weights.codec()
        _write(out, manifest, programs, expected)
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


def _program_steps(steps: ChatSteps, *, half: bool = False) -> dict[str, ProgramStep]:
    return {
        name: ProgramStep(step.batch, step.inputs, {step.output: step.next_id}, step.tokens, half=half)
        for name, step in steps.steps.items()
    }


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


# writing ---------------------------------------------------------------------------------------------


def _write(out: Path, manifest: dict[str, Any], programs: list[tuple[str, Program]], expected: bytes) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("f16", "self_test"):  # an earlier export's variant
        shutil.rmtree(out / stale, ignore_errors=True)
    write_programs(out, programs)
    if expected:
        (out / manifest["self_test"]["expected"]["file"]).write_bytes(expected)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    app = resources.files("batchgpu.export") / "app"
    for name in APP_FILES:
        (out / name).write_text((app / name).read_text(encoding="utf-8"), encoding="utf-8")
    vendor = out / "vendor"
    shutil.rmtree(vendor, ignore_errors=True)
    _copy_tree(app / "vendor", vendor)


def _copy_tree(source: Any, target: Path) -> None:
    """``source`` (a folder of the package's resources) copied to ``target``."""
    target.mkdir()
    for item in source.iterdir():
        if item.is_file():
            (target / item.name).write_bytes(item.read_bytes())
        elif item.is_dir() and not item.name.startswith((".", "__")):
            _copy_tree(item, target / item.name)


def _sha256(path: Path, stages: Stages) -> str:
    """The file's SHA-256 (hex): the page checks the bytes it downloads against it before keeping them."""
    stages.phase(f"hashing {path.name}", name="hashing")
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


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
