"""Every key of a Hugging Face config.json of each supported model type (issue 40): transformers' config classes'
keys (4.57.6 and 5.24.0, listed here) are each a row of batchgpu/models/hf_keys.py's table of their model type
(and the installed transformers', where it is installed, has no other); each refused key is refused by name on a
tiny directory unless neutral; ignored keys and keys of no table change nothing; each applied key changes the
logits as transformers' formula (written here in float64 numpy: RoPE's inverse frequencies of the default, linear
and llama3 kinds, the windowed layers of each model type's rule, the attention scale, the tied head) says."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.models.config import HF_LANGUAGE_MODELS, HF_MODEL_TYPES, LlamaConfig
from batchgpu.models.hf_keys import APPLIED, FOREIGN_KEYS, HANDLINGS, HF_KEYS, IGNORED, REFUSED, ROPE_KEYS, ROPE_TYPES
from batchgpu.models.llama import Llama
from batchgpu.models.safetensors_dir import SafetensorsWeights

pytest.importorskip("safetensors", reason="the safetensors package writes the test checkpoints")

# transformers' keys ------------------------------------------------------------------------------------------

PRETRAINED = (
    *("_name_or_path", "add_cross_attention", "architectures", "bad_words_ids", "begin_suppress_tokens"),
    *("bos_token_id", "chunk_size_feed_forward", "cross_attention_hidden_size", "decoder_start_token_id"),
    *("diversity_penalty", "do_sample", "dtype", "early_stopping", "encoder_no_repeat_ngram_size", "eos_token_id"),
    *("exponential_decay_length_penalty", "finetuning_task", "forced_bos_token_id", "forced_eos_token_id"),
    *("id2label", "is_decoder", "is_encoder_decoder", "label2id", "length_penalty", "max_length", "min_length"),
    *("model_type", "no_repeat_ngram_size", "num_beam_groups", "num_beams", "num_return_sequences"),
    *("output_attentions", "output_hidden_states", "output_scores", "pad_token_id", "prefix", "problem_type"),
    *("pruned_heads", "remove_invalid_values", "repetition_penalty", "return_dict", "return_dict_in_generate"),
    *("sep_token_id", "suppress_tokens", "task_specific_params", "temperature", "tf_legacy_loss"),
    *("tie_encoder_decoder", "tie_word_embeddings", "tokenizer_class", "top_k", "top_p", "torchscript"),
    *("transformers_version", "typical_p", "use_bfloat16"),
)
"""``PretrainedConfig().to_dict()``'s keys in transformers 4.57.6 and 5.24.0 (5 keeps 13 of them)."""
SIZES = (
    *("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"),
    *("vocab_size", "max_position_embeddings", "rms_norm_eps", "initializer_range", "attention_dropout"),
    *("use_cache", "rope_theta", "rope_parameters"),
)
QWEN2_WINDOWS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
CLASS_KEYS = {
    "llama": ("LlamaConfig", (*SIZES, "head_dim", "hidden_act", "attention_bias", "mlp_bias", "pretraining_tp")),
    "mistral": ("MistralConfig", (*SIZES, "head_dim", "hidden_act", "sliding_window")),
    "qwen2": ("Qwen2Config", (*SIZES, "hidden_act", "rope_scaling", *QWEN2_WINDOWS)),
    "qwen3": ("Qwen3Config", (*SIZES, "head_dim", "hidden_act", "rope_scaling", "attention_bias", *QWEN2_WINDOWS)),
    "gemma3_text": (
        "Gemma3TextConfig",
        (
            *(*SIZES, "head_dim", "hidden_activation", "rope_scaling", "attention_bias", "query_pre_attn_scalar"),
            *("sliding_window", "layer_types", "_sliding_window_pattern", "rope_local_base_freq"),
            *("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"),
        ),
    ),
    "gemma3": (
        "Gemma3Config",
        ("text_config", "vision_config", "boi_token_index", "eoi_token_index", "image_token_index"),
    ),
}
"""Each model type -> its transformers config class and the keys ``<Class>().to_dict()`` has beyond
:data:`PRETRAINED` in 4.57.6 or 5.24.0 (4's ``rope_theta`` / ``rope_scaling``, 5's ``rope_parameters``)."""
CLASS_KEYS["llama"] = (CLASS_KEYS["llama"][0], (*CLASS_KEYS["llama"][1], "rope_scaling"))
CLASS_KEYS["gemma3"] = (CLASS_KEYS["gemma3"][0], (*CLASS_KEYS["gemma3"][1], "mm_tokens_per_image", "initializer_range"))

EVERY_TYPE = ("torch_dtype", "quantization_config")
DECODERS = ("partial_rotary_factor", "original_max_position_embeddings")
READ_BEYOND_THE_CLASS = {
    "llama": (*EVERY_TYPE, *DECODERS),
    "mistral": (*EVERY_TYPE, *DECODERS, "rope_scaling"),
    "qwen2": (*EVERY_TYPE, *DECODERS, "head_dim"),
    "qwen3": (*EVERY_TYPE, *DECODERS),
    "gemma3_text": (*EVERY_TYPE, *DECODERS, "sliding_window_pattern"),
    "gemma3": EVERY_TYPE,
}
"""Keys transformers reads that its class does not list: ``torch_dtype`` (dtype's name before 4.56),
``quantization_config`` (its loader, for every model type), ``partial_rotary_factor`` and
``original_max_position_embeddings`` (its RoPE code, for every model type), ``rope_scaling`` (Mistral's RoPE
through 4's getattr, 5's conversion), ``head_dim`` (Qwen2's attention's getattr), ``sliding_window_pattern``
(Gemma 3's ``__init__`` reads it from its keyword arguments)."""


@pytest.mark.parametrize("model_type", list(HF_KEYS))
def test_every_key_of_each_model_types_class_is_classified(model_type):
    """The table of each model type holds exactly its class's keys and those transformers reads beyond them; each
    row is applied, ignored or refused unless neutral, with a note saying what it sets, why it changes nothing or
    what it would turn on."""
    _, own = CLASS_KEYS[model_type]
    table = HF_KEYS[model_type]
    assert sorted(table) == sorted({*PRETRAINED, *own, *READ_BEYOND_THE_CLASS[model_type]})
    for key, row in table.items():
        assert row.handling in HANDLINGS and row.note, key
        assert not row.neutral or row.handling == REFUSED, key
    assert set(HF_KEYS) == {*HF_MODEL_TYPES, *HF_LANGUAGE_MODELS}
    for model_type_row in HF_MODEL_TYPES.values():
        assert model_type_row.keys in HF_KEYS.values()


def test_foreign_keys_are_refused_where_a_table_lacks_them():
    """A foreign key is a row of some model type's own table, or names a computation of another transformers model
    (Llama 4's chunked attention); each is refused unless neutral."""
    for key, row in FOREIGN_KEYS.items():
        assert row.handling == REFUSED and row.note
        assert key == "attention_chunk_size" or any(key in table for table in HF_KEYS.values()), key


def test_the_installed_transformers_classes_have_no_other_keys():
    """Where transformers is installed (the test extra pins the version the lists come from), every key of its
    config classes is a row of its model type's table."""
    transformers = pytest.importorskip("transformers")
    for model_type, (name, _) in CLASS_KEYS.items():
        keys = set(getattr(transformers, name)().to_dict())
        assert keys <= set(HF_KEYS[model_type]), (
            transformers.__version__,
            name,
            sorted(keys - set(HF_KEYS[model_type])),
        )


# tiny checkpoints ------------------------------------------------------------------------------------------------

D = dict(vocab=40, hidden=32, heads=4, kv_heads=2, ffn=48, layers=3)
PROMPT = [3, 17, 25, 8, 29, 11, 5]
WINDOW = 3

BASE: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        vocab_size=D["vocab"],
        hidden_size=D["hidden"],
        intermediate_size=D["ffn"],
        num_hidden_layers=D["layers"],
        num_attention_heads=D["heads"],
        num_key_value_heads=D["kv_heads"],
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
BASE["mistral"] = dict(BASE["llama"], model_type="mistral")
BASE["qwen2"] = dict(BASE["llama"], model_type="qwen2")
BASE["qwen3"] = dict(BASE["llama"], model_type="qwen3", head_dim=16)
BASE["gemma3_text"] = dict(
    BASE["llama"],
    model_type="gemma3_text",
    head_dim=8,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    sliding_window_pattern=2,
    query_pre_attn_scalar=8,
    tie_word_embeddings=True,
)
BASE["gemma3"] = dict(model_type="gemma3", text_config={**BASE["gemma3_text"], "tie_word_embeddings": None})
"""A config.json of each model type that loads (every supported one), from which each case differs."""

TRANSFORMERS_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "mistral": dict(rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6, sliding_window=4096),
    "qwen2": dict(
        rope_theta=10000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
    "gemma3_text": dict(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        head_dim=256,
    ),
}
TRANSFORMERS_DEFAULTS["qwen3"] = TRANSFORMERS_DEFAULTS["qwen2"]
"""The defaults of transformers' config classes that the cases rely on (written out here)."""


def language_model(config: dict) -> tuple[str, dict, bool]:
    """(the language model's model_type, its config with transformers' defaults, whether the head is tied)."""
    if config["model_type"] == "gemma3":
        text = config["text_config"]
        return "gemma3_text", {**TRANSFORMERS_DEFAULTS["gemma3_text"], **text}, config.get("tie_word_embeddings", True)
    model_type = config["model_type"]
    settings = {**TRANSFORMERS_DEFAULTS[model_type], **config}
    return model_type, settings, settings["tie_word_embeddings"]


def hf_tensor_names(model_type: str, c: dict, tied: bool) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names of the model and their shapes (written out here)."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    hidden, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        shapes |= {
            b + "input_layernorm.weight": (hidden,),
            b + "post_attention_layernorm.weight": (hidden,),
            b + "self_attn.q_proj.weight": (heads * hd, hidden),
            b + "self_attn.k_proj.weight": (kv * hd, hidden),
            b + "self_attn.v_proj.weight": (kv * hd, hidden),
            b + "self_attn.o_proj.weight": (hidden, heads * hd),
            b + "mlp.gate_proj.weight": (c["intermediate_size"], hidden),
            b + "mlp.up_proj.weight": (c["intermediate_size"], hidden),
            b + "mlp.down_proj.weight": (hidden, c["intermediate_size"]),
        }
        if model_type == "qwen2":
            shapes |= {b + f"self_attn.{p}_proj.bias": (n * hd,) for p, n in (("q", heads), ("k", kv), ("v", kv))}
        if model_type in ("qwen3", "gemma3_text"):
            shapes |= {b + "self_attn.q_norm.weight": (hd,), b + "self_attn.k_norm.weight": (hd,)}
        if model_type == "gemma3_text":
            shapes |= {
                b + "pre_feedforward_layernorm.weight": (hidden,),
                b + "post_feedforward_layernorm.weight": (hidden,),
            }
    return shapes


def random_tensors(shapes: dict[str, tuple[int, ...]], gemma: bool, seed: int) -> dict[str, np.ndarray]:
    """Random float32 tensors: matrices of spread 1 / sqrt(columns), norm weights near 1 (Gemma's near 0: its norm
    multiplies by 1 + w), biases of spread 0.5."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 2:
            tensors[name] = rng.standard_normal(shape) / math.sqrt(shape[1]) * (4 if "embed" in name else 1)
        elif name.endswith("bias"):
            tensors[name] = 0.5 * rng.standard_normal(shape)
        else:
            tensors[name] = (0.0 if gemma else 1.0) + 0.2 * rng.standard_normal(shape)
    return {name: array.astype(np.float32) for name, array in tensors.items()}


def write_checkpoint(directory: Path, config: dict, seed: int = 0, tensors: dict | None = None) -> dict:
    """config.json and model.safetensors of random tensors of the shapes ``config`` implies (a multimodal model's
    under transformers 4's ``language_model.`` names); returns the tensors by transformers' text model names."""
    from safetensors.numpy import save_file

    model_type, c, tied = language_model(config)
    if tensors is None:
        tensors = random_tensors(hf_tensor_names(model_type, c, tied), model_type == "gemma3_text", seed)
    prefix = "language_model." if config["model_type"] == "gemma3" else ""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({prefix + name: array for name, array in tensors.items()}, str(directory / "model.safetensors"))
    return tensors


# transformers' formulas, in float64 ------------------------------------------------------------------------------


def inverse_frequencies(rope: dict, theta: float, hd: int, c: dict) -> np.ndarray:
    """transformers' RoPE inverse frequencies (``modeling_rope_utils``: default, linear, llama3)."""
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rope["factor"]
    assert kind == "llama3"
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = c.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    low_wavelength, high_wavelength = old / low, old / high
    wavelength = 2 * math.pi / inv
    scaled = np.where(wavelength > low_wavelength, inv / factor, inv)
    smooth = (old / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(medium, smoothed, scaled)


def reading(config: dict) -> dict:
    """What transformers computes with for ``config``: per layer the window (0: none) and RoPE inverse frequencies,
    the attention scale, eps, the tied head."""
    model_type, c, tied = language_model(config)
    layers, hd = c["num_hidden_layers"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    local = rope.get("sliding_attention", {})
    theta = full.get("rope_theta", c["rope_theta"])
    if model_type == "mistral":
        kinds = ["sliding_attention" if c["sliding_window"] is not None else "full_attention"] * layers
    elif model_type in ("qwen2", "qwen3"):
        window = c["sliding_window"] if c["use_sliding_window"] else None
        kinds = c.get("layer_types") or [
            "sliding_attention" if window is not None and i >= c["max_window_layers"] else "full_attention"
            for i in range(layers)
        ]
    elif model_type == "gemma3_text":
        every = c.get("sliding_window_pattern", 6)
        kinds = c.get("layer_types") or [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
        ]
    else:
        kinds = ["full_attention"] * layers
    windows = [c["sliding_window"] if kind == "sliding_attention" else 0 for kind in kinds]
    inv = inverse_frequencies(full, theta, hd, c)
    if model_type == "gemma3_text":
        local_inv = 1.0 / local.get("rope_theta", c["rope_local_base_freq"]) ** (np.arange(0, hd, 2) / hd)
        frequencies = [local_inv if window else inv for window in windows]
        scale = c["query_pre_attn_scalar"] ** -0.5
    else:
        frequencies, scale = [inv] * layers, hd**-0.5
    return dict(
        model_type=model_type,
        windows=windows,
        frequencies=frequencies,
        scale=scale,
        eps=c["rms_norm_eps"],
        tied=tied,
        heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"],
        head_dim=hd,
        layers=layers,
        context=c["max_position_embeddings"],
    )


def float64_logits(r: dict, tensors: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """transformers' decoder of model type ``r["model_type"]`` in float64 over transformers' tensor names: the
    last token's logits."""
    w = {name: array.astype(np.float64) for name, array in tensors.items()}
    gemma, t, hd = r["model_type"] == "gemma3_text", len(ids), r["head_dim"]

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + r["eps"])
        return normed * (1 + w[name]) if gemma else normed * w[name]

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ w[name + ".weight"].T + w.get(name + ".bias", 0.0)

    def rope(x: np.ndarray, inv: np.ndarray) -> np.ndarray:
        angle = np.arange(t)[:, None] * inv[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    h = w["model.embed_tokens.weight"][ids] * (math.sqrt(w["model.norm.weight"].shape[0]) if gemma else 1.0)
    position = np.arange(t)
    for i in range(r["layers"]):
        b = f"model.layers.{i}."
        x = norm(h, b + "input_layernorm.weight")
        q = linear(x, b + "self_attn.q_proj").reshape(t, r["heads"], hd)
        k = linear(x, b + "self_attn.k_proj").reshape(t, r["kv_heads"], hd)
        v = linear(x, b + "self_attn.v_proj").reshape(t, r["kv_heads"], hd)
        if b + "self_attn.q_norm.weight" in w:
            q, k = norm(q, b + "self_attn.q_norm.weight"), norm(k, b + "self_attn.k_norm.weight")
        q, k = rope(q, r["frequencies"][i]), rope(k, r["frequencies"][i])
        group = r["heads"] // r["kv_heads"]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) * r["scale"]
        allowed = position[None, :] <= position[:, None]
        if r["windows"][i]:
            allowed &= position[None, :] > position[:, None] - r["windows"][i]
        scores = np.where(allowed[None], scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attended = np.einsum("hts,shd->thd", p, v).reshape(t, -1) @ w[b + "self_attn.o_proj.weight"].T
        gate, up = (f"{b}mlp.{p}_proj.weight" for p in ("gate", "up"))
        if gemma:
            h = h + norm(attended, b + "post_attention_layernorm.weight")
            x = norm(h, b + "pre_feedforward_layernorm.weight")
            g = x @ w[gate].T
            g = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            mlp = (g * (x @ w[up].T)) @ w[b + "mlp.down_proj.weight"].T
            h = h + norm(mlp, b + "post_feedforward_layernorm.weight")
        else:
            h = h + attended
            x = norm(h, b + "post_attention_layernorm.weight")
            g = x @ w[gate].T
            h = h + (g / (1 + np.exp(-g)) * (x @ w[up].T)) @ w[b + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if r["tied"] else w["lm_head.weight"]
    return norm(h, "model.norm.weight")[-1] @ head.T


# applied keys: the numbers ---------------------------------------------------------------------------------------

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
APPLIED_CASES = {
    "llama": dict(
        tied=dict(tie_word_embeddings=True),
        head_dim=dict(head_dim=16, rope_theta=500.0, rms_norm_eps=0.25),
        linear=dict(rope_scaling=dict(rope_type="linear", factor=4.0), max_position_embeddings=40),
        llama3=dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=64), rope_theta=10000.0),
        llama3_v5=dict(rope_parameters=dict(LLAMA3, rope_theta=500.0), original_max_position_embeddings=32),
        legacy_type=dict(rope_scaling=dict(type="linear", factor=2.0)),
    ),
    "mistral": dict(
        window=dict(sliding_window=WINDOW, head_dim=16, rms_norm_eps=0.25, tie_word_embeddings=True),
        no_window=dict(sliding_window=None, rope_parameters=dict(rope_type="linear", factor=3.0, rope_theta=700.0)),
        llama3=dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=32), max_position_embeddings=48),
        llama3_top=dict(rope_scaling=LLAMA3, original_max_position_embeddings=64, rope_theta=900.0),
    ),
    "qwen2": dict(
        max_window_layers=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        default_first_layer=dict(use_sliding_window=True, sliding_window=WINDOW, head_dim=16),
        layer_types=dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=LAYER_TYPES, rms_norm_eps=0.25),
        unused_window=dict(
            use_sliding_window=False, sliding_window=WINDOW, max_window_layers=0, tie_word_embeddings=True
        ),
        llama3=dict(rope_parameters=dict(LLAMA3, rope_theta=500.0), original_max_position_embeddings=32),
        linear=dict(rope_scaling=dict(type="linear", factor=2.0), rope_theta=600.0, max_position_embeddings=40),
    ),
    "qwen3": dict(
        max_window_layers=dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, head_dim=8),
        layer_types=dict(use_sliding_window=True, sliding_window=WINDOW, layer_types=LAYER_TYPES, rms_norm_eps=0.25),
        llama3=dict(
            rope_scaling=dict(LLAMA3, original_max_position_embeddings=32), original_max_position_embeddings=32
        ),
        linear=dict(rope_parameters=dict(type="linear", factor=2.0), rope_theta=600.0, tie_word_embeddings=True),
        context=dict(max_position_embeddings=40),
    ),
    "gemma3_text": dict(
        base={},
        scalar=dict(query_pre_attn_scalar=20, head_dim=16, rms_norm_eps=0.25),
        layer_types=dict(layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
        bases=dict(rope_theta=5000.0, rope_local_base_freq=100.0, max_position_embeddings=40),
        v5=dict(
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=5000.0),
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
            )
        ),
        llama3=dict(
            rope_scaling=dict(LLAMA3, original_max_position_embeddings=32), original_max_position_embeddings=32
        ),
        pattern=dict(sliding_window_pattern=3, _sliding_window_pattern=3, sliding_window=2),
        untied=dict(tie_word_embeddings=False, vocab_size=37, intermediate_size=40),
    ),
    "gemma3": dict(
        base={},
        untied=dict(tie_word_embeddings=False),
        text=dict(text_config={**BASE["gemma3_text"], "query_pre_attn_scalar": 20, "tie_word_embeddings": None}),
    ),
}
"""Per model type, cases of applied keys (each a change of :data:`BASE`), which together set every applied key of
its table."""


def case_config(model_type: str, changes: dict) -> dict:
    return {key: value for key, value in {**BASE[model_type], **changes}.items()}


@pytest.mark.parametrize("model_type", list(APPLIED_CASES))
def test_every_applied_key_has_a_case(model_type):
    covered = {key for changes in APPLIED_CASES[model_type].values() for key in case_config(model_type, changes)}
    applied = {key for key, row in HF_KEYS[model_type].items() if row.handling == APPLIED}
    assert applied <= covered, sorted(applied - covered)


@pytest.mark.parametrize(
    ("model_type", "case"), [(model_type, case) for model_type, cases in APPLIED_CASES.items() for case in cases]
)
def test_applied_keys_change_the_numbers_as_transformers_does(tmp_path, model_type, case):
    """The tiny checkpoint's prefill logits are transformers' formulas' (float64 numpy) within 1e-5 x max|logit|;
    the windows, RoPE frequencies and trained context are read as transformers reads them."""
    config = case_config(model_type, APPLIED_CASES[model_type][case])
    tensors = write_checkpoint(tmp_path / "model", config, seed=len(case))
    r = reading(config)
    model = Llama(bg.Device("reference"), tmp_path / "model", max_context=16)
    ours = model.config
    assert [ours.window(layer) for layer in range(r["layers"])] == r["windows"]
    for layer in range(r["layers"]):
        rope = ours.rope(layer)
        base = 1.0 / rope["theta"] ** (np.arange(0, r["head_dim"], 2) / r["head_dim"])
        np.testing.assert_allclose(base / np.asarray(rope["factors"] or 1.0), r["frequencies"][layer], rtol=1e-12)
    assert ours.context == r["context"]
    step = model.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    expected = float64_logits(r, tensors, PROMPT)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


# refused keys --------------------------------------------------------------------------------------------------

BAD_VALUES = {
    "pruned_heads": {"0": [1]},
    "quantization_config": {"quant_method": "gptq", "bits": 4},
    "partial_rotary_factor": 0.5,
    "hidden_act": "gelu",
    "hidden_activation": "gelu",
    "attention_bias": True,
    "mlp_bias": True,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": True,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention"] * D["layers"],
    "attention_chunk_size": 8192,
}
"""A value of each refused key that asks for what the decoder lacks."""
WRONG_KINDS = {"hidden_act": ["silu"], "attention_bias": "false", "partial_rotary_factor": "1.0", "pruned_heads": []}
"""A value of the wrong JSON kind: a file error rather than an unsupported request."""


def refused_keys(model_type: str) -> list[str]:
    table = HF_KEYS[model_type]
    own = [key for key, row in table.items() if row.handling == REFUSED]
    foreign = [] if model_type in HF_LANGUAGE_MODELS else [key for key in FOREIGN_KEYS if key not in table]
    return own + foreign


REFUSALS = [(model_type, key) for model_type in HF_KEYS for key in refused_keys(model_type)]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """A directory of each model type's :data:`BASE` config."""
    tmp = tmp_path_factory.mktemp("good")
    for model_type, config in BASE.items():
        write_checkpoint(tmp / model_type, config)
    return {model_type: tmp / model_type for model_type in BASE}


def edited(good: dict[str, Path], tmp_path: Path, model_type: str, change: Any) -> Path:
    """A copy of the good directory of ``model_type`` whose config.json ``change`` edits."""
    directory = tmp_path / model_type
    shutil.copytree(good[model_type], directory)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(("model_type", "key"), REFUSALS, ids=[f"{m}: {k}" for m, k in REFUSALS])
def test_each_refused_key_is_refused_by_name(good, tmp_path, model_type, key):
    """A value other than the neutral ones: UnsupportedError naming config.json, the key and its value; the same
    directory with each neutral value (and null) loads as without the key."""
    directory = edited(good, tmp_path, model_type, lambda c: c.update({key: BAD_VALUES[key]}))
    with pytest.raises(
        bg.UnsupportedError, match=rf"config\.json: {model_type} model: {re.escape(key)} .* is not supp"
    ):
        SafetensorsWeights(directory)
    row = HF_KEYS[model_type].get(key) or FOREIGN_KEYS[key]
    base = LlamaConfig.from_hf(BASE[model_type])
    for neutral in (*row.neutral, None):
        assert LlamaConfig.from_hf({**BASE[model_type], key: neutral}) == base


@pytest.mark.parametrize("model_type", list(HF_MODEL_TYPES))
@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
def test_partial_rotary_inside_the_rope_parameters_is_refused(good, tmp_path, model_type, where):
    rope = {"rope_type": "default", "partial_rotary_factor": 0.25}
    directory = edited(good, tmp_path, model_type, lambda c: c.update({where: rope}))
    with pytest.raises(bg.UnsupportedError, match=rf"{where}\.partial_rotary_factor 0\.25 is not supported"):
        SafetensorsWeights(directory)
    assert LlamaConfig.from_hf({**BASE[model_type], where: dict(rope, partial_rotary_factor=1.0)}) == (
        LlamaConfig.from_hf(BASE[model_type])
    )


@pytest.mark.parametrize("key", list(WRONG_KINDS))
def test_refused_keys_of_the_wrong_kind_are_file_errors(key):
    with pytest.raises(bg.ModelFileError, match=rf"{key} must be"):
        LlamaConfig.from_hf({**BASE["llama"], key: WRONG_KINDS[key]})


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope", "mrope"])
@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
def test_rope_kinds_not_computed_are_refused(kind, where):
    rope = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(bg.UnsupportedError, match=rf"{where}\.rope_type '{kind}': RoPE scaling '{kind}' is not supp"):
        LlamaConfig.from_hf({**BASE["qwen2"], where: rope})
    assert set(ROPE_TYPES) == {"default", "linear", "llama3"}


# what transformers versions read differently, and what transformers cannot run --------------------------------

DISAGREEMENTS = [
    (
        "rope_scaling and rope_parameters",
        dict(rope_scaling=dict(rope_type="linear", factor=2.0), rope_parameters=dict(rope_type="default")),
        r"rope_scaling must be absent where rope_parameters is given",
    ),
    (
        "two RoPE bases",
        dict(rope_theta=10000.0, rope_parameters=dict(rope_type="default", rope_theta=500.0)),
        r"rope_parameters\.rope_theta must be rope_theta 10000 where both are given",
    ),
    (
        "two original contexts",
        dict(rope_scaling=dict(LLAMA3, original_max_position_embeddings=32), original_max_position_embeddings=64),
        r"rope_scaling\.original_max_position_embeddings must be the top-level original_max_position_embeddings 64",
    ),
    ("llama3 without an original context", dict(rope_scaling=LLAMA3), r"original_max_position_embeddings is missing"),
    (
        "RoPE by layer type outside Gemma 3",
        dict(rope_parameters=dict(full_attention=dict(rope_type="default"))),
        r"llama model: rope_parameters by layer type is not supported",
    ),
]


@pytest.mark.parametrize(("changes", "message"), [c[1:] for c in DISAGREEMENTS], ids=[c[0] for c in DISAGREEMENTS])
def test_configs_transformers_versions_read_differently_are_refused(changes, message):
    with pytest.raises(bg.BatchError, match=message):
        LlamaConfig.from_hf({**BASE["llama"], **changes})


def test_qwen2_layer_types_windowed_without_use_sliding_window_are_refused():
    """transformers drops the window where ``use_sliding_window`` is false and then fails on a windowed layer."""
    settings = dict(BASE["qwen2"], use_sliding_window=False, sliding_window=WINDOW, layer_types=LAYER_TYPES)
    with pytest.raises(bg.ModelFileError, match=r"use_sliding_window must be true where layer_types names windowed"):
        LlamaConfig.from_hf(settings)


def test_gemma3_sliding_window_pattern_copy_must_agree():
    """transformers writes ``_sliding_window_pattern`` and reads ``sliding_window_pattern`` (6 where absent)."""
    with pytest.raises(bg.ModelFileError, match=r"_sliding_window_pattern must be sliding_window_pattern 2"):
        LlamaConfig.from_hf(dict(BASE["gemma3_text"], _sliding_window_pattern=4))
    with_types = dict(BASE["gemma3_text"], _sliding_window_pattern=4, layer_types=LAYER_TYPES)
    assert LlamaConfig.from_hf(with_types) == LlamaConfig.from_hf(dict(with_types, _sliding_window_pattern=None))


# the head and the biases against the tensors ---------------------------------------------------------------------


def test_the_head_follows_tie_word_embeddings(good, tmp_path):
    """Absent, tie_word_embeddings is the model type's default: a Llama without lm_head is refused (transformers
    would start it from random weights); tied with an lm_head of its own, the two must be equal (transformers 4 ties,
    5 keeps the head)."""
    directory = edited(good, tmp_path / "absent", "llama", lambda c: c.pop("tie_word_embeddings"))
    (directory / "model.safetensors").unlink()
    tensors = random_tensors(hf_tensor_names("llama", language_model(BASE["llama"])[1], True), False, 0)
    from safetensors.numpy import save_file

    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(bg.ModelFileError, match=r"tie_word_embeddings is false \(absent: a llama model's default\)"):
        SafetensorsWeights(directory)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, str(directory / "model.safetensors"))
    assert "output.weight" in SafetensorsWeights(directory).names()
    config = dict(BASE["llama"], tie_word_embeddings=True)
    (directory / "config.json").write_text(json.dumps(config))
    assert "output.weight" not in SafetensorsWeights(directory).names()  # equal: one tensor
    other = tensors["model.embed_tokens.weight"] * np.float32(2)
    save_file({**tensors, "lm_head.weight": other}, str(directory / "model.safetensors"))
    with pytest.raises(bg.ModelFileError, match=r"lm_head\.weight' \(output\.weight\) differs from the token embed"):
        SafetensorsWeights(directory)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3", "gemma3_text"])
def test_q_k_v_biases_of_a_model_type_without_them_are_refused(tmp_path, model_type):
    """transformers' model of these types has no q/k/v biases (attention_bias false) and would leave them unread."""
    config = BASE[model_type]
    shapes = hf_tensor_names(model_type, language_model(config)[1], language_model(config)[2])
    tensors = random_tensors(shapes, model_type == "gemma3_text", 1)
    tensors["model.layers.1.self_attn.k_proj.bias"] = np.ones(shapes["model.layers.1.self_attn.k_proj.weight"][0], "f4")
    write_checkpoint(tmp_path / "model", config, tensors=tensors)
    with pytest.raises(
        bg.ModelFileError, match=rf"k_proj\.bias' \(blk\.1\.attn_k\.bias\) is a q/k/v bias, but a {model_type}"
    ):
        SafetensorsWeights(tmp_path / "model")


# ignored keys and keys of no table ----------------------------------------------------------------------------

ODD = {"not": ["what", 1, "the", None, "type"]}
"""A value of a kind no key has: an ignored key is never read."""
UNKNOWN = {"is_llama_config": True, "rope_interleaved": True, "future_setting": 3, "_attn_implementation": "x"}


@pytest.mark.parametrize("model_type", list(HF_KEYS))
def test_ignored_and_unknown_keys_change_nothing(good, tmp_path, model_type):
    """Every ignored key of the model type's table, set to a value of a kind none has, and keys of no table: the
    same config and the same tensors (RoPE parameters' ignored keys too)."""
    ignored = {key: ODD for key, row in HF_KEYS[model_type].items() if row.handling == IGNORED}
    rope_ignored = {key: ODD for key, row in ROPE_KEYS.items() if row.handling == IGNORED}
    scaling = dict(rope_type="linear", factor=2.0)

    def change(config: dict) -> None:
        target = config["text_config"] if model_type == "gemma3" else config
        target.update(rope_scaling={**scaling, **rope_ignored}, **UNKNOWN)
        config.update(ignored)

    directory = edited(good, tmp_path, model_type, change)
    changed, base = SafetensorsWeights(directory), SafetensorsWeights(good[model_type])
    base_settings = dict(BASE[model_type])
    if model_type == "gemma3":
        base_settings["text_config"] = dict(base_settings["text_config"], rope_scaling=scaling)
    else:
        base_settings["rope_scaling"] = scaling
    assert changed.config == LlamaConfig.from_hf(base_settings) != base.config
    assert changed.names() == base.names()


# transformers' own config.json ---------------------------------------------------------------------------------


def test_config_json_as_transformers_writes_it():
    """Where transformers is installed: the config.json its classes write (``to_json_string``, as
    ``save_pretrained``) of a few settings per model type reads as transformers' formulas say."""
    transformers = pytest.importorskip("transformers")
    sizes = {key: BASE["llama"][key] for key in BASE["llama"] if key not in ("model_type", "tie_word_embeddings")}
    configs = [
        transformers.LlamaConfig(
            **sizes, rope_theta=500.0, rope_scaling=dict(LLAMA3, original_max_position_embeddings=64)
        ),
        transformers.MistralConfig(**sizes, sliding_window=WINDOW),
        transformers.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        transformers.Qwen3Config(**sizes, head_dim=16, rope_scaling=dict(rope_type="linear", factor=2.0)),
        transformers.Gemma3TextConfig(
            **sizes, sliding_window=WINDOW, query_pre_attn_scalar=20, rope_local_base_freq=100.0
        ),
    ]
    for config in configs:
        settings = json.loads(config.to_json_string())
        r = reading(settings)
        ours = LlamaConfig.from_hf(settings)
        assert [ours.window(layer) for layer in range(r["layers"])] == r["windows"], settings["model_type"]
        for layer in range(r["layers"]):
            rope = ours.rope(layer)
            base = 1.0 / rope["theta"] ** (np.arange(0, r["head_dim"], 2) / r["head_dim"])
            np.testing.assert_allclose(base / np.asarray(rope["factors"] or 1.0), r["frequencies"][layer], rtol=1e-12)
        assert (ours.query_scale or ours.head_dim**-0.5) == pytest.approx(r["scale"])
