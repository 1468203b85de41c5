"""The f16 variant of an exported chat model and its self-test, checked through the Python export path: the
exported programs (model.json's ``variants.f16`` and ``self_test``) run with wgpu-py as the page runs them
(tests/plan_runner.py) on wgpu's adapter, whose shader-f16 (lavapipe has it; Chromium's SwiftShader and Dawn's
do not) runs the half-form WGSL, against numpy (the reference device) and Python's steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.export.chat import export_chat
from batchgpu.export.chat_steps import ChatSteps
from batchgpu.export.precision import SELF_TEST_TOLERANCE, SelfTestShapes, self_test_program
from batchgpu.export.program import write_programs
from batchgpu.kernels import HALF_ALIAS
from batchgpu.models.llama import open_weights, upload_weights
from batchgpu.quant import FORMATS
from batchgpu.shaders import render_wgsl

from .test_export_chat import PROMPTS, TINY, tiny_model


@pytest.fixture(scope="module")
def half_adapter() -> None:
    pytest.importorskip("wgpu", reason="wgpu-py is not installed here")
    from .plan_runner import adapter_features

    if "shader-f16" not in adapter_features():
        pytest.skip("wgpu's adapter offers no shader-f16: the f16 WGSL cannot run here")


def within(value: np.ndarray, reference: np.ndarray, tolerance: dict[str, float]) -> float:
    """The largest |value - reference| over its allowance (precision.js's compare: <= 1 passes)."""
    scale = max(1.0, float(np.abs(reference).max()))
    allowed = tolerance["atol"] * scale + tolerance["rtol"] * np.abs(reference)
    assert np.isfinite(value).all()
    return float((np.abs(value.astype(np.float64) - reference) / allowed).max())


def expected_values(folder: Path, test: dict[str, Any]) -> dict[str, np.ndarray]:
    raw = (folder / test["expected"]["file"]).read_bytes()
    return {
        name: np.frombuffer(raw[e["offset"] : e["offset"] + e["bytes"]], np.float32)
        for name, e in test["expected"]["outputs"].items()
    }


def check_self_test(folder: Path, test: dict[str, Any]) -> dict[str, float]:
    """Both forms of the self-test on wgpu's adapter: f32 against the export's values, f16 against f32 (as the
    page checks them) and against the export's values; the f16 outputs are not the f32 ones (the half form
    ran). Returns each case's f16 error over its allowance."""
    from .plan_runner import PlanRunner

    runner = PlanRunner(folder, test)
    f32, f16 = runner.run("f32"), runner.run("f16")
    expected = expected_values(folder, test)
    ratios = {}
    for case in test["cases"]:
        assert within(f32[case], expected[case], test["tolerance"]["f32"]) <= 1, case
        ratios[case] = within(f16[case], f32[case], test["tolerance"]["f16"])
        assert ratios[case] <= 1, (case, ratios[case])
        assert within(f16[case], expected[case], test["tolerance"]["f16"]) <= 1, case
        assert not np.array_equal(f16[case], f32[case]), case
    return ratios


def test_half_forms_render_f16_products() -> None:
    """The half form of a half-capable family's launch enables f16 and sets H = f16 and HALF; other families'
    launches have none, and the f32 form declares H = f32 (its code under ``if HALF`` never runs)."""
    device = bg.Device("reference")
    batch = bg.GpuCommandBatch(device)
    x = batch.upload(np.ones((2, 64), np.float32))
    y = batch.rms_norm(x, batch.upload(np.ones(64, np.float32)), 1e-5)
    z = batch.relu(y)
    batch.outputs(z)
    launches = {launch.family: launch for node in batch.view().nodes for launch in node.launches}
    norm, elementwise = launches["norm"], launches["elementwise"]
    assert (HALF_ALIAS, "f32") in norm.types and elementwise.for_half() is elementwise
    half = norm.for_half()
    assert (HALF_ALIAS, "f16") in half.types and half.entry == norm.entry
    text = render_wgsl(half.family, half.types, half.snippets)
    assert text.startswith("enable f16;\n") and "alias H = f16;" in text and "const HALF: bool = true;" in text
    plain = render_wgsl(norm.family, norm.types, norm.snippets)
    assert "enable f16" not in plain and "const HALF: bool = false;" in plain


def test_self_test_takes_the_models_attention_path(tmp_path: Path) -> None:
    """The self-test's attention has the model's head size and one group of its query heads; its cache is short
    where the model's context takes one pass, one block and more where the model's is split into blocks."""
    from batchgpu.export.precision import CACHE_ROWS, self_test_shapes
    from batchgpu.ops.attention import split_rows

    path = tiny_model(tmp_path, "llama-q8_0")
    weights = open_weights(path)
    config = weights.config
    uploaded = upload_weights(bg.Device("reference"), weights, fuse=True)
    short = self_test_shapes(config, uploaded, 24)
    assert (short.cache_rows, short.kv_heads, short.heads, short.head_dim) == (
        24,
        1,
        config.heads // config.kv_heads,
        config.head_dim,
    )
    block = split_rows(config.head_dim)
    assert self_test_shapes(config, uploaded, block).cache_rows == min(block, CACHE_ROWS)
    assert self_test_shapes(config, uploaded, block + 1).cache_rows == block + CACHE_ROWS
    assert short.qtypes == ("q8_0",) and short.swiglu == ("q8_0",)


@pytest.mark.parametrize("name", sorted(TINY))
def test_self_test_passes_on_wgpu(tmp_path: Path, half_adapter: None, name: str) -> None:
    """The exported self-test of each tiny model (q8_0, q4_0, q4_1, q6_k; joined and separate q/k/v, SwiGLU
    epilogues) on wgpu's adapter, the GPU kernel shapes (lavapipe compiles the CPU shapes slowly; their half forms:
    test_half_kernels_at_odd_shapes): the f32 kernels give the export's values, the f16 kernels the f32 kernels'
    within the stated tolerance, and they differ from them."""
    out = export_chat(tiny_model(tmp_path, name), tmp_path / "app", max_context=24, chunk=4)
    test = json.loads((out / "model.json").read_text())["self_test"]
    assert test["tolerance"] == SELF_TEST_TOLERANCE and test["features"] == ["shader-f16"]
    assert {"attention", "rms_norm", "add_rms_norm", f"matmul {TINY[name][1].lower()}"} <= set(test["cases"])
    check_self_test(out, test)


def test_half_kernels_at_odd_shapes(tmp_path: Path, half_adapter: None, small_bounds: None) -> None:
    """The half forms against numpy at odd shapes: every block format's matmul in the GPU shape (the CPU shape:
    its two tuned entries, its other formats share block_dot), split over K by the small bounds, 37 rows (not a
    multiple of 8); grouped-query attention with a head_dim not a multiple of 4 over a cache split into blocks
    (partials, combine) with a sliding window; norms over rows in pieces. Built as the self-test's program, its
    f16 step run alone (the f32 forms: tests/test_llm_ops.py, tests/test_block_formats.py)."""
    from .plan_runner import PlanRunner

    device = bg.Device("reference")
    for gpu_kernels, qtypes in ((True, tuple(sorted(FORMATS))), (False, ("q4_1", "q8_0"))):
        shapes = SelfTestShapes(
            qtypes=qtypes,
            swiglu=("q4_k",),
            hidden=700,  # over small_bounds' ROW_CHUNK of 300: the norms' two passes
            heads=6,
            kv_heads=2,
            head_dim=38,
            cache_rows=300,
            rope={"theta": 10000.0, "factors": None},
            attention={"window": 50, "scale": None},
            eps=1e-6,
        )
        test, expected = self_test_program(
            device, shapes, device.executor.read_resident, gpu_kernels=gpu_kernels, offered={"shader-f16"}
        )
        folder = tmp_path / f"gpu{int(gpu_kernels)}"
        write_programs(folder, [("self_test/", test)])
        (folder / test.entry["expected"]["file"]).write_bytes(expected)
        pipelines = {p["entry"] for p in test.entry["pipelines"]}
        assert {"attention_partial", "attention_combine", "rms_norm_partials"} <= pipelines
        f16 = PlanRunner(folder, test.entry, steps=["f16"]).run("f16")
        for case, values in expected_values(folder, test.entry).items():
            assert within(f16[case], values, SELF_TEST_TOLERANCE["f16"]) <= 1, (gpu_kernels, case)


@pytest.mark.parametrize("name", ["llama-q8_0", "qwen3-q6_k"])
def test_f16_variant_generates_pythons_ids(tmp_path: Path, half_adapter: None, name: str) -> None:
    """The exported f16 program (float16 KV cache: joined q/k/v written by RoPE's kernel, or separate ones cast;
    half-form kernels) run on wgpu's adapter as the page runs it gives the greedy ids of Python's steps with a
    float16 cache, and the f32 program those of the float32 steps."""
    from .plan_runner import PlanRunner

    path = tiny_model(tmp_path, name)
    out = export_chat(path, tmp_path / "app", max_context=24, chunk=4)
    manifest = json.loads((out / "model.json").read_text())
    variant = manifest["variants"]["f16"]
    assert variant["kv_dtype"] == "float16" and variant["features"] == ["shader-f16"] and manifest["features"] == []
    kv = [b for b in variant["buffers"] if b["name"] in ("k0", "v0")]
    assert [b["size"] for b in kv] == [b["size"] // 2 for b in manifest["buffers"] if b["name"] in ("k0", "v0")]
    device = bg.Device("reference")
    weights = open_weights(path)
    uploaded = upload_weights(device, weights, fuse=True)
    gguf = path.read_bytes()
    for plan, dtype in ((manifest, np.float32), ({**manifest, **variant}, np.float16)):
        runner = PlanRunner(out, plan, gguf=gguf)
        steps = ChatSteps(device, weights.config, uploaded, max_context=24, chunk=4, kv_dtype=dtype)
        for prompt in PROMPTS:
            assert runner.generate(prompt, 8, 4) == list(steps.generate(prompt, 8)), (dtype, prompt)
