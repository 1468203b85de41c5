"""Export a recorded batch as a standalone WebGPU program: the same WGSL, run by a browser.

``export_webgpu(batch, out_dir, feeds, scalars)`` writes::

    out_dir/
      index.html          opens the batch on navigator.gpu, checks it against expected/, shows timings
      batch.js            ES module: load(), requestDevice(adapter), prepare(device), run(device, inputs, scalars),
                          names(), check(); inputs, scalars and outputs go by name (the tensors' names)
      io.js, node_gpu.js  what batch.js reads files and gets the GPU with, in browsers and under Node
                          (``batchgpu.export.node.run_node("batch.js", out_dir, function="check")``)
      package.json        ``"type": "module"``: Node reads the .js files as ES modules
      manifest.json       buffers, shaders, pipelines (entry point, override constants, layout),
                          dispatches (pipeline, bindings, workgroup counts), inputs, scalars, outputs,
                          required features and limits
      shaders/<i>.wgsl    the WGSL sources, exactly as the wgpu executor compiles them
      params.bin          every launch's uniform parameters, each at a 256-byte aligned offset
      data/<i>.bin        initial contents of buffer i: inputs (the feeds), constants, resident tensors
                          (weights) and in-place state
      expected/<i>.bin    output i as computed by the batch's own device for these inputs

The plan mirrors the wgpu executor: one buffer per storage, ``layout: "auto"`` for built-in kernels
and an explicit layout (every buffer ``storage`` read_write, then the optional uniform) for custom
kernels, one compute pass with every dispatch, the readback copies, one submit. 1-D workgroup counts
are kept 1-D in the manifest and split over x/y by ``batch.js`` with the browser device's own
``maxComputeWorkgroupsPerDimension``.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import BatchError, ExportError, UnsupportedError
from ..executors.base import POISON_BYTE
from ..executors.wgpu_plan import LaunchLayout, WgpuLayout, plan_launches
from ..kernels import Launch
from ..runtime import BatchView
from ..scalars import SCALAR_BYTES
from ..tensor import Storage, Tensor
from .plan import PARAMS_ALIGN, ProgramPlan

FORMAT = "batchgpu-webgpu/1"
TEMPLATE_FILES = ("index.html", "batch.js")
APP_FILES = ("io.js", "node_gpu.js", "plan.js", "package.json")
"""From the app sources (batchgpu/export/app/): the modules batch.js imports (reading files, and the GPU, in
browsers and under Node; the WebGPU helpers it shares with the chat app's program runtime), and the
package.json that tells Node its .js files are ES modules."""

_ENABLE = re.compile(r"^\s*enable\s+([^;]+);", re.MULTILINE)
_EXTENSION_FEATURES = {"f16": "shader-f16", "subgroups": "subgroups", "clip_distances": "clip-distances"}

# Float outputs pass the export page's check when |browser - expected| <= atol + rtol * |expected|, with
# atol = ATOL * max(1, max |expected|). WGSL only promises sin/cos to 2**-11 absolute and exp/log to a few
# ulp, and browsers use that latitude (SwiftShader's rope differs from lavapipe's by ~4e-4), so the
# default is looser than the library's own tests; integers must match exactly.
FLOAT_TOLERANCE = {"float32": (1e-3, 1e-3), "float16": (1e-2, 1e-2)}


class ExportedBatch(Protocol):
    """A batch, as the export uses it: a :class:`~batchgpu.GpuCommandBatch` (a layer above this module): what
    it recorded, and one execute with the exported inputs whose outputs it reads."""

    def view(self) -> BatchView: ...

    def execute(self, feeds: Mapping[Tensor | str, Any], *, scalars: Mapping[str, int | float]) -> object: ...

    def read(self, tensor: Tensor) -> np.ndarray: ...


def export_webgpu(
    batch: ExportedBatch,
    out_dir: str | Path,
    feeds: Mapping[Tensor, Any] | None = None,
    scalars: Mapping[str, int | float] | None = None,
    *,
    features: Sequence[str] = (),
    outputs: Sequence[Tensor] | None = None,
    tolerance: tuple[float, float] | None = None,
    gpu_kernels: bool = True,
) -> Path:
    """Write ``batch`` as a self-contained WebGPU program into ``out_dir`` and return its path.

    ``feeds`` (``{input tensor: array}``) and ``scalars`` (``{name: value}``) are the inputs the export
    carries and runs with; missing ones keep the batch's current values. The batch is executed once on
    its own device with them to record the expected outputs (so, like ``execute``, this updates the
    batch's inputs and any in-place state). ``outputs`` are the tensors the program returns (default:
    the storages ``execute`` copies back in its submit, each as the last tensor recorded on it).

    ``features`` are the optional WebGPU features the target browsers offer; the default is core
    WebGPU. A kernel whose WGSL needs a feature not listed (``enable f16`` needs ``shader-f16``, which
    e.g. Chrome's SwiftShader lacks) raises ``UnsupportedError`` naming the op and the feature,
    before anything is executed or written.

    ``gpu_kernels`` (default) writes the GPU forms of launches that have one (:attr:`Launch.gpu`, e.g.
    the decode GEMVs), as browsers run WebGPU on GPUs; ``False`` keeps the CPU-driver shapes (for a
    CPU-backed WebGPU such as SwiftShader, where they are faster).

    ``tolerance`` = ``(rtol, atol)`` sets the check ``index.html`` applies to float outputs:
    ``|browser - expected| <= atol * max(1, max|expected|) + rtol * |expected|`` (default
    ``FLOAT_TOLERANCE``); integer outputs must match exactly.

    Inputs and outputs are named by their tensors' ``name`` (``batch.upload(data, name="x")``,
    ``t.name = "logits"``): the manifest, the page and ``run()`` in ``batch.js`` key them so. A name two
    of them share (two inputs, two outputs, or an input and another tensor as output) raises
    ``ExportError`` naming both tensors, before anything is executed or written.
    """
    view = batch.view()
    out = Path(out_dir)
    check_out_dir(out)
    offered = {str(f) for f in features}
    launches = [launch.for_gpu() if gpu_kernels else launch for node in view.nodes for launch in node.launches]
    layout = plan_launches(launches, PARAMS_ALIGN)  # what the wgpu executor would build, params 256-aligned
    required = required_features(layout.launches, offered)
    validated_feeds = view.check_feeds(feeds)
    scalar_values = view.check_scalars(scalars)
    output_tensors = _output_tensors(view, outputs)
    _check_names(view.inputs, output_tensors)

    storages = _storages(view, launches, output_tensors)
    initial = _initial_data(view, storages, validated_feeds)

    # every input is fed, so the device starts from exactly the exported data even where an earlier
    # execute updated an input in place (custom kernels write their buffers)
    inputs = view.inputs
    batch.execute({t: _as_array(initial[t.storage], t) for t in inputs}, scalars=scalar_values)
    expected = [batch.read(tensor) for tensor in output_tensors]

    manifest, shader_sources = _manifest(view, layout, storages, initial, inputs, output_tensors, expected, tolerance)
    manifest["features"] = sorted(required)
    manifest["scalars"] = [
        {"name": s.name, "dtype": s.dtype, "slot": s.slot, "value": scalar_values[s.name]} for s in view.scalars
    ]
    _write(out, manifest, storages, initial, layout.params, shader_sources, expected)
    return out


# validation ------------------------------------------------------------------------------------


def check_out_dir(out: Path, what: str = "export_webgpu", marker: str = "manifest.json") -> None:
    """Refuse (BatchError naming ``what``) an ``out`` that is a file, or a folder holding files but no earlier
    export (its ``marker`` file), before anything is written."""
    problem = out_dir_problem(out, marker)
    if problem is not None:
        raise BatchError(f"{what}: {out} {problem}; pick an empty folder")


def out_dir_problem(out: Path, marker: str) -> str | None:
    """Why ``out`` is no folder to export into (a file, or a folder holding files but no earlier export: its
    ``marker`` file), or None."""
    if out.exists() and not out.is_dir():
        return "exists and is not a folder"
    try:
        if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
            return "is not empty and holds no earlier export"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None


def required_features(launches: Sequence[LaunchLayout], offered: set[str], what: str = "export_webgpu") -> set[str]:
    """WebGPU features the WGSL ``enable`` directives need; refuses those not in ``offered`` (UnsupportedError
    naming ``what``, the op and the feature)."""
    required: set[str] = set()
    for planned in launches:
        launch, pipeline = planned.launch, planned.pipeline
        for directive in _ENABLE.findall(pipeline.source):
            for extension in (e.strip() for e in directive.split(",")):
                if not extension:
                    continue
                feature = _EXTENSION_FEATURES.get(extension, extension)
                if feature not in offered:
                    offered_text = ", ".join(sorted(offered)) or "none: core WebGPU"
                    raise UnsupportedError(
                        f"{what}: {launch.label} ({pipeline.shader_name}) needs the WebGPU feature "
                        f"{feature!r} (WGSL 'enable {extension}'), which the export's features do not include "
                        f"({offered_text}); browsers without it (e.g. Chrome's SwiftShader) cannot run it. "
                        f"Use float32 tensors, or pass features=({feature!r},) if the target browsers offer it"
                    )
                required.add(feature)
    return required


def _output_tensors(view: BatchView, outputs: Sequence[Tensor] | None) -> list[Tensor]:
    """The tensors the export returns: ``outputs`` or, per read-back storage, the last tensor recorded
    on it (a final reshape's view rather than its source)."""
    if outputs is not None:
        chosen = list(outputs)
        for tensor in chosen:
            if not isinstance(tensor, Tensor):
                raise BatchError(f"export_webgpu: outputs must be Tensors, got {type(tensor).__name__}")
            view.check_member("export_webgpu", "output", tensor)
        return chosen
    last: dict[Storage, Tensor] = {}
    for node in view.nodes:
        for tensor in (*node.inputs, *node.outputs):
            last[tensor.storage] = tensor
    return [last[storage] for storage in view.readback if storage in last]


def _check_names(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> None:
    """Refuse names that cannot key the program's inputs and outputs: empty ones, and one name on two
    tensors (one tensor may be an input and an output at once: an input updated in place)."""
    named = [("input", t) for t in inputs] + [(f"outputs[{i}]", t) for i, t in enumerate(outputs)]
    by_name: dict[str, list[tuple[str, Tensor]]] = {}
    for label, tensor in named:
        if not isinstance(tensor.name, str) or not tensor.name:
            raise ExportError(
                f"export_webgpu: {label} {tensor.describe()} needs a non-empty str name to be exported under, "
                f"got {tensor.name!r}; set one with tensor.name = '...'"
            )
        for other_label, other in by_name.get(tensor.name, []):
            if other is not tensor:
                raise ExportError(
                    f"export_webgpu: {other_label} {other.describe()} and {label} {tensor.describe()} share the "
                    f"name {tensor.name!r}; the export keys inputs and outputs by name, so rename one "
                    f"(tensor.name = '...')"
                )
            if other_label != "input":  # both outputs: the same tensor listed twice
                raise ExportError(
                    f"export_webgpu: {other_label} and {label} are both {tensor.describe()}; list it once"
                )
        by_name.setdefault(tensor.name, []).append((label, tensor))


def _storages(view: BatchView, launches: Sequence[Launch], outputs: Sequence[Tensor]) -> list[Storage]:
    """Every buffer of the program: the batch's storages, then resident ones its launches bind."""
    storages = list(view.storages)
    seen = set(storages)
    extra = [b.storage for launch in launches for b in launch.bindings if b.storage is not None]
    for storage in [*extra, *(t.storage for t in outputs)]:
        if storage not in seen:
            seen.add(storage)
            storages.append(storage)
    return storages


def _initial_data(
    view: BatchView, storages: Sequence[Storage], feeds: Mapping[Storage, np.ndarray]
) -> dict[Storage, bytes]:
    """Buffer contents at the start of the exported run, captured before the expected-output execute:
    what the batch's next execute would start from."""
    executor = view.device.executor
    data: dict[Storage, bytes] = {}
    for storage in storages:
        state = view.device_value(storage) if storage in view.stateful and storage not in feeds else None
        if storage in feeds:
            array = feeds[storage]
        elif storage.kind == "resident":
            array = executor.read_resident(storage)
        elif state is not None:  # the device's value after the latest execute (a new plan carries it over)
            array = state
        elif storage.kind in ("input", "const"):  # a new plan uploads the host copy
            array = view.host[storage]
        elif storage in view.stateful and executor.poison:
            data[storage] = bytes([POISON_BYTE]) * storage.nbytes  # a new plan's buffers hold the poison
            continue
        else:
            continue  # a new buffer is zeros, on the device and in the browser alike
        data[storage] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)[: storage.nbytes].tobytes()
    return data


# the manifest ----------------------------------------------------------------------------------


def _tolerance(dtype: np.dtype, expected: np.ndarray, tolerance: tuple[float, float] | None) -> dict[str, float]:
    if dtype.name not in FLOAT_TOLERANCE:
        return {"rtol": 0.0, "atol": 0.0}
    rtol, atol = tolerance or FLOAT_TOLERANCE[dtype.name]
    finite = expected[np.isfinite(expected)]
    scale = float(np.abs(finite.astype(np.float64)).max()) if finite.size else 1.0
    return {"rtol": rtol, "atol": atol * max(scale, 1.0)}


def _manifest(
    view: BatchView,
    layout: WgpuLayout,
    storages: Sequence[Storage],
    initial: Mapping[Storage, bytes],
    input_tensors: Sequence[Tensor],
    outputs: Sequence[Tensor],
    expected: Sequence[np.ndarray],
    tolerance: tuple[float, float] | None,
) -> tuple[dict[str, Any], list[str]]:
    plan = ProgramPlan(storages)
    dispatches = plan.add(layout)
    buffers = plan.buffer_entries(storage_names(view, input_tensors, outputs))
    for i, storage in enumerate(storages):
        if storage in initial:
            buffers[i]["file"] = f"data/{i}.bin"
    index = plan.index
    inputs = [
        {"name": t.name, "buffer": index[t.storage], "dtype": t.dtype.name, "shape": list(t.shape)}
        for t in input_tensors
    ]
    manifest_outputs = []
    for i, (tensor, value) in enumerate(zip(outputs, expected)):
        manifest_outputs.append(
            {
                "name": tensor.name,
                "buffer": index[tensor.storage],
                "dtype": tensor.dtype.name,
                "shape": list(tensor.shape),
                "bytes": tensor.nbytes,
                "expected": f"expected/{i}.bin",
                **_tolerance(tensor.dtype, value, tolerance),
            }
        )

    manifest = {
        "format": FORMAT,
        "batch": view.name,
        "exported_from": view.device.name,
        "ops": len(view.nodes),
        "features": [],
        "limits": plan.limits(),
        "buffers": buffers,
        "shaders": plan.shaders,
        "pipelines": plan.pipelines,
        "params": {"file": "params.bin", "size": len(plan.params)},
        "dispatches": dispatches,
        "inputs": inputs,
        "scalars": [],
        "scalar_bytes": SCALAR_BYTES,
        "outputs": manifest_outputs,
    }
    return manifest, plan.sources


def storage_names(view: BatchView, inputs: Iterable[Tensor], outputs: Iterable[Tensor]) -> dict[Storage, str]:
    """A readable label per buffer: its input's or output's name, else the first tensor recorded on it."""
    names: dict[Storage, str] = {}
    for tensor in (*inputs, *outputs):
        names.setdefault(tensor.storage, tensor.name)
    for node in view.nodes:
        for tensor in (*node.inputs, *node.outputs):
            names.setdefault(tensor.storage, tensor.name)
    return names


def _as_array(data: bytes, tensor: Tensor) -> np.ndarray:
    return np.frombuffer(data, tensor.dtype, count=tensor.size).reshape(tensor.shape)


# writing ---------------------------------------------------------------------------------------


def _write(
    out: Path,
    manifest: dict[str, Any],
    storages: Sequence[Storage],
    initial: Mapping[Storage, bytes],
    params: bytes,
    shader_sources: Sequence[str],
    expected: Sequence[np.ndarray],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for folder in ("shaders", "data", "expected"):  # an earlier export's files
        shutil.rmtree(out / folder, ignore_errors=True)
        (out / folder).mkdir()
    for shader, source in zip(manifest["shaders"], shader_sources):
        (out / shader["file"]).write_text(source, encoding="utf-8")
    (out / "params.bin").write_bytes(params)
    for i, storage in enumerate(storages):
        if storage in initial:
            (out / manifest["buffers"][i]["file"]).write_bytes(initial[storage])
    for entry, value in zip(manifest["outputs"], expected):
        (out / entry["expected"]).write_bytes(np.ascontiguousarray(value).tobytes())
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    sources = resources.files("batchgpu.export")
    for folder, names in (("template", TEMPLATE_FILES), ("app", APP_FILES)):
        for name in names:
            (out / name).write_text((sources / folder / name).read_text(encoding="utf-8"), encoding="utf-8")
