"""Tiny checkpoints written by transformers itself (``save_pretrained``, safetensors) and compared with
transformers' own models of them, run in float64: a reading of each architecture nobody here wrote. Runs
where torch and transformers are installed (they are not in the default test set-up: torch is a large
download); tests/test_llama_variants.py and tests/test_gemma3.py check the same variants against float64 numpy
models everywhere.

Mistral and Qwen2 are also run with a sliding window shorter than the prompt (through the safetensors loader and
the engine's paged KV), and Gemma 3 (transformers' ``Gemma3ForCausalLM``) both from the directory
``save_pretrained`` writes and through a GGUF file written from its weights as llama.cpp's converter writes one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.models.config import LlamaConfig
from batchgpu.models.llama import Llama

torch = pytest.importorskip("torch", reason="transformers' models need torch")
transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 8, 29, 11, 5]
WINDOW = 3  # positions a windowed layer's query sees, its own included: shorter than PROMPT
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
WINDOWED = {
    # every layer windowed
    "mistral-window": lambda: transformers.MistralConfig(**SIZES, sliding_window=WINDOW),
    # layers from max_window_layers on windowed (transformers writes them as layer_types)
    "qwen2-window": lambda: transformers.Qwen2Config(
        **SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=False
    ),
}
WINDOWS = {"mistral-window": [WINDOW, WINDOW], "qwen2-window": [0, WINDOW]}
"""Each windowed config's window per layer (0: global), as transformers applies it."""


def tiny_model(config: transformers.PretrainedConfig, seed: int, dtype: torch.dtype, norm: float = 1.0):
    """transformers' model of ``config`` with random weights, norm weights (1-D) offset by ``norm``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():  # larger than the init's 0.02: logits far from uniform
            parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
            if parameter.ndim == 1:
                parameter.add_(norm)
    return model.to(dtype)


def float64_run(directory) -> tuple[np.ndarray, list[int]]:
    """transformers' float64 model of the checkpoint in ``directory``: the prompt's last logits and 4 greedy ids.
    Loaded afresh in float64 (casting a bfloat16 model would round its RoPE frequencies to bfloat16 too)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
        greedy = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None
        )[0, len(PROMPT) :].tolist()
    return logits, greedy


def check_matches(path, expected: np.ndarray, greedy: list[int], kind: str = "reference") -> Llama:
    """Our model of ``path`` on executor ``kind``: prefill logits within 1e-5 x max|logit| of transformers'
    float64 ones (our float32 kernels against float64), the same greedy ids."""
    ours = Llama(bg.Device(kind), path, max_context=32)
    step = ours.prefill(PROMPT)
    logits = step.batch.read(step.logits)[0]
    np.testing.assert_allclose(logits, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert list(ours.generate(PROMPT, 4)) == greedy
    return ours


def engine_greedy(path) -> list[int]:
    """4 greedy ids from the engine: paged KV in blocks of 2, the prompt prefilled in chunks of 2 (both
    shorter than the window, so a windowed query spans blocks and chunks)."""
    engine = Engine(path, bg.Device("reference"), max_batch=2, max_context=32, block_size=2, max_step_tokens=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return engine.complete(PROMPT, params).token_ids


def write_tokenizer(directory, vocab: int) -> None:
    """A word-level tokenizer.json of ``vocab`` one-character tokens (the engine needs a tokenizer)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = {chr(0x100 + i): i for i in range(vocab)}
    Tokenizer(WordLevel(words, unk_token=chr(0x100))).save(str(directory / "tokenizer.json"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_matches_transformers(tmp_path, name, dtype):
    tiny_model(CONFIGS[name](), len(name), dtype).save_pretrained(tmp_path, safe_serialization=True)
    ours = check_matches(tmp_path, *float64_run(tmp_path))
    if dtype == torch.bfloat16:
        assert ours.params["blk.0.ffn_down.weight"].qtype == "bf16"


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_checkpoint_matches_transformers(tmp_path, name):
    """A window of 3 positions over a 7-token prompt and 4 generated tokens: logits and greedy ids as
    transformers', from Llama (reference and wgpu executors) and from the engine; Qwen2's also from a
    transformers 4 config.json (no ``layer_types``: the windowed layers from ``use_sliding_window`` and
    ``max_window_layers``)."""
    config = WINDOWED[name]()
    tiny_model(config, len(name), torch.float32).save_pretrained(tmp_path, safe_serialization=True)
    expected, greedy = float64_run(tmp_path)
    ours = check_matches(tmp_path, expected, greedy)
    assert [ours.config.window(layer) for layer in range(2)] == WINDOWS[name]
    check_matches(tmp_path, expected, greedy, "wgpu")
    write_tokenizer(tmp_path, SIZES["vocab_size"])
    assert engine_greedy(tmp_path) == greedy
    if name == "qwen2-window":
        settings = json.loads((tmp_path / "config.json").read_text())
        del settings["layer_types"]
        (tmp_path / "config.json").write_text(json.dumps(settings))
        check_matches(tmp_path, expected, greedy)


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
    pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
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


GEMMA3 = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,  # 0-4 windowed, 5 global, 6 windowed
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    query_pre_attn_scalar=32,  # the head size (Gemma 3 1B-12B; 27B's is hidden / heads)
    max_position_embeddings=64,
    sliding_window=WINDOW,
    sliding_window_pattern=6,  # llama.cpp's gemma3 fixes it: every sixth layer global
    rope_theta=1e6,  # global layers
    rope_local_base_freq=1e4,  # windowed layers: llama.cpp's gemma3 fixes it (its converter does not write it)
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=None,  # batchgpu refuses soft-capping
    attn_logit_softcapping=None,
)


def gemma3_gguf_weights(model: torch.nn.Module, layers: int) -> dict[str, np.ndarray]:
    """transformers' Gemma 3 weights as llama.cpp's converter (``Gemma3Model``) writes them: renamed by the
    ``gguf`` package's tensor name map, 1 added to every norm weight (Gemma's RMS norm multiplies by 1 + w;
    GGUF files store 1 + w), q/k rows as they are, the tied head left out."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    weights = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        gguf_name = name_map.get_name(name, try_suffixes=(".weight",))
        data = tensor.numpy().astype(np.float32)
        weights[gguf_name] = data + np.float32(1) if gguf_name.endswith("norm.weight") else data
    return weights


def test_gemma3_matches_transformers(tmp_path):
    """transformers' Gemma3ForCausalLM (float64) against batchgpu's reading of the directory ``save_pretrained``
    wrote and of a GGUF written from the same weights (float32): prefill logits within 1e-5 x max|logit| and
    greedy ids over a prompt longer than the window, from Llama (reference and wgpu executors) and from the
    engine; the directory and the GGUF give bit-equal logits on the reference executor (the same bytes on the
    device). transformers' Gemma RMS norm computes in float32 even in a float64 model, so the reference holds
    float32 rounding there (far inside the tolerance)."""
    from .test_gemma3 import write_gemma3

    config = transformers.Gemma3TextConfig(**GEMMA3)
    model = tiny_model(config, 3, torch.float32, norm=0.0)  # norm weights near 0: gains near 1
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    expected, greedy = float64_run(tmp_path / "hf")
    d = dict(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        ffn=config.intermediate_size,
        vocab=config.vocab_size,
        eps=config.rms_norm_eps,
        theta=config.rope_parameters["full_attention"]["rope_theta"],
        window=config.sliding_window,
    )
    path = tmp_path / "gemma3.gguf"
    write_gemma3(path, gemma3_gguf_weights(model, d["layers"]), d)
    ours = check_matches(path, expected, greedy)
    check_matches(path, expected, greedy, "wgpu")
    windowed = [kind == "sliding_attention" for kind in config.layer_types]
    assert [ours.config.window(layer) for layer in range(d["layers"])] == [WINDOW * w for w in windowed]
    assert {ours.config.rope(layer)["theta"] for layer in range(d["layers"]) if windowed[layer]} == {1e4}
    assert engine_greedy(path) == greedy
    directory = check_matches(tmp_path / "hf", expected, greedy)  # the directory itself (transformers' config.json)
    assert dataclasses.replace(directory.config, eps=ours.config.eps) == ours.config  # the GGUF's eps is float32
    both = [model.prefill(PROMPT) for model in (directory, ours)]
    np.testing.assert_array_equal(*(step.batch.read(step.logits) for step in both))
    check_matches(tmp_path / "hf", expected, greedy, "wgpu")
    write_tokenizer(tmp_path / "hf", config.vocab_size)
    assert engine_greedy(tmp_path / "hf") == greedy
