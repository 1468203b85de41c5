"""Gemma 3 from a Hugging Face model directory (``model_type`` ``gemma3_text``: Gemma3ForCausalLM as transformers'
``save_pretrained`` writes it, as google/gemma-3-270m and gemma-3-1b-it are published) against the same weights in
the GGUF file llama.cpp's converter writes from it (tests/test_gemma3.py's ``write_gemma3``) and against the float64
numpy Gemma 3 of tests/test_gemma3.py.

The contract: the directory's tensors reach the device as the same bytes as the GGUF's (the converter's only
change is 1 added to every RMS norm weight, in float32, which the directory reading adds the same way), so on the
reference executor (numpy, one fixed order of operations) logits are bit-equal and greedy ids equal; on wgpu both
are within float32 rounding of the float64 model (1e-5 x max|logit|) with its greedy ids. transformers' own
Gemma3ForCausalLM is compared in tests/test_hf_models.py where torch is installed."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.config import LlamaConfig
from batchgpu.models.gguf_file import GGUFWeights
from batchgpu.models.llama import Llama
from batchgpu.models.safetensors_dir import SafetensorsWeights

from .test_gemma3 import (
    PROMPT,
    TINY,
    gemma3_270m,  # noqa: F401 - a fixture
    gemma3_float64_logits,
    greedy,
    random_gemma3,
    write_gemma3,
)

pytest.importorskip("safetensors", reason="the safetensors package writes the test checkpoints")

HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""transformers' Gemma 3 tensor names (written out here, not taken from the gguf package the loader uses)."""
DROP: Any = object()
"""A config value that leaves its key out."""


def hf_name(name: str) -> str:
    if name.count(".") == 1:
        base, suffix = name.split(".")
        return f"{HF_NAMES[base]}.{suffix}"
    _, layer, tensor, suffix = name.split(".")
    return f"model.layers.{layer}.{HF_LAYER_NAMES[tensor]}.{suffix}"


def layer_types(d: dict) -> list[str]:
    return d.get("layer_types") or [
        "full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(d["layers"])
    ]


def hf_config(d: dict, **changes: Any) -> dict:
    """config.json as transformers 4.5x writes a Gemma3TextConfig (``changes`` replace keys; DROP leaves one out)."""
    config = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=d["vocab"],
        hidden_size=d["hidden"],
        intermediate_size=d["ffn"],
        num_hidden_layers=d["layers"],
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"],
        head_dim=d["head_dim"],
        query_pre_attn_scalar=d["head_dim"],
        max_position_embeddings=64,
        rms_norm_eps=d["eps"],
        rope_theta=d["theta"],
        rope_local_base_freq=d["local"],
        rope_scaling=None,
        sliding_window=d["window"],
        layer_types=layer_types(d),
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        attention_bias=False,
        attention_dropout=0.0,
        use_bidirectional_attention=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        torch_dtype="float32",
    )
    config.update(changes)
    return {key: value for key, value in config.items() if value is not DROP}


def split_weights(seed: int, d: dict = TINY) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the checkpoint's tensors by GGUF name: norm weights w of Gemma's (1 + w) RMS norm, the GGUF's: 1 added to
    every norm weight in float32, as llama.cpp's converter writes them)."""
    stored = {
        name: array - np.float32(1) if name.endswith("norm.weight") else array
        for name, array in random_gemma3(d, seed).items()
    }
    return stored, {
        name: array + np.float32(1) if name.endswith("norm.weight") else array for name, array in stored.items()
    }


def write_directory(
    directory: Path,
    stored: dict[str, np.ndarray],
    config: dict,
    name: Callable[[str], str] = hf_name,
    others: dict[str, np.ndarray] | None = None,
) -> Path:
    """A Gemma3ForCausalLM directory: config.json, model.safetensors (float32, each tensor under ``name(its GGUF
    name)``, ``others`` besides; no lm_head: tied), tokenizer.json."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {name(gguf_name): array for gguf_name, array in stored.items()}
    save_file({**tensors, **(others or {})}, str(directory / "model.safetensors"))
    vocab = {chr(ord("A") + i) if i < 26 else chr(ord("a") + i - 26): i for i in range(TINY["vocab"])}
    Tokenizer(models.BPE(vocab, [])).save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(the directory, the GGUF file of the same weights, the weights the GGUF holds)."""
    tmp = tmp_path_factory.mktemp("gemma3_dir")
    stored, converted = split_weights(40)
    write_gemma3(tmp / "gemma3.gguf", converted)
    return write_directory(tmp / "hf", stored, hf_config(TINY)), tmp / "gemma3.gguf", converted


def last_logits(model: Llama) -> np.ndarray:
    step = model.prefill(PROMPT)
    return step.batch.read(step.logits)[0]


# the config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(layer_types=DROP),  # older configs: sliding_window_pattern (6 by default) instead
        dict(layer_types=DROP, sliding_window_pattern=6),
        # transformers 5: RoPE per layer type, no rope_theta / rope_local_base_freq
        dict(
            rope_theta=DROP,
            rope_local_base_freq=DROP,
            rope_scaling=DROP,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": TINY["theta"]},
                "sliding_attention": {"rope_type": "default", "rope_theta": TINY["local"]},
            },
        ),
    ],
    ids=["transformers 4.5x", "no layer_types", "sliding_window_pattern", "rope_parameters"],
)
def test_config_is_the_gguf_reading(pair, changes):
    """config.json read into exactly the LlamaConfig the GGUF gives: architecture gemma3, every sixth layer global,
    RoPE bases 1e6 (global) and 1e4 (windowed, unscaled), the attention scale 1 / sqrt(head_dim)."""
    gguf_config = GGUFWeights(pair[1]).config
    config = LlamaConfig.from_hf(hf_config(TINY, **changes))
    assert np.float32(config.eps) == np.float32(gguf_config.eps)  # the GGUF's is float32; the kernels' too
    assert dataclasses.replace(config, eps=gguf_config.eps) == gguf_config
    assert [gguf_config.window(layer) for layer in range(7)] == [3, 3, 3, 3, 3, 0, 3]


def test_query_pre_attn_scalar_sets_the_attention_scale():
    """transformers scales queries by query_pre_attn_scalar ** -0.5 (the head size in Gemma 3 1B-12B, which the
    decoder's default 1 / sqrt(head_dim) is; hidden / heads in 27B), and so does llama.cpp's 27B from a GGUF."""
    assert LlamaConfig.from_hf(hf_config(TINY, query_pre_attn_scalar=48)).query_scale == 48**-0.5
    assert LlamaConfig.from_hf(hf_config(TINY, query_pre_attn_scalar=32.0)).query_scale == 0.0


# the numbers --------------------------------------------------------------------------------------------


def test_directory_runs_the_gguf_numbers(pair):
    """Every tensor read from the directory is bit-equal to the GGUF's (norms + 1 included); on the reference
    executor the prefill logits are then bit-equal and the greedy ids equal, and both match the float64 model."""
    directory, gguf_file, weights = pair
    from_dir, from_gguf = SafetensorsWeights(directory), GGUFWeights(gguf_file)
    assert sorted(from_dir.names()) == sorted(from_gguf.names())
    for name in from_gguf.names():
        np.testing.assert_array_equal(from_dir.float32(name), from_gguf.float32(name), err_msg=name)
    device = bg.Device("reference")
    ours, theirs = Llama(device, directory, max_context=32), Llama(device, gguf_file, max_context=32)
    logits = last_logits(ours)
    np.testing.assert_array_equal(logits, last_logits(theirs))
    expected = gemma3_float64_logits(TINY, weights, PROMPT)
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    ids = greedy(TINY, weights, PROMPT, 4)
    assert list(ours.generate(PROMPT, 4)) == list(theirs.generate(PROMPT, 4)) == ids


def test_directory_on_wgpu(pair):
    """On wgpu (lavapipe here): logits within 1e-5 x max|logit| of the float64 model, its greedy ids."""
    directory, _, weights = pair
    model = Llama(bg.Device("wgpu"), directory, max_context=32)
    expected = gemma3_float64_logits(TINY, weights, PROMPT)
    np.testing.assert_allclose(last_logits(model), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(model.generate(PROMPT, 4)) == greedy(TINY, weights, PROMPT, 4)


def test_engine_serves_the_directory(pair):
    """The engine (paged KV in blocks of 2, prefill in chunks of 2 across the 3-position window) serves the
    directory unchanged: the float64 model's greedy ids."""
    directory, _, weights = pair
    engine = Engine(directory, bg.Device("reference"), max_batch=2, max_context=32, block_size=2, max_step_tokens=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert engine.complete(PROMPT, params).token_ids == greedy(TINY, weights, PROMPT, 4)


LAYOUTS = {
    "alternating": ["sliding_attention", "full_attention"] * 3 + ["sliding_attention"],
    "all global": ["full_attention"] * 7,
    "global first": ["full_attention"] + ["sliding_attention"] * 6,
}


@pytest.mark.parametrize("kinds", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_any_layer_types_pattern(tmp_path, kinds):
    """A directory may window any layers (a GGUF's gemma3 cannot say so: llama.cpp fixes every sixth layer
    global): each layer's window and RoPE base follow its layer_types entry, the numbers the float64 model's."""
    d = dict(TINY, layer_types=kinds)
    stored, weights = split_weights(41)
    directory = write_directory(tmp_path / "hf", stored, hf_config(d))
    model = Llama(bg.Device("reference"), directory, max_context=32)
    windowed = [kind == "sliding_attention" for kind in kinds]
    assert [model.config.window(layer) for layer in range(7)] == [3 * w for w in windowed]
    assert [model.config.rope(layer)["theta"] for layer in range(7)] == [1e4 if w else 1e6 for w in windowed]
    expected = gemma3_float64_logits(d, weights, PROMPT)
    np.testing.assert_allclose(last_logits(model), expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(model.generate(PROMPT, 3)) == greedy(d, weights, PROMPT, 3)


# what cannot be run -------------------------------------------------------------------------------------

BAD_CONFIGS = [
    ("hidden_activation gelu (erf)", dict(hidden_activation="gelu"), bg.BatchError, r"hidden_activation 'gelu'"),
    ("hidden_activation silu", dict(hidden_activation="silu"), bg.BatchError, r"gelu_pytorch_tanh only"),
    ("hidden_activation a list", dict(hidden_activation=["gelu"]), bg.ModelFileError, r"hidden_activation must be"),
    ("final logit soft-capping", dict(final_logit_softcapping=30.0), bg.BatchError, r"final_logit_softcapping"),
    ("attention soft-capping", dict(attn_logit_softcapping=50.0), bg.BatchError, r"attn_logit_softcapping"),
    (
        "bidirectional attention",
        dict(use_bidirectional_attention=True),
        bg.BatchError,
        r"use_bidirectional_attention",
    ),
    (
        "layer_types of 6 for 7 layers",
        dict(layer_types=["sliding_attention"] * 6),
        bg.ModelFileError,
        r"layer_types must be an array of one type per layer \(7\)",
    ),
    (
        "layer_types with an unknown kind",
        dict(layer_types=["sliding_attention"] * 3 + ["chunked_attention"] + ["full_attention"] * 3),
        bg.ModelFileError,
        r"layer_types\[3\] must be one of sliding_attention, full_attention, got 'chunked_attention'",
    ),
    ("layer_types a string", dict(layer_types="sliding_attention"), bg.ModelFileError, r"layer_types must be an"),
    (
        "sliding_window 0 with windowed layers",
        dict(sliding_window=0),
        bg.ModelFileError,
        r"sliding_window must be an integer in \[1, ",
    ),
    (
        "sliding_window null with windowed layers",
        dict(sliding_window=None),
        bg.ModelFileError,
        r"sliding_window is missing",
    ),
    (
        "sliding_window_pattern 0",
        dict(layer_types=DROP, sliding_window_pattern=0),
        bg.ModelFileError,
        r"sliding_window_pattern must be an integer in \[1, ",
    ),
    ("query_pre_attn_scalar 0", dict(query_pre_attn_scalar=0), bg.ModelFileError, r"query_pre_attn_scalar"),
    ("query_pre_attn_scalar a string", dict(query_pre_attn_scalar="256"), bg.ModelFileError, r"query_pre_attn"),
    ("rope_local_base_freq -1", dict(rope_local_base_freq=-1.0), bg.ModelFileError, r"rope_local_base_freq"),
    (
        "windowed layers' RoPE scaled",
        dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
        bg.BatchError,
        r"rope_parameters\.sliding_attention\.rope_type 'linear'",
    ),
    (
        "global layers' RoPE YaRN",
        dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}),
        bg.BatchError,
        r"RoPE scaling 'yarn' is not supported",
    ),
    (
        "a multimodal gemma3 without text_config",
        dict(model_type="gemma3", text_config=DROP),
        bg.ModelFileError,
        r"text_config \(the language model's config\) is missing",
    ),
    (
        "a multimodal gemma3 of another language model",
        dict(model_type="gemma3", text_config=hf_config(TINY, model_type="gemma2_text")),
        bg.ModelFileError,
        r"text_config\.model_type must be 'gemma3_text', got 'gemma2_text'",
    ),
    (
        "a multimodal gemma3's language model with gelu (erf)",
        dict(model_type="gemma3", text_config=hf_config(TINY, hidden_activation="gelu")),
        bg.BatchError,
        r"text_config\.hidden_activation 'gelu'",
    ),
    (
        "another model_type",
        dict(model_type="gemma2"),
        bg.BatchError,
        r"model_type 'gemma2' is not supported; supported: llama, mistral, qwen2, qwen3, gemma3_text, gemma3",
    ),
]


@pytest.mark.parametrize(
    ("changes", "error", "message"), [case[1:] for case in BAD_CONFIGS], ids=[case[0] for case in BAD_CONFIGS]
)
def test_configs_it_cannot_run_are_refused(pair, tmp_path, changes, error, message):
    """Each refused by name, config.json named, before any tensor is read; the device then runs the good one."""
    stored, _ = split_weights(40)
    directory = write_directory(tmp_path / "bad", stored, hf_config(TINY, **changes))
    device = bg.Device("reference")
    with pytest.raises(error, match=message) as refused:
        Llama(device, directory, max_context=32)
    assert "config.json" in str(refused.value)
    model = Llama(device, pair[0], max_context=32)
    assert list(model.generate(PROMPT, 2)) == greedy(TINY, pair[2], PROMPT, 2)


# the multimodal Gemma 3 -------------------------------------------------------------------------------

MULTIMODAL_NAMES = {
    "transformers 4": lambda name: "language_model." + hf_name(name),
    "transformers 5": lambda name: hf_name(name).replace("model.", "model.language_model.", 1),
}
"""Gemma3ForConditionalGeneration's names of its language model's tensors (hub checkpoints, and transformers 5's
``save_pretrained``)."""


@pytest.mark.parametrize("style", list(MULTIMODAL_NAMES))
def test_multimodal_gemma3_runs_its_language_model(pair, tmp_path, style):
    """A Gemma3ForConditionalGeneration directory (model_type gemma3: a vision tower beside the language model,
    whose text_config holds only what differs from transformers' defaults, as 4B-27B publish it) runs on text:
    its language model's tensors, the vision tensors unread; the logits bit-equal to the text-only directory's."""
    stored, _ = split_weights(40)
    assert (TINY["eps"], TINY["theta"], TINY["local"]) == (1e-6, 1e6, 1e4)  # transformers' defaults: left out
    text = hf_config(TINY, rms_norm_eps=DROP, rope_theta=DROP, rope_local_base_freq=DROP, architectures=DROP)
    config = dict(
        architectures=["Gemma3ForConditionalGeneration"],
        model_type="gemma3",
        text_config=text,
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 8},
        eos_token_id=[1, 49],
    )
    prefix = "model." if style == "transformers 5" else ""
    rng = np.random.default_rng(3)
    vision = {
        f"{prefix}vision_tower.vision_model.embeddings.patch_embedding.weight": rng.standard_normal((8, 3, 2, 2)),
        f"{prefix}multi_modal_projector.mm_soft_emb_norm.weight": rng.standard_normal(8),
    }
    vision = {name: array.astype(np.float32) for name, array in vision.items()}
    directory = write_directory(tmp_path / "mm", stored, config, MULTIMODAL_NAMES[style], vision)
    device = bg.Device("reference")
    model = Llama(device, directory, max_context=32)
    assert model.config == Llama(device, pair[0], max_context=32).config
    np.testing.assert_array_equal(last_logits(model), last_logits(Llama(device, pair[0], max_context=32)))


def test_two_tensors_of_one_name_are_refused(pair, tmp_path):
    """Two names the gguf name map takes for one tensor (transformers' and Meta's embedding) were one silently
    dropped; now a ModelFileError naming both."""
    stored, _ = split_weights(40)
    other = {"tok_embeddings.weight": stored["token_embd.weight"] * np.float32(2)}
    directory = write_directory(tmp_path / "two", stored, hf_config(TINY), others=other)
    with pytest.raises(bg.ModelFileError, match=r"'model\.embed_tokens\.weight' and 'tok_embeddings\.weight'"):
        Llama(bg.Device("reference"), directory, max_context=32)


def test_qwen3_layer_types_of_an_unknown_kind_are_refused():
    """An unknown layer kind was taken for a global layer in any model type: now refused by name."""
    settings = dict(
        model_type="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=50,
        sliding_window=4,
        layer_types=["linear_attention", "full_attention"],
    )
    with pytest.raises(bg.ModelFileError, match=r"layer_types\[0\] must be one of .*got 'linear_attention'"):
        LlamaConfig.from_hf(settings)


# the chat template --------------------------------------------------------------------------------------


GEMMA_CHAT = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{% if loop.first %}{{ prefix }}{% endif %}{{ m['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
"""Gemma 3's chat format (written here): <bos>, a system message folded into the first user turn, user and
model turns alternating, each <start_of_turn>ROLE ... <end_of_turn>."""


@pytest.mark.slow
def test_gemma3_chat_template_from_a_directory(gemma3_270m, tmp_path):  # noqa: F811 - a fixture
    """Gemma 3's tokenizer (tokenizer.json) and a chat template in its format (tokenizer_config.json, with <bos>
    and <eos>; generation_config.json's end tokens <eos> and <end_of_turn>) as a directory holds them: the chat
    renders, its control tokens encode as single ids, and roles out of turn are refused by the template."""
    from batchgpu.models.codec import TextCodec
    from batchgpu.models.gguf_reader import GGUFFile

    TextCodec.from_gguf(GGUFFile(gemma3_270m)).tokenizer.save(str(tmp_path / "tokenizer.json"))
    settings = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_CHAT}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    codec = TextCodec.from_hf(tmp_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "The capital of France?"},
    ]
    assert codec.render_chat(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nThe capital of France?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = codec.encode_chat(messages)
    assert ids[:2] == [2, 105] and ids.count(105) == 4 and ids.count(106) == 3  # <bos> <start_of_turn> <end_of_turn>
    assert codec.eos_ids == {1, 106}
    with pytest.raises(bg.RequestError, match="roles must alternate"):
        codec.render_chat(messages[2:])
