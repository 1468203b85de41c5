"""Tiny checkpoints written by transformers itself (``save_pretrained``, safetensors) and compared with
transformers' own models of them, run in float64: a reading of each architecture nobody here wrote. Runs
where torch and transformers are installed (they are not in the default test set-up: torch is a large
download); tests/test_llama_variants.py checks the same variants against a float64 numpy model everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.models.config import LlamaConfig
from batchgpu.models.llama import Llama

torch = pytest.importorskip("torch", reason="transformers' models need torch")
transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 8, 29, 11, 5]
SIZES = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8
)
CONFIGS = {
    "llama3": lambda: transformers.LlamaConfig(**SIZES, rope_theta=500000.0, rope_scaling=LLAMA3),
    "llama-linear": lambda: transformers.LlamaConfig(**SIZES, rope_scaling=dict(rope_type="linear", factor=4.0)),
    "mistral": lambda: transformers.MistralConfig(**SIZES, sliding_window=None, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SIZES, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SIZES, head_dim=32, tie_word_embeddings=False),
}


def tiny_model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    with torch.no_grad():
        for parameter in model.parameters():  # larger than the init's 0.02: logits far from uniform
            parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
            if parameter.ndim == 1:
                parameter.add_(1.0)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_matches_transformers(tmp_path, name, dtype):
    model = tiny_model(name, dtype)
    model.save_pretrained(tmp_path, safe_serialization=True)
    # loaded afresh in float64 (casting the bfloat16 model would round its RoPE frequencies to bfloat16 too)
    expected_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    with torch.no_grad():
        expected = expected_model(torch.tensor([PROMPT])).logits[0, -1].numpy()
        greedy = expected_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(PROMPT) :].tolist()
    ours = Llama(bg.Device("reference"), tmp_path, max_context=32)
    step = ours.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(ours.generate(PROMPT, 4)) == greedy
    if dtype == torch.bfloat16:
        assert ours.params["blk.0.ffn_down.weight"].qtype == "bf16"


def test_llama3_rope_factors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = CONFIGS["llama3"]()
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = LlamaConfig.from_hf(config.to_dict())
    base = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(base / np.asarray(ours.rope_factors), inv.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    ("variant", "qtype"), [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F16"), ("qwen3", "F32")]
)
def test_gguf_reading_matches_transformers_gguf_loader(tmp_path, variant, qtype):
    """The tiny GGUF files of tests/test_llama_variants.py read by transformers' own GGUF loader (which undoes
    llama.cpp's q/k permutation its own way) give the logits our reading of them gives."""
    from .test_llama_variants import VARIANTS, random_weights, write_gguf

    # transformers' GGUF reader does not read the head size: Qwen3Config's default (128) it is
    d = dict(VARIANTS[variant], head_dim=128 if variant == "qwen3" else 16)
    write_gguf(tmp_path / "model.gguf", variant, random_weights(d, 21), qtype, d)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float64)
    with torch.no_grad():
        expected = theirs.eval()(torch.tensor([PROMPT])).logits[0, -1].numpy()
    ours = Llama(bg.Device("reference"), tmp_path / "model.gguf", max_context=32)
    step = ours.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
