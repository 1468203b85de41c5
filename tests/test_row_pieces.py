"""Weight matrices over the device's storage binding limit, held as row pieces (batchgpu/models/row_pieces.py),
reached cheaply on a Device whose ``max_storage_buffer_binding_size`` is lowered (``Device(limits=...)``; wgpu
requests its device with the lower value, so the driver's validation holds it too): the ops over pieces against
numpy on odd shapes, and tiny models whose embedding and head are cut into three pieces (the last one shorter)
against the same model unsplit and a float64 numpy model, on the reference executor and wgpu."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.llama import Llama, weight_bytes
from batchgpu.models.row_pieces import RowPieces, device_row_bytes, embed, project, upload_matrix

from .conftest import random_array
from .test_gemma3 import gemma3_270m  # noqa: F401 - a fixture
from .test_llama_variants import (
    K_DIMS,
    PROMPT,
    VARIANTS,
    float64_logits,
    greedy,
    k_quant_blocks,
    random_weights,
    write_gguf,
)

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test models")

BINDING = "max_storage_buffer_binding_size"
KINDS = ["reference", "wgpu"]


# Device(limits=...) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_device_limits_lower_the_queried_ones(kind):
    device = bg.Device(kind, limits={"max-storage-buffer-binding-size": 4096})
    assert device.limits.max_storage_buffer_binding_size == 4096
    if kind == "wgpu":  # the device itself was requested with it: wgpu validates bindings against it
        assert device.executor.device.limits["max-storage-buffer-binding-size"] == 4096
    with pytest.raises(bg.LimitError, match=r"4100 bytes; max_storage_buffer_binding_size .* is 4096"):
        device.tensor(np.ones(1025, np.float32))
    x = device.tensor(np.arange(1024, dtype=np.float32))
    batch = bg.GpuCommandBatch(device)
    y = batch.add(x, 1.0)
    batch.execute()
    np.testing.assert_array_equal(batch.read(y), np.arange(1024, dtype=np.float32) + 1)


@pytest.mark.parametrize(
    ("limits", "error", "message"),
    [
        ({"max_bogus": 1}, bg.ArgumentError, "'max_bogus' is not a limit that can be lowered"),
        ({"min_uniform_buffer_offset_alignment": 512}, bg.ArgumentError, "not a limit that can be lowered"),
        ({BINDING: 0}, bg.ArgumentError, "must be an int >= 1, got 0"),
        ({BINDING: True}, bg.ArgumentError, "must be an int >= 1, got True"),
        ({BINDING: 4096.0}, bg.ArgumentError, "must be an int >= 1, got 4096.0"),
        ({BINDING: 2**63}, bg.LimitError, "above the .* limits can only be lowered"),
        ([(BINDING, 4096)], bg.ArgumentError, "limits must be a mapping"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_device_limits_refuse_what_they_cannot_lower(kind, limits, error, message):
    with pytest.raises(error, match=message):
        bg.Device(kind, limits=limits)
    assert bg.Device(kind).limits.max_storage_buffer_binding_size > 4096  # devices still come up whole


# the ops over pieces -------------------------------------------------------------------------------------


def pieces_device(kind: str, row_bytes: int, rows: int) -> bg.Device:
    """A device binding ``rows`` rows of ``row_bytes`` at most."""
    return bg.Device(kind, limits={BINDING: row_bytes * rows})


def record(device: bg.Device, build) -> np.ndarray:
    batch = bg.GpuCommandBatch(device)
    out = build(batch)
    batch.execute()
    return batch.read(out)


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_over_pieces_is_the_whole_tables(kind):
    """37 rows in pieces of 16, 16 and 5: every id gives its row exactly, ids outside the table zero rows."""
    rng = np.random.default_rng(5)
    table = random_array(rng, (37, 24), np.float32)
    device = pieces_device(kind, 24 * 4, 16)
    weight = upload_matrix(device, table, None, table.shape, name="table")
    assert isinstance(weight, RowPieces) and [p.shape[0] for p in weight.pieces] == [16, 16, 5]
    ids = np.array([[0, 15, 16, 31], [32, 36, 37, -1], [2**31 - 1, -(2**31), 20, 5]], np.int32)
    expected = np.where(((ids >= 0) & (ids < 37))[..., None], table[np.clip(ids, 0, 36)], 0)
    got = record(device, lambda b: embed(b, b.upload(ids), weight))
    np.testing.assert_array_equal(got, expected)


def matmul_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A float32 dot product of length K in any order is within K x 2^-24 x sum|x_k w_k| of the exact one (plus
    the rounding of a bias add)."""
    return x.shape[1] * 2.0**-24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T) + 1e-7


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("qtype", [None, "q8_0", "q4_k"])
def test_projection_over_pieces_matches_numpy(kind, qtype):
    """``x @ W.T (+ bias)`` over 3 pieces (the last shorter), and the swiglu epilogue over pieces of whole
    (gate, up) pairs, against float64 numpy of what the weights mean; the float dot products' order may differ
    from numpy's (and between drivers), so each element is held to the float32 bound of its sum."""
    rng = np.random.default_rng(11)
    k = 256 if qtype == "q4_k" else 64
    rows = 2 * 23
    floats = random_array(rng, (rows, k), np.float32)
    if qtype is None:
        data, meant = floats, floats
    else:
        q8 = qtype == "q8_0"
        data = (
            gguf.quants.quantize(floats, gguf.GGMLQuantizationType.Q8_0)
            if q8
            else k_quant_blocks(rng, "Q4_K", (rows, k))
        )
        reference = bg.Device("reference")
        meant = reference.read(reference.quantized(data, qtype, (rows, k)))
    row_bytes = device_row_bytes(data, qtype, k)
    device = pieces_device(kind, row_bytes, 19)
    weight = upload_matrix(device, data, qtype, (rows, k), name="w")
    paired = upload_matrix(device, data, qtype, (rows, k), name="w", multiple=2)
    assert [p.shape[0] for p in weight.pieces] == [19, 19, 8]
    assert [p.shape[0] for p in paired.pieces] == [18, 18, 10]
    x = random_array(rng, (2, k), np.float32)  # within the lowered binding (q4_k: 19 rows of 144 bytes)
    bias = random_array(rng, (rows,), np.float32)

    def run(weight, **extra):
        def build(b):
            return project(b, b.upload(x), weight, **{n: b.upload(v) if n == "bias" else v for n, v in extra.items()})

        return record(device, build)

    exact = x.astype(np.float64) @ meant.astype(np.float64).T
    bound = matmul_bound(x, meant)
    assert np.all(np.abs(run(weight) - exact) <= bound)
    assert np.all(np.abs(run(weight, bias=bias) - (exact + bias)) <= bound + np.abs(exact + bias) * 2.0**-23)
    gate, up = exact[:, 0::2], exact[:, 1::2]
    swiglu = gate / (1 + np.exp(-gate)) * up
    tolerance = 1e-5 * np.abs(swiglu).max()  # silu's exp and divide in float32 (the op's own contract)
    np.testing.assert_allclose(run(paired, epilogue="swiglu"), swiglu, rtol=0, atol=tolerance)


def test_a_matrix_that_fits_stays_one_tensor_and_a_row_over_the_limit_is_refused():
    device = bg.Device("reference", limits={BINDING: 64 * 4 * 10})
    assert isinstance(upload_matrix(device, np.ones((10, 64), np.float32), None, (10, 64), name="w"), bg.Tensor)
    with pytest.raises(bg.LimitError, match=r"Device.tensor wide: .* 5128 bytes; max_storage_buffer_binding_size"):
        upload_matrix(device, np.ones((2, 641), np.float32), None, (2, 641), name="wide")
    with pytest.raises(bg.LimitError, match=r"Device.tensor bias: .*max_storage_buffer_binding_size"):
        upload_matrix(device, np.ones(641, np.float32), None, (641,), name="bias")  # vectors are never cut


# tiny models ---------------------------------------------------------------------------------------------

MODELS = [("llama", "F32"), ("qwen2", "F32"), ("qwen2", "Q8_0"), ("llama", "Q4_K")]
"""Tied (llama) and untied (qwen2, whose q/k/v biases are sliced with their pieces) heads, a float and two block
formats."""


def tiny_model(tmp_path, variant: str, qtype: str) -> tuple[dict, dict[str, np.ndarray], object, int]:
    """A 300-token model of ``variant`` in ``qtype``: (sizes, the weights the file means, its path, the binding
    limit that cuts its embedding into 128 + 128 + 44 rows)."""
    d = dict(VARIANTS[variant], vocab=300, **(K_DIMS if qtype.endswith("_K") else {}))
    path = tmp_path / f"{variant}-{qtype}.gguf"
    meant = write_gguf(path, variant, random_weights(d, 5), qtype, d)
    fmt = None if qtype == "F32" else qtype.lower()
    limit = 128 * device_row_bytes(np.zeros(1, np.float32), fmt, d["hidden"])
    return d, meant, path, limit


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("variant", "qtype"), MODELS)
def test_a_model_over_the_binding_limit_runs_in_pieces(tmp_path, kind, variant, qtype):
    """The embedding and the head in pieces of 128, 128 and 44 rows (other matrices over the limit too, in
    pieces of their own): prefill logits within 1e-5 x max|logit| of the unsplit model's and of the float64
    model's, and the same greedy ids."""
    d, meant, path, limit = tiny_model(tmp_path, variant, qtype)
    quantized = qtype != "F32"
    whole = Llama(bg.Device(kind), path, max_context=32, quantized=quantized)
    split = Llama(bg.Device(kind, limits={BINDING: limit}), path, max_context=32, quantized=quantized)
    assert not any(isinstance(w, RowPieces) for w in whole.params.values())
    assert weight_bytes(split.params) == weight_bytes(whole.params)
    heads = ["token_embd.weight"] + (["output.weight"] if "output.weight" in meant else [])
    for name in heads:
        assert [p.shape[0] for p in split.params[name].pieces] == [128, 128, 44]
    expected = float64_logits(d, meant, PROMPT)
    step = whole.prefill(PROMPT)
    unsplit = step.batch.read(step.logits)[0]
    step = split.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    tolerance = 1e-5 * np.abs(expected).max()
    np.testing.assert_allclose(logits, unsplit, rtol=0, atol=tolerance)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=tolerance)
    ids = list(split.generate(PROMPT, 4))
    assert ids == list(whole.generate(PROMPT, 4)) == greedy(d, meant, PROMPT, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_serves_a_model_in_pieces(tmp_path, kind):
    """The engine's batched steps (paged KV, logits of several rows, on-device sampling) over an untied head in
    pieces: greedy ids equal the float64 model's."""
    d, meant, path, limit = tiny_model(tmp_path, "qwen2", "Q8_0")
    device = bg.Device(kind, limits={BINDING: limit})
    engine = Engine(path, device, max_batch=2, max_context=32, block_size=4, max_step_tokens=4)
    assert isinstance(engine.weights["output.weight"], RowPieces)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert engine.complete(PROMPT, params).token_ids == greedy(d, meant, PROMPT, 5)


# the real Gemma 3 270M on wgpu ---------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_270m_on_wgpu_continues_like_llama_cpp(gemma3_270m):  # noqa: F811
    """Its 262,144 x 640 Q8_0 token embedding (tied head) is 189 MB on the device, over lavapipe's 128 MiB
    binding (and a browser's): held in pieces cut by the device's own limit, the engine on wgpu gives
    llama.cpp's greedy continuation (8-16 s on lavapipe, 2 shared cores)."""
    device = bg.Device("wgpu")
    engine = Engine(gemma3_270m, device, max_batch=1, max_context=16)
    table = engine.weights["token_embd.weight"]
    if isinstance(table, bg.Tensor):
        pytest.skip(f"{device.name} binds the whole embedding: nothing is cut")
    assert table.shape == (262144, 640) and len(table.pieces) == 2
    piece = engine.complete("The capital of France is", SamplingParams(max_tokens=6, temperature=0.0))
    assert (piece.text, piece.prompt_tokens) == (" the capital of the country of", 6)
