"""WebGPU export: ``batch.export_webgpu`` writes a standalone program; headless Chromium (SwiftShader on
CPU-only machines) runs the same WGSL and must reproduce numpy's outputs."""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import runpy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.export.browser import Chromium, serve
from batchgpu.limits import Limits, split_groups
from batchgpu.shaders import render_wgsl

from .conftest import load_script
from .doc_blocks import named_block
from .op_examples import record_all
from .test_custom_kernels import saxpy_kernel, square_plus_kernel


def _load_example(name: str) -> Any:
    return load_script(f"examples/{name}.py", name)


ffn = _load_example("ffn_layer")


def open_page(browser: Chromium, folder: Path, page: str, expression: str = "window.batchgpuResult") -> Any:
    with serve(folder) as base:
        return browser.evaluate(base + page, expression, timeout=90)


def manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


def page_outputs(folder: Path, result: dict[str, Any]) -> dict[str, np.ndarray]:
    """The outputs the page dumped (``?dump=1``), as numpy arrays."""
    arrays = {}
    for output in manifest(folder)["outputs"]:
        raw = base64.b64decode(result["data"][output["name"]])
        arrays[output["name"]] = np.frombuffer(raw, np.dtype(output["dtype"])).reshape(output["shape"])
    return arrays


def assert_passed(result: dict[str, Any]) -> None:
    assert result["status"] == "pass", json.dumps(result, indent=1)[:3000]
    print(json.dumps(result["timings"], indent=1))  # shown with -s


# the FFN example -------------------------------------------------------------------------------


def record_ffn(device: bg.Device, layers: int = 2, tokens: int = 4, hidden: int = 32, inner: int = 48) -> tuple:
    rng = np.random.default_rng(7)
    host_weights = ffn.make_weights(rng, layers, hidden, inner)
    weights = [
        {k: device.tensor(w, name=f"l{i}.{k}") for k, w in layer.items()} for i, layer in enumerate(host_weights)
    ]
    x_data = rng.standard_normal((tokens, hidden)).astype(np.float32)
    batch = bg.GpuCommandBatch(device, name="ffn")
    x = batch.upload(x_data, name="x")
    y = ffn.record_ffn(batch, x, weights)
    return batch, x, y, host_weights, rng


def test_export_folder_holds_the_plan(gpu: bg.Device, tmp_path: Path) -> None:
    batch, x, y, host_weights, rng = record_ffn(gpu)
    batch.execute()
    new_x = rng.standard_normal(x.shape).astype(np.float32)
    out = batch.export_webgpu(tmp_path / "ffn", feeds={x: new_x})
    assert out == tmp_path / "ffn"
    for name in ("index.html", "batch.js", "manifest.json", "params.bin"):
        assert (out / name).is_file(), name
    info = manifest(out)
    assert info["format"] == "batchgpu-webgpu/1" and info["features"] == []

    launches = [launch for node in batch.nodes for launch in node.launches]
    assert len(info["dispatches"]) == len(launches) == 6 * len(host_weights)  # 3 matmuls, silu, mul, add
    params = (out / "params.bin").read_bytes()
    for launch, dispatch in zip(launches, info["dispatches"]):
        pipeline = info["pipelines"][dispatch["pipeline"]]
        source = (out / info["shaders"][pipeline["shader"]]["file"]).read_text()
        assert source == render_wgsl(launch.family, launch.types, launch.snippets)
        assert pipeline["entry"] == launch.entry and pipeline["layout"] == "auto"
        assert pipeline["constants"] == {name: float(value) for name, value in launch.constants}
        assert dispatch["groups"] == (launch.groups if isinstance(launch.groups, int) else list(launch.groups))
        (uniform,) = [b for b in dispatch["bindings"] if b["kind"] == "uniform"]
        assert uniform["offset"] % 256 == 0
        assert params[uniform["offset"] : uniform["offset"] + uniform["size"]] == launch.params
    assert len(info["pipelines"]) < len(launches)  # same kernel, same specialization: one pipeline

    (x_entry,) = info["inputs"]
    assert x_entry["name"] == "x" and x_entry["shape"] == [4, 32] and x_entry["dtype"] == "float32"
    assert (out / info["buffers"][x_entry["buffer"]]["file"]).read_bytes() == new_x.tobytes()
    resident = {(out / b["file"]).read_bytes() for b in info["buffers"] if b["kind"] == "resident"}
    assert resident == {w.tobytes() for layer in host_weights for w in layer.values()}
    largest = max(w.nbytes for layer in host_weights for w in layer.values())
    assert info["limits"]["maxStorageBufferBindingSize"] >= largest

    (y_entry,) = info["outputs"]
    assert y_entry["shape"] == [4, 32] and y_entry["buffer"] == info["dispatches"][-1]["bindings"][-2]["buffer"]
    expected = np.frombuffer((out / y_entry["expected"]).read_bytes(), np.float32).reshape(4, 32)
    reference = ffn.numpy_ffn(new_x, host_weights)
    assert np.abs(expected - reference).max() <= 1e-4 * np.abs(reference).max()
    np.testing.assert_array_equal(batch.read(y), expected)  # the export executed with the feeds

    batch.export_webgpu(out)  # an earlier export is replaced
    assert manifest(out)["inputs"][0]["name"] == "x"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(bg.BatchError, match="not empty"):
        batch.export_webgpu(tmp_path / "other")


@pytest.mark.parametrize("declared", [False, True], ids=["all-readable", "outputs-declared"])
def test_browser_runs_ffn_like_numpy(gpu: bg.Device, browser: Chromium, tmp_path: Path, declared: bool) -> None:
    """With ``batch.outputs(y)`` the batch itself shares buffers; the export keeps its own layout."""
    batch, x, y, host_weights, rng = record_ffn(gpu)
    if declared:
        batch.outputs(y)
    new_x = rng.standard_normal(x.shape).astype(np.float32)
    out = batch.export_webgpu(tmp_path / "ffn", feeds={x: new_x})
    result = open_page(browser, out, "index.html?runs=3&dump=1")
    assert_passed(result)
    assert result["adapter"]["vendor"] or result["adapter"]["architecture"]
    (browser_y,) = page_outputs(out, result).values()
    reference = ffn.numpy_ffn(new_x, host_weights)
    assert np.abs(browser_y - reference).max() <= 1e-4 * np.abs(reference).max()


# custom kernels --------------------------------------------------------------------------------


def test_browser_runs_custom_kernels_like_numpy(gpu: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    n, rows, cols = 1000, 13, 21
    xa, ya = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    ma = rng.integers(-300, 300, (rows, cols)).astype(np.int32)
    batch = bg.GpuCommandBatch(gpu, name="custom")
    x, y = batch.upload(xa, name="x"), batch.upload(ya, name="y")
    batch.launch(saxpy_kernel(), math.ceil(n / 64), buffers=[x, y], scalars=[1.5, np.uint32(n)])
    total = batch.add(y, x)  # a built-in kernel after the custom one, reading its in-place result
    m = batch.upload(ma, name="m")
    squared = batch.empty((rows, cols), np.int32, name="squared")
    kernel = square_plus_kernel(np.int32)
    batch.launch(kernel, (math.ceil(cols / 8), math.ceil(rows / 8)), buffers=[m, squared], scalars=[7, rows, cols])
    out = batch.export_webgpu(tmp_path / "custom", outputs=[y, total, squared])

    info = manifest(out)
    custom = [p for p in info["pipelines"] if p["layout"] != "auto"]
    assert [p["layout"] for p in custom] == [{"storage": 2, "uniform": True}] * 2
    assert (out / info["shaders"][custom[1]["shader"]]["file"]).read_text() == kernel.wgsl
    assert info["dispatches"][2]["groups"] == [3, 2, 1]

    result = open_page(browser, out, "index.html?runs=2&dump=1")
    assert_passed(result)
    outputs = page_outputs(out, result)
    saxpy = np.float32(1.5) * xa + ya
    assert list(outputs) == ["y", total.name, "squared"]
    np.testing.assert_allclose(outputs["y"], saxpy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(outputs[total.name], saxpy + xa, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(outputs["squared"], ma * ma + 7)

    # batch.js splits 1-D workgroup counts over x/y with the browser's own limit, like split_groups
    split = open_page(
        browser,
        out,
        "index.html?runs=0",
        "import('./batch.js').then(m => [100000, 65535, 7].map(g => m.splitGroups(g, 65535)))",
    )
    limits = Limits(max_compute_workgroups_per_dimension=65535)
    assert split == [list(split_groups(g, limits)) for g in (100000, 65535, 7)]


# every built-in kernel -------------------------------------------------------------------------


def test_browser_runs_every_builtin_kernel_like_the_reference(
    ref: bg.Device, browser: Chromium, tmp_path: Path
) -> None:
    """Exported from the numpy reference device (no GPU needed to export): the browser compiles every
    built-in WGSL family with its own compiler and must match numpy. Every op of the op table, in each
    form tests/op_examples.py records, over float32, int32 and uint32 (float16 needs the shader-f16
    feature, which SwiftShader lacks: test_browser_reports_a_missing_feature)."""
    rng = np.random.default_rng(11)
    batch = bg.GpuCommandBatch(ref, name="builtins")
    outs, scalars = record_all(batch, (np.float32, np.int32, np.uint32), rng)
    outs.append(batch.add(batch.upload(rng.standard_normal((6, 40)).astype(np.float32)), 2.5))  # a Python scalar
    quants = importlib.util.find_spec("gguf")  # GGUF-quantized weights where the gguf package is installed
    out = batch.export_webgpu(tmp_path / "builtins", scalars=scalars, outputs=outs)
    families = {(out / s["file"]).read_text() for s in manifest(out)["shaders"]}
    assert len(families) >= 9 and manifest(out)["exported_from"] == "numpy reference"
    assert quants is None or sum("unpack2x16float" in source for source in families) >= 2
    entries = {pipeline["entry"] for pipeline in manifest(out)["pipelines"]}
    assert "matmul_gemv_t" in entries  # the GPU forms (Launch.gpu), checked against the reference
    assert quants is None or {"matmul_q4_1_warp", "matmul_q8_0_warp"} <= entries
    result = open_page(browser, out, "index.html?runs=0")
    assert_passed(result)
    assert len(result["outputs"]) == len(outs)


# per-execute scalars ---------------------------------------------------------------------------

CHECK_PAGE = """<!doctype html><script type="module">
import { run, requestDevice } from "./batch.js";
const inputs = INPUTS;
window.batchgpuResult = (async () => {
  const device = await requestDevice();
  const typed = Object.fromEntries(Object.entries(inputs).map(([k, v]) => [k, new Float32Array(v)]));
  const out = await run(device, typed, { pos: 4 });
  const failure = async (body) => { try { await body(); return null; } catch (e) { return e.message; } };
  return {
    data: Object.fromEntries(Object.entries(out).map(([k, a]) => [k, Array.from(a)])),
    unknown_scalar: await failure(() => run(device, {}, { nope: 1 })),
    bad_scalar: await failure(() => run(device, {}, { pos: -1 })),
    wrong_size: await failure(() => run(device, { q: new Float32Array(3) })),
  };
})().catch((e) => ({ error: String(e) }));
</script>"""


def record_decode(device: bg.Device, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple:
    """rope, kv_write into caches and attention, all at the per-execute position ``pos``."""
    batch = bg.GpuCommandBatch(device, name="decode")
    pos = batch.scalar("pos", "u32")
    qt, kt, vt = batch.upload(q, name="q"), batch.upload(k, name="k"), batch.upload(v, name="v")
    # caches uploaded as zeros and updated in place: their device value persists between executes
    zeros = np.zeros((12, 2, 8), np.float32)
    k_cache, v_cache = batch.upload(zeros, name="k_cache"), batch.upload(zeros, name="v_cache")
    batch.kv_write(k_cache, batch.rope(kt, pos), pos)
    batch.kv_write(v_cache, vt, pos)
    out = batch.attention(batch.rope(qt, pos), k_cache, v_cache, pos)
    return batch, (qt, kt, vt), (out, k_cache)


def test_browser_passes_scalars_through_run(gpu: bg.Device, ref: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    first = [rng.standard_normal(shape).astype(np.float32) for shape in ((2, 4, 8), (2, 2, 8), (2, 2, 8))]
    second = [rng.standard_normal(a.shape).astype(np.float32) for a in first]
    batch, _inputs, outputs = record_decode(gpu, *first)
    batch.execute(scalars={"pos": 0})  # fills cache rows 0-1: the export carries that state
    out = batch.export_webgpu(tmp_path / "decode", scalars={"pos": 2}, outputs=outputs)
    info = manifest(out)
    assert info["scalars"] == [{"name": "pos", "dtype": "u32", "slot": 0, "value": 2}]
    assert [i["name"] for i in info["inputs"]] == ["q", "k", "v", "k_cache", "v_cache"]
    k_cache = np.frombuffer((out / info["buffers"][info["inputs"][3]["buffer"]]["file"]).read_bytes(), np.float32)
    assert np.count_nonzero(k_cache.reshape(12, -1).any(axis=1)) == 2  # rows 0-1 written by the first execute
    assert_passed(open_page(browser, out, "index.html?runs=1"))

    inputs_json = json.dumps({name: a.reshape(-1).tolist() for name, a in zip("qkv", second)})
    (out / "check.html").write_text(CHECK_PAGE.replace("INPUTS", inputs_json))
    result = open_page(browser, out, "check.html")
    assert "error" not in result, result
    assert "unknown scalar nope" in result["unknown_scalar"]
    assert "pos" in result["bad_scalar"] and "integer" in result["bad_scalar"]
    assert "input q" in result["wrong_size"] and "needs 256 bytes" in result["wrong_size"]

    reference, ref_inputs, ref_outputs = record_decode(ref, *first)
    reference.execute(scalars={"pos": 0})
    reference.execute(dict(zip(ref_inputs, second)), scalars={"pos": 4})
    for entry, tensor in zip(info["outputs"], ref_outputs):
        browser_value = np.asarray(result["data"][entry["name"]], np.float32).reshape(tensor.shape)
        # WGSL lets sin/cos (rope) err by 2**-11; SwiftShader uses some of that
        np.testing.assert_allclose(browser_value, reference.read(tensor), rtol=2e-3, atol=2e-3)


# features --------------------------------------------------------------------------------------


def f16_batch(device: bg.Device) -> bg.GpuCommandBatch:
    if "shader-f16" not in device.features:
        pytest.skip(f"{device.name} has no shader-f16")
    batch = bg.GpuCommandBatch(device, name="half")
    x = batch.upload(np.linspace(-2, 2, 64, dtype=np.float32), name="x")
    batch.exp(batch.cast(x, np.float16))
    return batch


def test_export_refuses_f16_without_the_feature(gpu: bg.Device, tmp_path: Path) -> None:
    batch = f16_batch(gpu)
    before = gpu.stats.snapshot()
    with pytest.raises(bg.UnsupportedError) as info:
        batch.export_webgpu(tmp_path / "half")
    message = str(info.value)
    assert "'shader-f16'" in message and "cast" in message and "enable f16" in message
    assert not (tmp_path / "half").exists()
    assert gpu.stats.snapshot()["submits"] == before["submits"]  # refused before executing anything

    out = batch.export_webgpu(tmp_path / "half", features=("shader-f16",))
    assert manifest(out)["features"] == ["shader-f16"]
    assert "enable f16;" in (out / "shaders" / "1.wgsl").read_text()


def test_browser_reports_a_missing_feature(gpu: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    out = f16_batch(gpu).export_webgpu(tmp_path / "half", features=("shader-f16",))
    result = open_page(browser, out, "index.html?runs=0")
    if result["status"] != "pass":  # SwiftShader lacks shader-f16; a browser with it runs the batch
        assert result["status"] == "error"
        assert "needs the WebGPU feature(s) shader-f16, which the adapter lacks" in result["error"]


# names -----------------------------------------------------------------------------------------


def record_named(device: bg.Device) -> tuple[bg.GpuCommandBatch, bg.Tensor, bg.Tensor, bg.Tensor, bg.Tensor]:
    batch = bg.GpuCommandBatch(device, name="named")
    x = batch.upload(np.arange(6, dtype=np.float32).reshape(2, 3), name="x")
    y = batch.upload(np.ones((2, 3), np.float32))  # a generated name
    total = batch.add(x, y)
    total.name = "total"
    scaled = batch.mul(total, 2.0)
    return batch, x, y, total, scaled


def test_export_keys_inputs_and_outputs_by_tensor_names(ref: bg.Device, tmp_path: Path) -> None:
    batch, x, y, total, scaled = record_named(ref)
    out = batch.export_webgpu(tmp_path / "named", outputs=[total, scaled, x])  # x: an input returned as is
    info = manifest(out)
    assert [i["name"] for i in info["inputs"]] == ["x", y.name] and y.name.startswith("input")
    assert [o["name"] for o in info["outputs"]] == ["total", scaled.name, "x"]
    assert all(info["buffers"][o["buffer"]]["name"] == o["name"] for o in info["outputs"])  # buffer labels
    scaled.name = "scaled"  # renamed after recording: the next export uses the new name
    assert [o["name"] for o in manifest(batch.export_webgpu(out, outputs=[total, scaled]))["outputs"]] == [
        "total",
        "scaled",
    ]


@pytest.mark.parametrize(
    ("rename", "outputs", "message"),
    [
        ({"y": "x"}, ("total",), r"input x \(batch, shape \(2, 3\), float32\) and input x \(batch, shape \(2, 3\)"),
        ({"scaled": "total"}, ("total", "scaled"), r"outputs\[0\] total .* and outputs\[1\] total .* share the name"),
        ({"scaled": "x"}, ("scaled",), r"input x \(batch.* and outputs\[0\] x \(batch.* share the name 'x'"),
        ({}, ("total", "total"), r"outputs\[0\] and outputs\[1\] are both total .*list it once"),
        ({"scaled": ""}, ("scaled",), r"outputs\[0\] .* needs a non-empty str name"),
    ],
    ids=["two-inputs", "two-outputs", "input-and-output", "listed-twice", "empty"],
)
def test_export_refuses_ambiguous_names(
    ref: bg.Device, tmp_path: Path, rename: dict[str, str], outputs: tuple[str, ...], message: str
) -> None:
    batch, x, y, total, scaled = record_named(ref)
    tensors = {"x": x, "y": y, "total": total, "scaled": scaled}
    for key, name in rename.items():
        tensors[key].name = name
    before = ref.stats.snapshot()["submits"]
    with pytest.raises(bg.ExportError, match=message) as refused:
        batch.export_webgpu(tmp_path / "named", outputs=[tensors[key] for key in outputs])
    assert isinstance(refused.value, bg.BatchError)
    assert not (tmp_path / "named").exists() and ref.stats.snapshot()["submits"] == before  # refused first


def test_browser_keys_outputs_by_any_name(ref: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    """Names are data to batch.js: an input "constructor" and an output "__proto__" work like others."""
    batch = bg.GpuCommandBatch(ref, name="odd names")
    x_data = np.arange(8, dtype=np.float32)
    x = batch.upload(x_data, name="constructor")
    y = batch.add(x, 1.0)
    y.name = "__proto__"
    out = batch.export_webgpu(tmp_path / "odd", outputs=[y])
    result = open_page(browser, out, "index.html?runs=1&dump=1")
    assert_passed(result)
    np.testing.assert_array_equal(page_outputs(out, result)["__proto__"], x_data + 1)


# file:// and failed loads ----------------------------------------------------------------------

PAGE_STATE = (
    "window.batchgpuResult && window.batchgpuResult.then((result) => ({ result, "
    "status: document.getElementById('status').textContent, visible: document.body.innerText }))"
)


def tiny_export(device: bg.Device, out: Path) -> Path:
    batch = bg.GpuCommandBatch(device, name="tiny")
    x = batch.upload(np.arange(8, dtype=np.float32), name="x")
    y = batch.add(x, 1.0)
    y.name = "y"
    return batch.export_webgpu(out, outputs=[y])


def test_page_opened_from_file_url_says_to_serve_it(ref: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    """file:// pages get no module scripts or fetch(): the page says so at once instead of 'loading...'."""
    out = tiny_export(ref, tmp_path / "tiny")
    state = browser.evaluate((out / "index.html").as_uri(), PAGE_STATE, timeout=30)
    assert state["result"]["status"] == "error"
    shown = state["status"]
    assert shown.startswith("error: this page was opened from a file:// URL"), shown
    assert "python -m http.server" in shown and f"in {out}/ and open http://127.0.0.1:8000/" in shown
    assert shown in state["visible"]  # rendered, not just in the DOM


def test_page_reports_a_module_that_fails_to_load(ref: bg.Device, browser: Chromium, tmp_path: Path) -> None:
    out = tiny_export(ref, tmp_path / "tiny")
    (out / "batch.js").unlink()  # served over HTTP, but the module 404s
    with serve(out) as base:
        state = browser.evaluate(base + "index.html", PAGE_STATE, timeout=30)  # the page's own timeout is 20 s
    assert state["result"]["status"] == "error" and "batch.js" in state["status"], state
    assert state["status"] in state["visible"]


# the guide's export example (docs/browser.md) ----------------------------------------------------------

README_CHECK_PAGE = """<!doctype html>
<script>
window.addEventListener("error", (e) => { window.readmeResult ??= { error: String(e.message) }; });
window.addEventListener("unhandledrejection", (e) => { window.readmeResult ??= { error: String(e.reason) }; });
</script>
<script type="module" src="./readme.js"></script>"""

README_CAPTURE = """
import { names } from "./batch.js";
window.readmeResult = {
  data: Object.fromEntries(Object.entries(out).map(([k, v]) => [k, Array.from(v)])),
  names: await names(),
};
"""


def test_readme_export_example_runs_as_written(
    browser: Chromium, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's Python block (docs/browser.md) exports a batch with named inputs and outputs; its JS block,
    run in a page of that folder, gets the outputs by those names, equal to numpy's."""
    monkeypatch.chdir(tmp_path)  # the block writes out/classify relative to the working directory
    script = tmp_path / "readme_export.py"
    script.write_text(named_block("export", "python"), encoding="utf-8")
    example = runpy.run_path(str(script), run_name="__main__")
    out = tmp_path / "out" / "classify"
    info = manifest(out)
    assert [i["name"] for i in info["inputs"]] == ["x"]
    assert [o["name"] for o in info["outputs"]] == ["logits", "probs"]

    page = open_page(browser, out, "index.html?runs=1")
    assert_passed(page)
    assert [o["name"] for o in page["outputs"]] == ["logits", "probs"]

    (out / "readme.js").write_text(named_block("export_js", "js") + README_CAPTURE, encoding="utf-8")
    (out / "readme.html").write_text(README_CHECK_PAGE, encoding="utf-8")
    result = open_page(browser, out, "readme.html", "window.readmeResult")
    assert "error" not in result, result
    assert result["names"] == {"inputs": ["x"], "scalars": [], "outputs": ["logits", "probs"]}
    assert list(result["data"]) == ["logits", "probs"]

    x_new = np.ones((2, 16), np.float32)  # what the JS block passes as x
    logits = x_new @ example["dev"].read(example["w"])
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    for name, reference in (("logits", logits), ("probs", probs)):
        browser_value = np.asarray(result["data"][name], np.float32).reshape(reference.shape)
        np.testing.assert_allclose(browser_value, reference, rtol=1e-4, atol=1e-6, err_msg=name)
