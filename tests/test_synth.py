"""Synthetic checkpoints (``python -m batchgpu synth``, batchgpu/models/synth.py) and the quantizers behind them
(batchgpu/quantize.py): the file holds the preset's metadata and the tensors llama.cpp expects (names, shapes,
types, read back with the ``gguf`` package's own reader), weights of the promised scale, blocks that round-trip
through both dequantizers, and a model that batchgpu loads and decodes as a float64 numpy forward of the same
dequantized weights does. Bad requests are refused before anything is written."""

from __future__ import annotations

import re

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import cli, quant
from batchgpu.errors import ArgumentError, DTypeError, ShapeError
from batchgpu.models.llama import Llama
from batchgpu.models.loader import open_weights
from batchgpu.models.synth import PRESETS, write_synthetic
from batchgpu.quantize import quantize

from .test_llama_variants import float64_logits, greedy, llama3_rope_freqs, permute

gguf = pytest.importorskip("gguf", reason="the gguf package reads the files back")

TINY = ("tiny-llama", "tiny-qwen2")
SYNTH_FORMATS = ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "f16", "bf16")
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
LAYER_NAMES = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
)


def reader_fields(reader) -> dict:
    """The metadata values of a ``gguf.GGUFReader`` (arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def dequantized(tensor) -> np.ndarray:
    """A tensor of a GGUFReader as float64 in numpy order, through the ``gguf`` package's dequantization."""
    values = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return np.asarray(values, np.float64).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def variant(preset) -> dict:
    """tests/test_llama_variants.py's description of the preset's model (its float64 forward reads it)."""
    scaling = None
    if preset.rope_scaling is not None:
        factor, low, high, original = preset.rope_scaling
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = dict(zip(keys, (factor, low, high, original)))
    return dict(
        layers=preset.layers,
        hidden=preset.hidden,
        heads=preset.heads,
        kv_heads=preset.kv_heads,
        head_dim=preset.hidden // preset.heads,
        ffn=preset.ffn,
        vocab=preset.vocab,
        eps=preset.eps,
        theta=preset.theta,
        qk_norm=False,
        scaling=scaling,
    )


def expected_tensors(preset) -> set[str]:
    """The tensor names llama.cpp's loader asks for (written out here, not taken from batchgpu)."""
    names = {"token_embd.weight", "output_norm.weight"}
    names |= {"rope_freqs.weight"} if preset.rope_scaling else set()
    names |= set() if preset.tied else {"output.weight"}
    biases = ("attn_q.bias", "attn_k.bias", "attn_v.bias") if preset.biases else ()
    return names | {f"blk.{i}.{name}" for i in range(preset.layers) for name in (*LAYER_NAMES, *biases)}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """Each tiny preset in each format, written once for the module."""
    folder = tmp_path_factory.mktemp("synth")
    files = {}
    for name in TINY:
        for fmt in SYNTH_FORMATS:
            files[name, fmt] = write_synthetic(folder / f"{name}-{fmt}.gguf", name, fmt, seed=3, show=False).path
    return files


@pytest.mark.parametrize("name", TINY)
def test_metadata_is_the_preset(tiny_files, name):
    preset = PRESETS[name]
    for fmt in SYNTH_FORMATS:
        fields = reader_fields(gguf.GGUFReader(tiny_files[name, fmt]))
        arch = preset.architecture
        expected = {
            "general.architecture": arch,
            f"{arch}.block_count": preset.layers,
            f"{arch}.context_length": preset.context,
            f"{arch}.embedding_length": preset.hidden,
            f"{arch}.feed_forward_length": preset.ffn,
            f"{arch}.attention.head_count": preset.heads,
            f"{arch}.attention.head_count_kv": preset.kv_heads,
            f"{arch}.rope.dimension_count": preset.hidden // preset.heads,
            f"{arch}.vocab_size": preset.vocab,
            "general.file_type": gguf.LlamaFileType[
                {"q4_k": "MOSTLY_Q4_K_S", "q5_k": "MOSTLY_Q5_K_S"}.get(fmt, f"MOSTLY_{fmt.upper()}")
            ],
            "general.quantization_version": 2,
            "tokenizer.ggml.model": "gpt2",
        }
        assert {key: fields.get(key) for key in expected} == expected
        assert fields[f"{arch}.rope.freq_base"] == pytest.approx(preset.theta, rel=1e-7)
        assert fields[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(preset.eps, rel=1e-6)
        tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
        assert len(tokens) == len(types) == preset.vocab and len(set(tokens)) == preset.vocab
        assert types[-1] == 5 and tokens[-1] == f"[PAD{preset.vocab - 1}]"  # unused padding, as the converter's
        assert tokens[fields["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"


@pytest.mark.parametrize("name", TINY)
def test_tensors_are_those_llama_cpp_expects(tiny_files, name):
    """Names, shapes (GGUF lists them innermost first) and types: 1-D in F32, matrices in the format, K-quant
    rows that are not whole super-blocks in llama.cpp's fallback (tiny-qwen2's 160-wide rows)."""
    preset = PRESETS[name]
    hd = preset.hidden // preset.heads
    for fmt in SYNTH_FORMATS:
        tensors = {t.name: t for t in gguf.GGUFReader(tiny_files[name, fmt]).tensors}
        assert set(tensors) == expected_tensors(preset)
        assert [int(n) for n in tensors["token_embd.weight"].shape] == [preset.hidden, preset.vocab]
        assert [int(n) for n in tensors["blk.1.attn_k.weight"].shape] == [preset.hidden, preset.kv_heads * hd]
        assert [int(n) for n in tensors["blk.0.ffn_down.weight"].shape] == [preset.ffn, preset.hidden]
        for tensor_name, tensor in tensors.items():
            kind = tensor.tensor_type.name.lower()
            if len(tensor.shape) == 1:
                assert kind == "f32", tensor_name
            else:
                row = int(tensor.shape[0])
                assert kind == (FALLBACK[fmt] if fmt in FALLBACK and row % 256 else fmt), (tensor_name, kind)
    if name == "tiny-qwen2":  # 160-wide rows fall back; ffn_down's rows of 256 stay K-quants
        tensors = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tiny_files[name, "q6_k"]).tensors}
        assert tensors["blk.0.attn_q.weight"] == "Q8_0" and tensors["blk.0.ffn_down.weight"] == "Q6_K"


def test_weights_have_a_realistic_scale(tiny_files):
    """Matrices: mean 0, std 0.02 (within 5%: quantization error and sampling); norms 1 + 0.02 noise; the
    RoPE factors llama.cpp's converter computes for Llama 3."""
    preset = PRESETS["tiny-llama"]
    for fmt in SYNTH_FORMATS:
        reader = gguf.GGUFReader(tiny_files["tiny-llama", fmt])
        tensors = {t.name: dequantized(t) for t in reader.tensors}
        matrices = np.concatenate([a.reshape(-1) for n, a in tensors.items() if a.ndim == 2])
        assert abs(matrices.mean()) < 1e-3 and 0.019 < matrices.std() < 0.021, (fmt, matrices.std())
        norms = np.concatenate([a for n, a in tensors.items() if n.endswith("norm.weight")])
        assert abs(norms.mean() - 1) < 0.01 and 0.015 < norms.std() < 0.025
        np.testing.assert_allclose(tensors["rope_freqs.weight"], llama3_rope_freqs(variant(preset)), rtol=1e-6)
    qwen = {t.name: dequantized(t) for t in gguf.GGUFReader(tiny_files["tiny-qwen2", "q8_0"]).tensors}
    biases = np.concatenate([a for n, a in qwen.items() if n.endswith(".bias")])
    assert abs(biases.mean()) < 0.005 and 0.015 < biases.std() < 0.025


def quantization_steps(blocks: np.ndarray, name: str) -> np.ndarray:
    """Each weight's quantization step, from its block's bytes: d (Q4_0, Q5_0, Q8_0, Q4_1, Q5_1), d times the
    sub-block's scale (K-quants), one float16 / bfloat16 ulp of the weight."""
    fmt = quant.FORMATS[name]
    half = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    if name in ("q4_0", "q5_0", "q8_0", "q4_1", "q5_1"):
        return np.repeat(np.abs(half), fmt.weights, axis=1)
    if name in ("q4_k", "q5_k"):
        scales, _ = quant.k_scales(blocks[:, 4:16])
        return np.repeat(half * scales, 32, axis=1)
    if name == "q6_k":
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)
        return np.repeat(d * blocks[:, 192:208].view(np.int8), 16, axis=1)
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(quant.FORMATS))
def test_quantizers_round_trip_through_both_dequantizers(name):
    """Normal weights (odd block counts, a sub-block of positive weights, one of zeros): batchgpu's device
    layout dequantizes to the gguf package's values bit for bit, each within one quantization step of the
    weight (half a step for the K-quants written here); scales finite and non-negative."""
    fmt = quant.FORMATS[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    rows, k = 7, fmt.weights * 3
    x = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
    x[0, :32] = np.abs(x[0, :32]) + 0.01
    x[1, :32] = 0
    blocks = quantize(x, name)
    assert blocks.shape == (rows * k // fmt.weights, fmt.gguf_bytes) and blocks.dtype == np.uint8
    ours = quant.dequantize_words(quant.to_device_words(blocks, name, (rows, k)), name, (rows, k))
    theirs = gguf.quants.dequantize(blocks.reshape(-1), gguf.GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(ours.view(np.uint32), np.asarray(theirs, np.float32).reshape(rows, k).view(np.uint32))
    error = np.abs(ours.astype(np.float64) - x).reshape(-1, fmt.weights)
    if name in ("f16", "bf16"):
        relative, subnormal = (2**-11, 2**-25) if name == "f16" else (2**-8, 0)  # half an ulp
        assert np.all(error <= np.abs(x.reshape(error.shape)) * relative + subnormal)
        return
    step = quantization_steps(blocks, name)
    assert np.isfinite(step).all() and (step >= 0).all()
    bound = (0.5 if name.endswith("_k") else 1.0) * step * (1 + 1e-5) + 1e-9
    assert np.all(error <= bound), (name, (error - bound).max())
    assert np.all(ours[1, :32] == 0)


def test_quantize_refuses_what_it_cannot_represent():
    with pytest.raises(ShapeError, match=r"quantize q4_k: 300 weights are not whole blocks of 256"):
        quantize(np.ones(300, np.float32), "q4_k")
    with pytest.raises(DTypeError, match=r"quantize q8_0: the weights must be finite"):
        quantize(np.array([np.nan] * 32, np.float32), "q8_0")
    with pytest.raises(DTypeError, match=r"block format 'q3_k' is not supported"):
        quantize(np.ones(256, np.float32), "q3_k")


def meant_weights(path, preset) -> dict[str, np.ndarray]:
    """The weights the file means in transformers' layout: dequantized by the gguf package, llama's q/k rows
    unpermuted (the inverse of the converter's permutation)."""
    weights = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        array = dequantized(tensor)
        if preset.architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = preset.heads if "attn_q" in tensor.name else preset.kv_heads
            inverse = np.argsort(permute(np.arange(array.shape[0]), heads))
            array = array[inverse]
        weights[tensor.name] = array
    return weights


@pytest.mark.parametrize(("name", "fmt"), [("tiny-llama", "q4_k"), ("tiny-qwen2", "q4_1")])
def test_batchgpu_decodes_the_file_as_float64_numpy(tiny_files, name, fmt):
    """Greedy ids on the reference executor equal a float64 forward of the gguf package's dequantization
    (prefill logits within 1e-5 of the largest); the tokenizer and chat template load from the file."""
    preset, path = PRESETS[name], tiny_files[name, fmt]
    model = Llama(bg.Device("reference"), path, max_context=16)
    prompt = [104, 105, 33, 258]
    d, weights = variant(preset), meant_weights(path, preset)
    expected = float64_logits(d, weights, prompt)
    step = model.prefill(prompt)
    np.testing.assert_allclose(step.batch.read(step.logits)[0], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(model.generate(prompt, 4)) == greedy(d, weights, prompt, 4)
    codec = model.weights.codec()
    assert codec.encode("hi!") == [104, 105, 33]
    assert codec.decode(codec.encode_chat([{"role": "user", "content": "hi"}])) == "user\nhi\nassistant\n"


def test_the_same_seed_writes_the_same_file(tmp_path):
    paths = [write_synthetic(tmp_path / f"{i}.gguf", "tiny-qwen2", "q4_k", seed=s, show=False).path
             for i, s in enumerate((5, 5, 6))]  # fmt: skip
    first, again, other = (p.read_bytes() for p in paths)
    assert first == again and first != other and len(first) == len(other)
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "llama-9b", "--format", "q4_0"], r"--preset must be one of qwen2.5-0.5b, .*, got 'llama-9b'"),
        (["--preset", "tiny-llama", "--format", "q3_k"], r"--format must be one of q4_0, q4_1, .*, got 'q3_k'"),
        (["--preset", "tiny-llama", "--format", "q4_0", "--vocab", "x"], r"--vocab must be one of bytes, smollm2"),
        (["--preset", "tiny-llama", "--format", "q4_0", "--vocab", "smollm2"], r"49152 tokens, more than 512"),
        (["--preset", "tiny-llama", "--format", "q4_0", "--seed", "-1"], r"--seed must be at least 0, got -1"),
    ],
)
def test_the_command_refuses_bad_requests(tmp_path, capsys, args, message):
    out = tmp_path / "model.gguf"
    assert cli.main(["synth", *args, "--out", str(out)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == []
    assert (
        cli.main(["synth", "--preset", "tiny-llama", "--format", "q8_0", "--out", str(tmp_path / "no" / "m.gguf")]) == 2
    )
    assert "--out must be a file path in an existing folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ArgumentError, match="is a directory"):
        write_synthetic(tmp_path, "tiny-llama", "q8_0")
    assert cli.main(["synth", "--preset", "tiny-llama", "--format", "q8_0", "--out", str(out)]) == 0  # still works
    assert "21 tensors" in capsys.readouterr().out and out.is_file()


@pytest.mark.slow
def test_the_real_qwen_preset_with_smollm2s_vocabulary(tmp_path):
    """qwen2.5-0.5b in Q4_0 with SmolLM2's vocabulary padded to Qwen's 151936: its real sizes and the
    K-quant-free file (every 896-wide row a Q4_0 block row) load in batchgpu, tokenizer included."""
    written = write_synthetic(tmp_path / "qwen.gguf", "qwen2.5-0.5b", "q4_0", vocab="smollm2", show=False)
    weights = open_weights(written.path)
    config = weights.config
    assert (config.hidden, config.layers, config.heads, config.kv_heads, config.ffn, config.vocab) == (
        896, 24, 14, 2, 4864, 151936
    )  # fmt: skip
    assert weights.layout("token_embd.weight") == ("q4_0", (151936, 896)) and "output.weight" not in weights.names()
    assert written.bytes == pytest.approx(0.5e9 * 18 / 32, rel=0.15)
    codec = weights.codec()
    assert codec.decode(codec.encode("The capital of France")) == "The capital of France"
    assert codec.encode_chat([{"role": "user", "content": "hi"}])[0] == 1  # SmolLM2's <|im_start|>
