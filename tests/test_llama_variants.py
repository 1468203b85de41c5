"""Llama-family variants from tiny random models written here (no downloads), as GGUF files (``gguf.GGUFWriter``,
float32 and block formats) and as Hugging Face directories (``config.json`` + safetensors, one file or shards):

- llama: q/k rows permuted by llama.cpp's converter, tied output head, grouped-query attention 2:1;
- llama3: Llama 3.1's RoPE scaling (GGUF ``rope_freqs``, HF ``rope_scaling``), theta 500000, GQA 4:1;
- qwen2: q/k/v biases, untied head, rows as they are;
- qwen3: q/k RMS norms, a head size other than hidden / heads, untied head.

Prefill logits of the batchgpu model match a float64 numpy model of each architecture written here
(transformers' conventions: rotate-half RoPE) within 1e-5 x max|logit|, and greedy ids match. Where torch
is installed, transformers' own models of the same checkpoints are the reference too (tests/test_hf_models.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest

import batchgpu as bg
from batchgpu import quant
from batchgpu.models.llama import Llama

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test models")

PROMPT = [3, 17, 42, 8, 29]
BASE = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=50, eps=1e-5, theta=10000.0)
LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
VARIANTS = {
    "llama": dict(BASE, biases=False, tied=True, qk_norm=False, scaling=None),
    "llama3": dict(BASE, kv_heads=1, theta=500000.0, biases=False, tied=False, qk_norm=False, scaling=LLAMA3_SCALING),
    "qwen2": dict(BASE, biases=True, tied=False, qk_norm=False, scaling=None),
    "qwen3": dict(BASE, head_dim=32, biases=False, tied=False, qk_norm=True, scaling=None),
}
GGUF_ARCHITECTURE = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def random_weights(d: dict, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights in transformers' layout, named as in GGUF."""
    rng = np.random.default_rng(seed)
    hd = d["head_dim"]

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    w = {"token_embd.weight": matrix(d["vocab"], d["hidden"]) * 4, "output_norm.weight": norm(d["hidden"])}
    for i in range(d["layers"]):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"], w[b + "ffn_norm.weight"] = norm(d["hidden"]), norm(d["hidden"])
        w[b + "attn_q.weight"] = matrix(d["heads"] * hd, d["hidden"])
        w[b + "attn_k.weight"] = matrix(d["kv_heads"] * hd, d["hidden"])
        w[b + "attn_v.weight"] = matrix(d["kv_heads"] * hd, d["hidden"])
        w[b + "attn_output.weight"] = matrix(d["hidden"], d["heads"] * hd)
        w[b + "ffn_gate.weight"] = matrix(d["ffn"], d["hidden"])
        w[b + "ffn_up.weight"] = matrix(d["ffn"], d["hidden"])
        w[b + "ffn_down.weight"] = matrix(d["hidden"], d["ffn"])
        if d["qk_norm"]:
            w[b + "attn_q_norm.weight"], w[b + "attn_k_norm.weight"] = norm(hd), norm(hd)
        if d["biases"]:
            for name, heads in (("attn_q", d["heads"]), ("attn_k", d["kv_heads"]), ("attn_v", d["kv_heads"])):
                w[b + name + ".bias"] = (0.5 * rng.standard_normal(heads * hd)).astype(np.float32)
    if not d["tied"]:
        w["output.weight"] = matrix(d["vocab"], d["hidden"])
    return w


def inverse_frequencies(d: dict) -> np.ndarray:
    """RoPE's inverse frequencies, Llama 3.1-scaled as transformers' ``_compute_llama3_parameters`` does."""
    hd = d["head_dim"]
    inv = 1.0 / d["theta"] ** (np.arange(0, hd, 2) / hd)
    s = d["scaling"]
    if s is None:
        return inv
    old = s["original_max_position_embeddings"]
    low_wavelength, high_wavelength = old / s["low_freq_factor"], old / s["high_freq_factor"]
    wavelength = 2 * math.pi / inv
    scaled = np.where(wavelength > low_wavelength, inv / s["factor"], inv)
    smooth = (old / wavelength - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(medium, smoothed, scaled)


def float64_logits(d: dict, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """The architecture in float64 numpy: the last token's logits."""
    hd = d["head_dim"]
    f = {name: a.astype(np.float64) for name, a in weights.items()}

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + d["eps"]) * g

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ f[name + ".weight"].T + f.get(name + ".bias", 0.0)

    def rope(x: np.ndarray) -> np.ndarray:
        angle = np.arange(x.shape[0])[:, None] * inverse_frequencies(d)[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    t = len(ids)
    h = f["token_embd.weight"][ids]
    for i in range(d["layers"]):
        b = f"blk.{i}."
        x = rms(h, f[b + "attn_norm.weight"])
        q = linear(x, b + "attn_q").reshape(t, d["heads"], hd)
        k = linear(x, b + "attn_k").reshape(t, d["kv_heads"], hd)
        v = linear(x, b + "attn_v").reshape(t, d["kv_heads"], hd)
        if d["qk_norm"]:
            q, k = rms(q, f[b + "attn_q_norm.weight"]), rms(k, f[b + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        group = d["heads"] // d["kv_heads"]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        scores += np.triu(np.full((t, t), -np.inf), 1)
        if d.get("window"):
            scores += np.tril(np.full((t, t), -np.inf), -d["window"])
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        h = h + np.einsum("hts,shd->thd", p, v).reshape(t, -1) @ f[b + "attn_output.weight"].T
        x = rms(h, f[b + "ffn_norm.weight"])
        gate, up = x @ f[b + "ffn_gate.weight"].T, x @ f[b + "ffn_up.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ f[b + "ffn_down.weight"].T
    head = f.get("output.weight", f["token_embd.weight"])
    return rms(h, f["output_norm.weight"])[-1] @ head.T


def greedy(d: dict, weights: dict[str, np.ndarray], prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(np.argmax(float64_logits(d, weights, ids))))
        ids.append(out[-1])
    return out


# GGUF files ------------------------------------------------------------------------------------------


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (for interleaved RoPE)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_freqs(d: dict) -> np.ndarray:
    """llama.cpp's converter's ``rope_freqs`` tensor: the divisor of each pair's frequency."""
    return (1.0 / d["theta"] ** (np.arange(0, d["head_dim"], 2) / d["head_dim"]) / inverse_frequencies(d)).astype(
        np.float32
    )


MIXES = {"Q4_K_M": ("Q6_K", ("attn_v.", "ffn_down.", "output.")), "Q5_K_S": ("Q6_K", ("output.",))}
"""llama.cpp-style mixes: (a format for tensors named so, their names); every other matrix Q4_K / Q5_K."""


def tensor_type(name: str, qtype: str) -> str:
    if qtype in MIXES:
        other, names = MIXES[qtype]
        return other if any(n in name for n in names) else qtype[:4]
    return qtype


def k_quant_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """Random valid K-quant blocks (the gguf package cannot quantize to them) whose float16 scales are
    scaled so the weights they mean have the spread of ``1 / sqrt(K)``."""
    from .test_block_formats import SCALE_OFFSETS, gguf_dequantized, random_blocks

    name = qtype.lower()
    blocks = random_blocks(rng, name, *shape).reshape(-1, quant.FORMATS[name].gguf_bytes)
    spread = gguf_dequantized(blocks.reshape(-1), name, shape).std() * np.sqrt(shape[1])
    for at in SCALE_OFFSETS[name]:
        scales = blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32) / spread
        blocks[:, at : at + 2] = scales.astype(np.float16).view(np.uint8)
    return blocks.reshape(shape[0], -1)


def stored(name: str, array: np.ndarray, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, object]:
    """(what the file holds, the weights it means, the GGUF type) of a weight stored as ``qtype`` (2-D only)."""
    qtype = tensor_type(name, qtype)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32" or array.ndim != 2:
        return array, array, gguf.GGMLQuantizationType.F32
    quantized = k_quant_blocks(rng, qtype, array.shape) if qtype.endswith("_K") else gguf.quants.quantize(array, kind)
    return quantized, gguf.quants.dequantize(quantized, kind).astype(np.float32).reshape(array.shape), kind


def tiny_tokenizer(writer: object, vocab: int, model: str = "gpt2") -> None:
    """A vocabulary of single characters with an end token (2) and a chat template: byte-level BPE ("gpt2", no
    merges: the file has no merges key, which llama.cpp refuses) or SentencePiece ("llama", scores all 0,
    which llama.cpp loads)."""
    tokens = [chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26) for i in range(vocab)]
    writer.add_tokenizer_model(model)
    writer.add_token_list(tokens)
    if model == "llama":
        writer.add_token_scores([0.0] * vocab)
    else:
        writer.add_token_merges([])
    writer.add_token_types([1] * vocab)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def tiny_sizes(d: dict) -> dict[str, int]:
    """The ``<architecture>.*`` sizes every tiny file writes (``write_tiny_gguf``' ``sizes`` start from these)."""
    return {
        "block_count": d["layers"],
        "embedding_length": d["hidden"],
        "attention.head_count": d["heads"],
        "attention.head_count_kv": d["kv_heads"],
        "attention.key_length": d["head_dim"],
        "attention.value_length": d["head_dim"],
        "feed_forward_length": d["ffn"],
        "context_length": 64,
    }


def write_tiny_gguf(
    path,
    architecture: str,
    d: dict,
    weights: dict[str, np.ndarray],
    qtype: str,
    sizes: dict[str, int],
    *,
    seed: int,
    rows: Callable[[str, np.ndarray], np.ndarray] = lambda name, data: data,
    tokenizer: str = "gpt2",
) -> dict[str, np.ndarray]:
    """A tiny model's GGUF: ``sizes`` as ``<architecture>.*`` keys, eps, RoPE base, the tiny tokenizer (as
    ``tokenizer``), Llama 3's ``rope_freqs`` where ``d`` scales RoPE, then each weight as ``qtype`` stores it
    (``rows``: what the file holds of a weight's stored rows). Returns the weights the file means (blocks
    dequantized by gguf)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in sizes.items():
        writer.add_uint32(f"{architecture}.{key}", value)
    writer.add_layer_norm_rms_eps(d["eps"])
    writer.add_rope_freq_base(d["theta"])
    tiny_tokenizer(writer, d["vocab"], tokenizer)
    if d.get("scaling") is not None:
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(d))
    meant = {}
    for name, array in weights.items():
        data, meant[name], kind = stored(name, array, qtype, rng)
        writer.add_tensor(name, rows(name, data), raw_dtype=kind if kind != gguf.GGMLQuantizationType.F32 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant


def write_gguf(
    path, variant: str, weights: dict[str, np.ndarray], qtype: str = "F32", d: dict | None = None, **metadata: int
):
    """Write the model; returns the weights the file means (blocks dequantized by the gguf package)."""
    d, architecture = d or VARIANTS[variant], GGUF_ARCHITECTURE[variant]
    sizes = {**tiny_sizes(d), "rope.dimension_count": d["head_dim"]}
    sizes.update({key.replace("__", "."): value for key, value in metadata.items()})

    def llama_rows(name: str, data: np.ndarray) -> np.ndarray:  # llama.cpp's q/k permutation for its rope
        if architecture == "llama" and ".attn_q." in name:
            return permute(data, d["heads"])
        if architecture == "llama" and ".attn_k." in name:
            return permute(data, d["kv_heads"])
        return data

    return write_tiny_gguf(path, architecture, d, weights, qtype, sizes, seed=99, rows=llama_rows)


def check_model(model: Llama, d: dict, weights: dict[str, np.ndarray]) -> None:
    expected = float64_logits(d, weights, PROMPT)
    step = model.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(model.generate(PROMPT, 4)) == greedy(d, weights, PROMPT, 4)


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_gguf_variant_matches_float64_numpy(tmp_path, variant, kind):
    d = VARIANTS[variant]
    weights = random_weights(d, len(variant))
    path = tmp_path / f"{variant}.gguf"
    write_gguf(path, variant, weights)
    device = bg.Device(kind)
    for fuse in (True, False):
        model = Llama(device, path, quantized=False, max_context=32, fuse=fuse)
        assert model.config.architecture == GGUF_ARCHITECTURE[variant]
        check_model(model, d, weights)


K_DIMS = dict(hidden=256, heads=8, kv_heads=2, head_dim=32, ffn=512)
"""Sizes whose rows are whole 256-weight super-blocks (K-quants)."""


@pytest.mark.parametrize(
    ("variant", "qtype"),
    [
        ("llama", "Q8_0"),
        ("llama3", "Q4_0"),
        ("qwen2", "F16"),
        ("qwen3", "Q5_1"),
        ("llama", "Q4_K_M"),
        ("qwen3", "Q5_K_S"),
    ],
)
@pytest.mark.parametrize("kind", ["reference", "wgpu"])
def test_tiny_gguf_variant_in_block_formats(tmp_path, variant, qtype, kind):
    """The weights stay in their block formats on the device (K-quant mixes as llama.cpp's Q4_K_M / Q5_K_S
    files hold them); the reference is the float64 model of what the blocks mean (the gguf package's
    dequantization)."""
    d = dict(VARIANTS[variant], **(K_DIMS if qtype in MIXES else {}))
    path = tmp_path / f"{variant}.gguf"
    meant = write_gguf(path, variant, random_weights(d, 7), qtype, d)
    model = Llama(bg.Device(kind), path, max_context=32)
    assert model.params["blk.0.ffn_down.weight"].qtype == tensor_type("ffn_down.", qtype).lower()
    assert model.params["blk.0.attn_output.weight"].qtype == tensor_type("attn_output.", qtype).lower()
    check_model(model, d, meant)


def test_engine_serves_a_variant(tmp_path):
    """The engine (paged KV cache, on-device sampling) on a Qwen3 model: greedy ids equal the float64 model's."""
    from batchgpu.llm import Engine, SamplingParams

    d = VARIANTS["qwen3"]
    weights = random_weights(d, 3)
    path = tmp_path / "qwen3.gguf"
    write_gguf(path, "qwen3", weights)
    engine = Engine(path, bg.Device("reference"), max_batch=2, max_context=32, block_size=4, max_step_tokens=4)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert engine.complete(PROMPT, params).token_ids == greedy(d, weights, PROMPT, 5)
    assert engine.complete([{"role": "user", "content": "DfqB"}], params).token_ids == greedy(
        d, weights, [3, 31, 42, 1], 5
    )


def test_unknown_architectures_are_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        bg.BatchError, match=r"GGUF architecture 'gemma' is not supported; supported: llama, qwen2, qwen3, gemma3"
    ):
        Llama(bg.Device("reference"), path)


@pytest.mark.parametrize(
    ("extra", "metadata", "message"),
    [
        ({"blk.0.ffn_gate.bias": np.ones(96, np.float32)}, {}, r"tensor 'blk.0.ffn_gate.bias' is not used by this"),
        ({}, {"rope__dimension_count": 8}, r"llama.rope.dimension_count other than the key length 16"),
        ({}, {"final_logit_softcapping": 30}, r"llama.final_logit_softcapping \(logit soft-capping\) is not"),
    ],
)
def test_features_the_decoder_lacks_are_refused(tmp_path, extra, metadata, message):
    """A file with tensors or settings the decoder would silently ignore (a bias it has no place for, partial
    rotary, logit soft-capping) is refused by name instead of computing wrong numbers."""
    path = tmp_path / "model.gguf"
    weights = random_weights(VARIANTS["llama"], 1)
    write_gguf(path, "llama", {**weights, **extra}, **metadata)
    with pytest.raises(bg.BatchError, match=message):
        Llama(bg.Device("reference"), path, max_context=32)


def test_a_window_shorter_than_the_context_applies_to_every_layer(tmp_path):
    """Mistral's sliding window (a llama file with ``attention.sliding_window``; refused before the attention
    kernels had windows): every layer's query sees its own and the previous 2 positions, prompt and decode."""
    path = tmp_path / "mistral.gguf"
    weights = random_weights(VARIANTS["llama"], 2)
    write_gguf(path, "llama", weights, attention__sliding_window=3)
    d = dict(VARIANTS["llama"], window=3)
    for kind in ("reference", "wgpu"):
        check_model(Llama(bg.Device(kind), path, quantized=False, max_context=32), d, weights)


def test_a_window_no_shorter_than_the_context_changes_nothing(tmp_path):
    path = tmp_path / "mistral.gguf"
    weights = random_weights(VARIANTS["llama"], 2)
    write_gguf(path, "llama", weights, attention__sliding_window=32)
    check_model(Llama(bg.Device("reference"), path, quantized=False, max_context=32), VARIANTS["llama"], weights)


# Hugging Face directories --------------------------------------------------------------------------------

HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
HF_MODEL_TYPES = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


def hf_name(name: str) -> str:
    """transformers' name of a GGUF-named tensor (written out here, not taken from the gguf package)."""
    if name in HF_NAMES:
        return HF_NAMES[name]
    _, layer, tensor, suffix = name.split(".")
    return f"model.layers.{layer}.{HF_LAYER_NAMES[tensor]}.{suffix}"


def hf_config(variant: str, d: dict) -> dict:
    config = {
        "model_type": HF_MODEL_TYPES[variant],
        "hidden_size": d["hidden"],
        "intermediate_size": d["ffn"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "vocab_size": d["vocab"],
        "rms_norm_eps": d["eps"],
        "rope_theta": d["theta"],
        "max_position_embeddings": 64,
        "tie_word_embeddings": d["tied"],
        "hidden_act": "silu",
        "eos_token_id": 2,
    }
    if d["scaling"] is not None:
        config["rope_scaling"] = dict(d["scaling"], rope_type="llama3")
    if variant == "qwen2":
        config.update(sliding_window=4096, use_sliding_window=False)
    if variant == "mistral":
        config.update(sliding_window=None)
    return config


def write_hf(
    directory,
    variant: str,
    weights: dict[str, np.ndarray],
    dtype: type = np.float32,
    shards: int = 1,
    d: dict | None = None,
):
    """A transformers-style checkpoint: config.json, safetensors shards (with an index past one) and a
    tokenizer.json; returns the weights as stored (rounded to ``dtype``)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    d = d or VARIANTS["llama" if variant == "mistral" else variant]
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config(variant, d)))
    tensors = {hf_name(name): array.astype(dtype) for name, array in weights.items()}
    names = sorted(tensors)
    index = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[shard::shards]
        save_file({name: tensors[name] for name in part}, str(directory / file))
        index.update(dict.fromkeys(part, file))
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    vocab = {chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26): i for i in range(d["vocab"])}
    Tokenizer(models.BPE(vocab, [])).save(str(directory / "tokenizer.json"))  # one token per character
    return {name: array.astype(dtype).astype(np.float32) for name, array in weights.items()}


@pytest.mark.parametrize("kind", ["reference", "wgpu"])
@pytest.mark.parametrize(
    ("variant", "dtype", "shards"),
    [("llama3", np.float32, 3), ("qwen3", np.float16, 1), ("qwen2", np.float32, 2), ("mistral", np.float16, 2)],
)
def test_tiny_hf_checkpoint_matches_float64_numpy(tmp_path, variant, dtype, shards, kind):
    d = VARIANTS["llama" if variant == "mistral" else variant]
    stored_weights = write_hf(tmp_path / variant, variant, random_weights(d, 11), dtype, shards)
    model = Llama(bg.Device(kind), tmp_path / variant, max_context=32)
    if dtype == np.float16:
        assert model.params["blk.0.ffn_down.weight"].qtype == "f16"  # resident as float16 blocks
    check_model(model, d, stored_weights)


def test_engine_serves_a_hf_checkpoint(tmp_path):
    """The engine on a float16 Qwen2 directory: its tokenizer.json and end token come along."""
    from batchgpu.llm import Engine, SamplingParams

    d = VARIANTS["qwen2"]
    stored_weights = write_hf(tmp_path / "qwen2", "qwen2", random_weights(d, 13), np.float16)
    engine = Engine(tmp_path / "qwen2", bg.Device("reference"), max_batch=2, max_context=32, block_size=4)
    assert engine.codec.eos_ids == {2}
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert engine.complete("DfqB", params).token_ids == greedy(d, stored_weights, [3, 31, 42, 1], 5)


def test_hf_checkpoint_refusals(tmp_path):
    d = VARIANTS["llama"]
    weights = random_weights(d, 5)
    write_hf(tmp_path / "bias", "llama", {**weights, "blk.0.ffn_up.bias": np.ones(96, np.float32)})
    with pytest.raises(bg.BatchError, match=r"tensor 'model.layers.0.mlp.up_proj.bias' is not used|ffn_up.bias"):
        Llama(bg.Device("reference"), tmp_path / "bias")
    directory = tmp_path / "yarn"
    write_hf(directory, "llama", weights)
    config = json.loads((directory / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(bg.BatchError, match=r"RoPE scaling 'yarn' is not supported; supported: default, linear"):
        Llama(bg.Device("reference"), directory)
    config.update(rope_scaling=None, model_type="gemma")
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(bg.BatchError, match=r"model_type 'gemma' is not supported; supported: llama, mistral"):
        Llama(bg.Device("reference"), directory)


def test_hf_loading_holds_about_one_tensor_in_host_memory(tmp_path):
    """Tensors are read one at a time from memory-mapped shards: the host's peak while loading onto lavapipe
    (whose buffers numpy does not allocate) stays under a small multiple of the largest tensor, far below
    the checkpoint's size."""
    import tracemalloc

    from batchgpu.models.llama import open_weights, upload_weights

    d = dict(VARIANTS["llama"], layers=4, hidden=256, head_dim=64, ffn=512)
    weights = random_weights(d, 9)
    write_hf(tmp_path / "big", "llama", weights, np.float32, 3, d)
    total = sum(a.nbytes for a in weights.values())
    largest = max(a.nbytes for a in weights.values())
    source = open_weights(tmp_path / "big")
    device = bg.Device("wgpu")
    tracemalloc.start()
    upload_weights(device, source, quantized=False, fuse=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2 * largest and largest < total / 10, (peak, largest, total)
