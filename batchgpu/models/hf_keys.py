"""What each key of a Hugging Face ``config.json`` does here, per ``model_type``: every key of transformers'
config class of that model type (``<Class>().to_dict()`` of transformers 4.57 and 5.24: config.json files in the
wild come from both) and the keys its model code reads beyond them (``partial_rotary_factor``, ``head_dim`` of
Qwen2, ``quantization_config``, ...) is a row, an :class:`HFKey` that is one of:

- **applied**: read, type- and range-checked before anything sized by it exists, into the
  :class:`~batchgpu.models.config.LlamaConfig` or a check of the tensors (the note says which);
- **ignored**: it cannot change the logits (the note says why);
- **refused unless neutral**: it turns on a computation this decoder lacks; a value other than its neutral ones
  is refused by name (absent or null always passes), never run as if it were not there.

A key that is not a row of its model type's table is one transformers' model of that type never reads either,
and is ignored as transformers ignores it (``is_llama_config``, ``rope_interleaved``, ...), except the
:data:`FOREIGN_KEYS`: keys that turn on a computation in other transformers models, refused unless neutral, since a
file carrying one was likely written for code that computes it. tests/test_hf_keys.py holds the key lists of the
transformers classes and fails on a key without a row."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

APPLIED, IGNORED, REFUSED = "applied", "ignored", "refused unless neutral"
HANDLINGS = (APPLIED, IGNORED, REFUSED)


@dataclass(frozen=True)
class HFKey:
    """One config.json key's handling: a row of the tables of :data:`HF_KEYS`."""

    handling: str
    """One of :data:`HANDLINGS`."""
    note: str
    """applied: what it sets or checks; ignored: why the logits do not depend on it; refused: the computation a
    value other than the neutral ones turns on."""
    neutral: tuple[Any, ...] = ()
    """refused: the values that ask for nothing this decoder lacks (besides absent and null)."""


def applied(note: str) -> HFKey:
    return HFKey(APPLIED, note)


def ignored(reason: str) -> HFKey:
    return HFKey(IGNORED, reason)


def refused(what: str, *neutral: Any) -> HFKey:
    return HFKey(REFUSED, what, neutral)


# why a key cannot change the logits ----------------------------------------------------------------------

METADATA = ignored("metadata: names and versions of the checkpoint, its classes, labels and tokenizer class")
RUNTIME = ignored("a switch of transformers' run (what a forward returns, caching, chunking, scripting): same logits")
DTYPE = ignored("the dtype transformers loads the weights in: the tensors' own dtypes are read, computed in float32")
TOKEN_IDS = ignored(
    "a special token id, not part of the computation (the end tokens: generation_config.json's, else this "
    "eos_token_id, read by the text codec)"
)
GENERATION = ignored("a default of transformers' generate() (search, sampling, lengths): each request has its own")
ENCODER_DECODER = ignored("an encoder-decoder setting: a decoder-only model reads none")
TRAINING = ignored("training only (weight init, dropout, losses): the checkpoint's weights, no dropout at inference")
VISION = ignored("the vision tower and image tokens: text alone runs here, the vision tensors left unread")


def rows(keys: tuple[str, ...], row: HFKey) -> dict[str, HFKey]:
    return dict.fromkeys(keys, row)


PRETRAINED_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        "model_type": applied("the row of HF_MODEL_TYPES that reads the others"),
        "tie_word_embeddings": applied(
            "the output head: the token embedding where true (a checkpoint's own lm_head must then equal it), "
            "the checkpoint's lm_head where false (which must be there); the model type's default where absent"
        ),
        "pruned_heads": refused("attention heads pruned away", {}),
        "quantization_config": refused(
            "weights quantized by a transformers quantizer (GPTQ, AWQ, bitsandbytes, FP8, ...), whose tensors and "
            "kernels are not read here; transformers reads it for every model type"
        ),
        **rows(
            (
                "_name_or_path",
                "architectures",
                "transformers_version",
                "finetuning_task",
                "id2label",
                "label2id",
                "problem_type",
                "tokenizer_class",
                "prefix",
                "task_specific_params",
            ),
            METADATA,
        ),
        **rows(("output_attentions", "output_hidden_states", "return_dict", "torchscript"), RUNTIME),
        **rows(("chunk_size_feed_forward",), RUNTIME),
        **rows(("dtype", "torch_dtype", "use_bfloat16"), DTYPE),
        **rows(("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id"), TOKEN_IDS),
        **rows(
            (
                "bad_words_ids",
                "begin_suppress_tokens",
                "diversity_penalty",
                "do_sample",
                "early_stopping",
                "encoder_no_repeat_ngram_size",
                "exponential_decay_length_penalty",
                "forced_bos_token_id",
                "forced_eos_token_id",
                "length_penalty",
                "max_length",
                "min_length",
                "no_repeat_ngram_size",
                "num_beam_groups",
                "num_beams",
                "num_return_sequences",
                "output_scores",
                "remove_invalid_values",
                "repetition_penalty",
                "return_dict_in_generate",
                "suppress_tokens",
                "temperature",
                "top_k",
                "top_p",
                "typical_p",
            ),
            GENERATION,
        ),
        **rows(
            (
                "is_encoder_decoder",
                "is_decoder",
                "add_cross_attention",
                "cross_attention_hidden_size",
                "decoder_start_token_id",
                "tie_encoder_decoder",
            ),
            ENCODER_DECODER,
        ),
        "tf_legacy_loss": TRAINING,
    }
)
"""transformers' ``PretrainedConfig`` (4.57) / ``PreTrainedConfig`` (5.24) keys, which every model type has, and
``quantization_config``, which its loader reads for every model type."""

PARTIAL_ROTARY = refused("partial rotary: RoPE on a part of each head, the rest unrotated", 1.0)

DECODER_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        "vocab_size": applied("vocab: the token embedding's (and output head's) rows"),
        "hidden_size": applied("hidden"),
        "intermediate_size": applied("ffn: the MLP's width"),
        "num_hidden_layers": applied("layers"),
        "num_attention_heads": applied("heads"),
        "num_key_value_heads": applied(
            "kv_heads (default: heads; where transformers' class default differs, Mistral's 8 and Qwen2's 32, the k/v "
            "projections' shapes refuse a checkpoint it would read otherwise)"
        ),
        "head_dim": applied(
            "head_size (default: hidden_size / num_attention_heads, Gemma 3's 256; where transformers' class default "
            "differs, Qwen3's 128, the projections' shapes refuse a checkpoint it would read otherwise)"
        ),
        "max_position_embeddings": applied("context: the longest max_context a model is loaded with"),
        "rms_norm_eps": applied("eps of every RMS norm"),
        "rope_theta": applied("theta: the RoPE base (transformers 4; where the RoPE parameters give one, the same)"),
        "rope_scaling": applied(
            "rope_factors: RoPE scaling (transformers 4): default, linear, llama3 applied (ROPE_KEYS), others refused"
        ),
        "rope_parameters": applied("theta and rope_factors (transformers 5): as rope_scaling, ROPE_KEYS"),
        "partial_rotary_factor": PARTIAL_ROTARY,
        "original_max_position_embeddings": applied(
            "llama3 RoPE scaling's original context (transformers 5 reads it over the RoPE parameters' own: the two "
            "must agree)"
        ),
        "initializer_range": TRAINING,
        "attention_dropout": TRAINING,
        "use_cache": RUNTIME,
    }
)
"""Keys of every decoder model type here (``head_dim``: Qwen2's model reads it too; ``partial_rotary_factor`` and
``original_max_position_embeddings``: transformers' RoPE code reads them for every model type)."""

SILU = refused("the MLP's activation (SwiGLU: silu only)", "silu")
NO_ATTENTION_BIAS = refused(
    "biases on the q/k/v and output projections (the output projection's is not computed)", False
)
WINDOWS = "the windowed layers, with sliding_window"

LLAMA_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        **PRETRAINED_KEYS,
        **DECODER_KEYS,
        "hidden_act": SILU,
        "attention_bias": NO_ATTENTION_BIAS,
        "mlp_bias": refused("biases on the MLP's projections", False),
        "pretraining_tp": ignored(
            "Llama pretraining's tensor-parallel split of the projections, the same products (transformers no "
            "longer reads it)"
        ),
    }
)

MISTRAL_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        **PRETRAINED_KEYS,
        **DECODER_KEYS,
        "hidden_act": SILU,
        "sliding_window": applied("sliding_window of every layer (default 4096; null: none)"),
    }
)

QWEN2_SLIDING: Mapping[str, HFKey] = MappingProxyType(
    {
        "use_sliding_window": applied(f"whether any layer is windowed (default false): {WINDOWS}"),
        "sliding_window": applied("sliding_window where use_sliding_window (default 4096)"),
        "max_window_layers": applied(f"the first windowed layer, without layer_types (default 28): {WINDOWS}"),
        "layer_types": applied(f"sliding_layers: each layer sliding_attention or full_attention: {WINDOWS}"),
    }
)

QWEN2_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {**PRETRAINED_KEYS, **DECODER_KEYS, "hidden_act": SILU, **QWEN2_SLIDING}
)

QWEN3_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {**PRETRAINED_KEYS, **DECODER_KEYS, "hidden_act": SILU, "attention_bias": NO_ATTENTION_BIAS, **QWEN2_SLIDING}
)

GEMMA3_TEXT_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        **PRETRAINED_KEYS,
        **DECODER_KEYS,
        "hidden_activation": refused("the MLP's activation (GeGLU: gelu_pytorch_tanh only)", "gelu_pytorch_tanh"),
        "attention_bias": NO_ATTENTION_BIAS,
        "query_pre_attn_scalar": applied("query_scale: queries scaled by query_pre_attn_scalar ** -0.5"),
        "sliding_window": applied("sliding_window of the windowed layers (default 4096)"),
        "layer_types": applied(f"sliding_layers: each layer sliding_attention or full_attention: {WINDOWS}"),
        "sliding_window_pattern": applied(
            f"sliding_layers without layer_types: every n-th layer global, the others windowed (default 6): {WINDOWS}"
        ),
        "_sliding_window_pattern": applied(
            "a copy transformers writes and never reads (sliding_window_pattern is read): without layer_types, it "
            "must agree with the pattern used"
        ),
        "rope_local_base_freq": applied("local_theta: the windowed layers' RoPE base (transformers 4; default 10000)"),
        "final_logit_softcapping": refused("the logits soft-capped by tanh"),
        "attn_logit_softcapping": refused("the attention scores soft-capped by tanh"),
        "use_bidirectional_attention": refused("attention to later positions (EmbeddingGemma)", False),
    }
)

GEMMA3_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        **PRETRAINED_KEYS,
        "text_config": applied("the language model's config, read as a gemma3_text config.json"),
        "initializer_range": TRAINING,
        **rows(
            ("vision_config", "boi_token_index", "eoi_token_index", "image_token_index", "mm_tokens_per_image"), VISION
        ),
    }
)
"""Gemma3ForConditionalGeneration's outer config (its language model's is :data:`GEMMA3_TEXT_KEYS`)."""

HF_KEYS: Mapping[str, Mapping[str, HFKey]] = MappingProxyType(
    {
        "llama": LLAMA_KEYS,
        "mistral": MISTRAL_KEYS,
        "qwen2": QWEN2_KEYS,
        "qwen3": QWEN3_KEYS,
        "gemma3_text": GEMMA3_TEXT_KEYS,
        "gemma3": GEMMA3_KEYS,
    }
)
"""Each supported ``model_type`` -> its config.json keys -> how each is handled."""

FOREIGN_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        "sliding_window": refused("a sliding window, which this model type's transformers model does not apply"),
        "layer_types": refused("per-layer attention kinds, which this model type's transformers model does not read"),
        "attention_bias": refused("biases on the attention projections other than this model type's", False),
        "mlp_bias": refused("biases on the MLP's projections", False),
        "final_logit_softcapping": refused("the logits soft-capped by tanh"),
        "attn_logit_softcapping": refused("the attention scores soft-capped by tanh"),
        "use_bidirectional_attention": refused("attention to later positions", False),
        "attention_chunk_size": refused("chunked attention (Llama 4), which transformers' masks read for any model"),
    }
)
"""Keys that are not rows of a model type's table but turn on a computation elsewhere in transformers: refused
unless neutral wherever the model type's own table lacks them."""

ROPE_KEYS: Mapping[str, HFKey] = MappingProxyType(
    {
        "rope_type": applied("the RoPE kind (ROPE_TYPES): default, linear, llama3; others refused"),
        "type": applied("transformers 4's older name of rope_type"),
        "rope_theta": applied("theta (where the config also has a top-level rope_theta, the two must agree)"),
        "factor": applied("linear and llama3: the frequency divisor"),
        "low_freq_factor": applied("llama3: the low-frequency band's edge"),
        "high_freq_factor": applied("llama3: the high-frequency band's edge"),
        "original_max_position_embeddings": applied("llama3: the context the model was trained with before scaling"),
        "partial_rotary_factor": PARTIAL_ROTARY,
        **rows(
            (
                "attention_factor",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "short_factor",
                "long_factor",
                "truncate",
            ),
            ignored("read by the yarn, longrope and dynamic kinds only, which are refused"),
        ),
    }
)
"""The keys of a ``rope_scaling`` / ``rope_parameters`` object (transformers' ``RopeParameters``); others are read
by no RoPE kind and ignored, as transformers ignores them."""

ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
"""The RoPE kinds applied -> the keys of :data:`ROPE_KEYS` each reads beyond ``rope_theta``; transformers' others
(``dynamic``: frequencies that change with the sequence's length; ``yarn`` and ``longrope``: scaled cos / sin) are
refused."""
