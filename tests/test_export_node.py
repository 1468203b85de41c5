"""WebGPU export under Node: the exported batch.js runs in Node with the npm package ``webgpu`` (Dawn), reading
its files from disk, and passes the export's own check (the device's outputs within the manifest's
tolerances, as index.html checks them in a browser). Skipped where Node, npm's package or a Node WebGPU
adapter is unavailable; the first run installs the package (~51 MB) into the user cache."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.export import node
from batchgpu.quant import FORMATS


@pytest.fixture(scope="module")
def adapter() -> dict[str, Any]:
    """The adapter Node's WebGPU gets (installing the package the first time), or a skip saying why not."""
    try:
        return node.node_adapter()
    except node.NodeUnavailableError as error:
        pytest.skip(f"WebGPU under Node is unavailable: {error}")


@pytest.fixture
def node18_module_typing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node as before 20.19/22.7, which read a .js file as an ES module only under a package.json saying
    "type": "module": later ones also detect module syntax, unless told not to (older ones lack the flag)."""
    node_path = node.find_node()
    flag = "--no-experimental-detect-module"
    if node_path is not None and subprocess.run([node_path, flag, "-e", "0"], capture_output=True).returncode == 0:
        monkeypatch.setenv("NODE_OPTIONS", flag)


def quantized(device: bg.Device, rng: np.random.Generator, qtype: str, shape: tuple[int, int]) -> bg.QuantTensor:
    """Random weights quantized to the GGUF block format ``qtype`` by the gguf package."""
    from gguf import quants

    weights = rng.standard_normal(shape).astype(np.float32)
    blocks = np.asarray(quants.quantize(weights, getattr(quants.GGMLQuantizationType, qtype.upper())))
    return device.quantized(blocks.view(np.uint8), qtype, shape, name=qtype)


def record_mixed(device: bg.Device, rng: np.random.Generator) -> tuple[bg.GpuCommandBatch, list, dict]:
    """relu(x @ w + b) on odd shapes; with the gguf package also x2 @ q4_1ᵀ and a q8_0 embedding."""
    batch = bg.GpuCommandBatch(device, name="mixed")
    host = {
        "x": rng.standard_normal((5, 37)).astype(np.float32),
        "w": rng.standard_normal((37, 13)).astype(np.float32),
        "b": rng.standard_normal(13).astype(np.float32),
    }
    x, w, b = (batch.upload(host[name], name=name) for name in ("x", "w", "b"))
    y = batch.relu(batch.add(batch.matmul(x, w), b))
    y.name = "y"
    outputs = [y]
    if importlib.util.find_spec("gguf") is not None:
        k = 2 * FORMATS["q4_1"].weights  # two blocks per row
        x2 = batch.upload(rng.standard_normal((3, k)).astype(np.float32), name="x2")
        q = batch.matmul(x2, quantized(device, rng, "q4_1", (13, k)), transpose_b=True)
        q.name = "q"
        ids = batch.upload(np.array([4, 0, 6, 2, 4], np.int32), name="ids")
        e = batch.embedding(ids, quantized(device, rng, "q8_0", (7, 2 * FORMATS["q8_0"].weights)))
        e.name = "e"
        outputs += [q, e]
    return batch, outputs, host


def test_node_runs_the_exported_batch_and_its_check(gpu: bg.Device, adapter: dict[str, Any], tmp_path: Path) -> None:
    """batch.js under Node: check() runs the exported inputs on Node's adapter and compares every output
    with the exporting device's, within the manifest's tolerances (floats: WGSL's latitude, see
    FLOAT_TOLERANCE; the embedding copies dequantized rows, exact on any conforming device but checked
    with the same float tolerance)."""
    rng = np.random.default_rng(31)
    batch, outputs, host = record_mixed(gpu, rng)
    out = batch.export_webgpu(tmp_path / "mixed", outputs=outputs)
    for name in ("io.js", "node_gpu.js", "package.json"):
        assert (out / name).is_file(), name
    expected_y = np.frombuffer((out / "expected" / "0.bin").read_bytes(), np.float32).reshape(5, 13)
    numpy_y = np.maximum(host["x"] @ host["w"] + host["b"], 0)
    np.testing.assert_allclose(expected_y, numpy_y, rtol=1e-5, atol=1e-5 * np.abs(numpy_y).max())

    result = node.run_node("batch.js", out, function="check")
    assert result["status"] == "pass", json.dumps(result, indent=1)
    assert [o["name"] for o in result["outputs"]] == [t.name for t in outputs]
    assert all(o["ok"] and o["mismatches"] == 0 for o in result["outputs"])
    assert result["adapter"]["description"] == adapter["description"]


def test_node_check_reports_a_wrong_output(
    ref: bg.Device, adapter: dict[str, Any], node18_module_typing: None, tmp_path: Path
) -> None:
    """The check is not vacuous: an expected value moved past its tolerance fails, naming the output and
    the element. Run as Node 18 reads .js files: the export says its modules are ES modules."""
    rng = np.random.default_rng(7)
    batch = bg.GpuCommandBatch(ref, name="wrong")
    y = batch.relu(
        batch.matmul(
            batch.upload(rng.standard_normal((5, 37)).astype(np.float32), name="x"),
            batch.upload(rng.standard_normal((37, 13)).astype(np.float32), name="w"),
        )
    )
    y.name = "y"
    out = batch.export_webgpu(tmp_path / "wrong", outputs=[y])
    entry = json.loads((out / "manifest.json").read_text())["outputs"][0]
    expected = np.frombuffer((out / entry["expected"]).read_bytes(), np.float32).copy()
    expected[17] += 1 + 2 * (entry["atol"] + entry["rtol"] * abs(expected[17]))
    (out / entry["expected"]).write_bytes(expected.tobytes())
    result = node.run_node("batch.js", out, function="check")
    assert result["status"] == "fail"
    (output,) = result["outputs"]
    assert output["name"] == "y" and not output["ok"]
    assert output["mismatches"] == 1 and output["first_mismatch"] == 17


def test_run_node_reports_failures(adapter: dict[str, Any], tmp_path: Path) -> None:
    """A module that throws, a missing function, one that never returns and a missing module raise
    NodeError saying which; what the module prints before its result is not taken for the result; code
    written for browsers finds navigator.gpu."""
    (tmp_path / "m.mjs").write_text(
        "export async function fails(base, args) { throw new Error(`broken ${args.n} at ${base}`); }\n"
        "export async function echo(base, args) {\n"
        "  process.stdout.write('chatter, no newline');\n"
        "  return { base, args };\n"
        "}\n"
        "export async function hangs() { await new Promise(() => setInterval(() => {}, 1000)); }\n"
        "export async function plain() { return (await navigator.gpu.requestAdapter()).info.description; }\n"
    )
    assert node.run_node("m.mjs", tmp_path, function="plain") == adapter["description"]  # browser code as is
    assert node.run_node("m.mjs", tmp_path, function="echo", args={"n": 3}) == {
        "base": tmp_path.resolve().as_uri() + "/",
        "args": {"n": 3},
    }
    with pytest.raises(node.NodeError, match="broken 3 at file:"):
        node.run_node("m.mjs", tmp_path, function="fails", args={"n": 3})
    with pytest.raises(node.NodeError, match=r"exports no function nope \(its functions: echo, fails, hangs, plain\)"):
        node.run_node("m.mjs", tmp_path, function="nope")
    with pytest.raises(node.NodeError, match=r"hangs\(\) ran past 1 s"):
        node.run_node("m.mjs", tmp_path, function="hangs", timeout=1)
    with pytest.raises(node.NodeError, match="no module"):
        node.run_node("missing.mjs", tmp_path)


def test_missing_node_or_package_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No package and no install, no npm, no Node: NodeUnavailableError (which the tests turn into skips)
    saying what is missing, before anything runs."""
    monkeypatch.setenv(node.ENV_NODE_MODULES, str(tmp_path / "empty"))
    assert node.node_modules_dir() == tmp_path / "empty"
    with pytest.raises(node.NodeUnavailableError, match=rf"webgpu@{node.WEBGPU_VERSION} is not installed in"):
        node.webgpu_package(install=False)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    with pytest.raises(node.NodeUnavailableError, match="npm is not installed"):
        node.webgpu_package()
    assert not (tmp_path / "empty").exists()
    monkeypatch.setenv(node.ENV_NODE, str(tmp_path / "no-node"))
    (tmp_path / "m.mjs").write_text("export default () => 1;\n")
    with pytest.raises(node.NodeUnavailableError, match=r"Node\.js is not installed"):
        node.run_node("m.mjs", tmp_path)
