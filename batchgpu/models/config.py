"""The shape of a Llama-family decoder (Llama 1-3, SmolLM2, Mistral, Qwen2 / 2.5 / 3, Gemma 3) as one
dataclass, read from a GGUF file's metadata or a Hugging Face ``config.json``, and the RoPE frequency scalings
they use. Anything the decoder cannot compute (YaRN, partial rotary, logit soft-capping) is refused by name
rather than run with wrong numbers: every config.json key of a supported model type is applied, ignored with a
reason or refused unless neutral (:mod:`batchgpu.models.hf_keys`)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import BatchError, ModelFileError, UnsupportedError
from .fields import INT32_MAX, REQUIRED, Fields
from .files import describe
from .gguf_reader import GGUFFile
from .hf_keys import FOREIGN_KEYS, HF_KEYS, REFUSED, ROPE_KEYS, ROPE_TYPES, HFKey

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
"""GGUF ``general.architecture`` values this decoder runs: Llama (and the Llama-layout SmolLM2 and
Mistral), Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k RMS norms, an explicit head size) and Gemma 3
(sliding-window layers interleaved with global ones, post-norms, GeGLU)."""

GEMMA3_TEXT_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    }
)
"""transformers' ``Gemma3TextConfig`` defaults, for the keys a config.json leaves out (its RoPE bases:
:attr:`HFModelType.theta`, :attr:`HFModelType.local_theta`)."""
QWEN2_DEFAULTS: Mapping[str, Any] = MappingProxyType({"sliding_window": 4096, "max_window_layers": 28})
"""transformers' ``Qwen2Config`` / ``Qwen3Config`` defaults of the window (used where ``use_sliding_window``)."""

WINDOW_RULES = ("none", "every", "qwen2", "pattern")
"""How a model type's config.json says which layers are windowed (:func:`hf_sliding`): ``none`` (Llama: no window;
``sliding_window`` is refused), ``every`` (Mistral: every layer, where ``sliding_window`` is set), ``qwen2``
(``layer_types``, else the layers from ``max_window_layers`` on, where ``use_sliding_window``), ``pattern``
(Gemma 3: ``layer_types``, else every ``sliding_window_pattern``-th layer global)."""


@dataclass(frozen=True)
class HFModelType:
    """How a Hugging Face ``model_type`` maps onto this decoder: a row of :data:`HF_MODEL_TYPES`."""

    architecture: str
    """The GGUF architecture whose tensor names and conventions it shares."""
    keys: Mapping[str, HFKey]
    """Every key of its transformers config class, how each is handled (:data:`~batchgpu.models.hf_keys.HF_KEYS`)."""
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """transformers' config class defaults for keys a config.json may leave out (beyond :func:`read_sizes`' own)."""
    windows: str = "none"
    """Which layers are windowed: one of :data:`WINDOW_RULES`."""
    theta: float = 10000.0
    """transformers' RoPE base where the config gives none."""
    local_theta: float = 0.0
    """The windowed layers' RoPE base where the config gives none: they have a RoPE of their own, never scaled, from
    ``rope_local_base_freq`` or ``rope_parameters.sliding_attention`` (Gemma 3); 0: one RoPE for every layer."""
    query_scalar: bool = False
    """Queries are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma) rather than by ``head_dim ** -0.5``."""
    tied: bool = False
    """transformers' ``tie_word_embeddings`` default: whether the output head is the token embedding."""
    qkv_biases: bool = False
    """The q/k/v projections have biases (Qwen2); elsewhere a checkpoint's q/k/v biases are refused, as
    transformers' model of the type would not read them (``attention_bias`` true is refused: the output
    projection's bias is not computed)."""


HF_MODEL_TYPES = {
    "llama": HFModelType("llama", HF_KEYS["llama"]),
    "mistral": HFModelType("llama", HF_KEYS["mistral"], MappingProxyType({"sliding_window": 4096}), windows="every"),
    "qwen2": HFModelType("qwen2", HF_KEYS["qwen2"], QWEN2_DEFAULTS, windows="qwen2", qkv_biases=True),
    "qwen3": HFModelType("qwen3", HF_KEYS["qwen3"], QWEN2_DEFAULTS, windows="qwen2"),
    "gemma3_text": HFModelType(
        "gemma3",
        HF_KEYS["gemma3_text"],
        GEMMA3_TEXT_DEFAULTS,
        windows="pattern",
        theta=1_000_000.0,
        local_theta=10_000.0,
        query_scalar=True,
        tied=True,
    ),
}
"""Hugging Face ``model_type`` -> how it maps onto this decoder."""


@dataclass(frozen=True)
class HFLanguageModel:
    """A multimodal Hugging Face ``model_type`` whose language model runs on text: a row of
    :data:`HF_LANGUAGE_MODELS`."""

    key: str
    """The key of its language model's config."""
    model_type: str
    """That config's ``model_type`` (a row of :data:`HF_MODEL_TYPES`)."""
    keys: Mapping[str, HFKey]
    """Every key of its own config class, how each is handled."""
    tied: bool
    """transformers' ``tie_word_embeddings`` default of its own config (the one that ties its output head)."""


HF_LANGUAGE_MODELS = {"gemma3": HFLanguageModel("text_config", "gemma3_text", HF_KEYS["gemma3"], tied=True)}
"""Hugging Face ``model_type`` of a multimodal model -> how its language model is read: run on text alone
(Gemma3ForConditionalGeneration: its vision tower is not read)."""

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` entries this decoder computes: a layer attends through the window, or to all positions."""

PERMUTED_ARCHITECTURES = ("llama",)
"""Architectures whose q/k rows llama.cpp's converter permutes for interleaved RoPE (undone when a GGUF is
read: the kernels rotate halves, as transformers does); Qwen's are stored as they are, and Hugging Face
checkpoints never are."""


@dataclass(frozen=True)
class SlidingLayout:
    """Which layers of an architecture's GGUF files attend through the sliding window, and their RoPE:
    llama.cpp fixes these per architecture rather than reading them from the file."""

    global_every: int
    """Every ``global_every``-th layer (``layer % global_every == global_every - 1``) attends to all positions,
    the others through the window (llama.cpp's ``set_swa_pattern``)."""
    local_theta: float
    """The RoPE base of the windowed layers (``<arch>.rope.freq_base_swa`` where the file has it); they
    are never frequency-scaled (llama.cpp's ``rope_freq_scale_train_swa`` 1)."""
    wide_scale_layers: int = 0
    """A model of this many layers scales its queries by 1 / sqrt(hidden / heads) rather than 1 / sqrt(head
    size) (llama.cpp's Gemma 3 27B, whose ``query_pre_attn_scalar`` is hidden / heads; not in the file)."""


SLIDING_LAYOUTS = {"gemma3": SlidingLayout(global_every=6, local_theta=10000.0, wide_scale_layers=62)}
"""GGUF architecture -> its interleaving of windowed and global layers; an architecture not listed applies
a file's window (``attention.sliding_window``) to every layer (Mistral)."""

UNSUPPORTED_KEYS = ("final_logit_softcapping", "attn_logit_softcapping")
"""GGUF metadata keys (after ``<arch>.``) naming computations this decoder lacks: a file setting one is refused
(Gemma 2's logit soft-capping; Gemma 3 has none). A config.json's are rows of its model type's key table."""


@dataclass(frozen=True)
class LlamaConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    eps: float
    theta: float
    context: int = 0  # the trained context length (0: not in the file)
    architecture: str = "llama"  # the GGUF's general.architecture: its metadata keys' prefix
    head_size: int = 0  # the attention head size where the file gives one (0: hidden // heads)
    rope_factors: tuple[float, ...] | None = None  # per rotation pair, its frequency is divided by this
    sliding_window: int = 0  # a windowed layer's query sees its own and the previous window - 1 positions
    sliding_layers: tuple[bool, ...] = ()  # per layer, whether it is windowed (empty: all, where a window is set)
    local_theta: float = 0.0  # the RoPE base of windowed layers, which are not frequency-scaled (0: theta, scaled)
    query_scale: float = 0.0  # the attention scale (0: 1 / sqrt(head_dim))

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def permuted(self) -> bool:
        """Whether llama.cpp's converter permuted this architecture's q/k rows (for interleaved RoPE)."""
        return self.architecture in PERMUTED_ARCHITECTURES

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (positions a query sees, its own included; 0: all)."""
        if not self.sliding_window or (self.sliding_layers and not self.sliding_layers[layer]):
            return 0
        return self.sliding_window

    def rope(self, layer: int) -> dict[str, Any]:
        """The ``theta`` and ``factors`` keywords of ``rope`` / ``rope_kv_write`` for ``layer``: windowed
        layers of an architecture with a local RoPE base use it unscaled."""
        if self.local_theta and self.window(layer):
            return {"theta": self.local_theta, "factors": None}
        return {"theta": self.theta, "factors": self.rope_factors}

    @classmethod
    def from_gguf(cls, file: GGUFFile) -> LlamaConfig:
        """The config from a GGUF file's metadata (and its ``rope_freqs`` tensor, Llama 3)."""
        fields = file.fields()
        architecture = fields.text("general.architecture", "llama")
        if architecture not in ARCHITECTURES:
            raise BatchError(
                f"{file.source}: GGUF architecture {architecture!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        metadata = fields.under(f"{architecture}.")
        for key in UNSUPPORTED_KEYS:
            if metadata.has(key):
                raise BatchError(f"{file.source}: {metadata.name(key)} (logit soft-capping) is not supported")
        embedding = file.tensors.get("token_embd.weight")
        sizes = read_sizes(metadata, "gguf", {"vocab": embedding.shape[0] if embedding else REQUIRED})
        head_size = sizes["head_size"]
        for key in ("attention.value_length", "rope.dimension_count"):
            if metadata.integer(key, head_size) != head_size:
                raise BatchError(
                    f"{file.source}: {metadata.name(key)} other than the key length {head_size} "
                    "(partial rotary or unequal head sizes) is not supported"
                )
        scaling = metadata.text("rope.scaling.type", "none")
        if "rope_freqs.weight" in file.tensors:
            factors = gguf_rope_factors(file, head_size)
        elif scaling == "linear":
            factors = (metadata.number("rope.scaling.factor", positive=True),) * (head_size // 2)
        elif scaling == "none":
            factors = None
        else:
            raise BatchError(
                f"{file.source}: RoPE scaling {scaling!r} is not supported; "
                "supported: none, linear, Llama 3 (rope_freqs)"
            )
        return cls(
            **sizes,
            eps=metadata.number("attention.layer_norm_rms_epsilon", positive=True),
            theta=metadata.number("rope.freq_base", 10000.0, positive=True),
            architecture=architecture,
            rope_factors=factors,
            **gguf_sliding(metadata, architecture, sizes),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
        """The config from a Hugging Face ``config.json`` object read from ``source`` (transformers 4's
        ``rope_theta`` / ``rope_scaling`` or 5's ``rope_parameters``; a key it leaves out takes transformers'
        default for its ``model_type``; a multimodal model's language model, :data:`HF_LANGUAGE_MODELS`). Every
        key is handled as its model type's table says (:mod:`batchgpu.models.hf_keys`): a value that asks for
        what this decoder lacks is refused by name (:class:`~batchgpu.errors.UnsupportedError`), one of the
        wrong kind or out of range too (:class:`~batchgpu.errors.ModelFileError`)."""
        if not isinstance(config, Mapping):
            raise ModelFileError(f"{source}: must be a JSON object, got {describe(config)}")
        fields = language_model(Fields(config, source))
        model_type = fields.text("model_type")
        kind = HF_MODEL_TYPES[model_type]
        fields = Fields({**kind.defaults, **fields.values}, fields.source, fields.label)
        sizes = read_sizes(fields, "hf", {})
        hf_refuse_unsupported(fields, kind.keys, model_type)
        hf_tied(config, source)  # checked here; the loader holds the tensors to it
        return cls(
            **hf_sliding(fields, sizes, kind),
            **hf_rope(fields, sizes["head_size"], kind),
            eps=fields.number("rms_norm_eps", 1e-6, positive=True),
            architecture=kind.architecture,
            query_scale=attention_scale(fields.number("query_pre_attn_scalar", positive=True), sizes["head_size"])
            if kind.query_scalar
            else 0.0,
        )


def language_model(fields: Fields) -> Fields:
    """The fields of a config.json's language model: a multimodal model's (:data:`HF_LANGUAGE_MODELS`, its keys
    named ``text_config.<key>`` in messages; its own keys checked against its table), else the config's own.
    BatchError where the model type is none of :data:`HF_MODEL_TYPES` and :data:`HF_LANGUAGE_MODELS`."""
    model_type = fields.text("model_type")
    if model_type in HF_MODEL_TYPES:
        return fields
    if model_type not in HF_LANGUAGE_MODELS:
        raise BatchError(
            f"{fields.source}: Hugging Face model_type {model_type!r} is not supported; "
            f"supported: {', '.join([*HF_MODEL_TYPES, *HF_LANGUAGE_MODELS])}"
        )
    wrapper = HF_LANGUAGE_MODELS[model_type]
    inner = fields.mapping(wrapper.key)
    if inner is None:
        raise ModelFileError(f"{fields.source}: {wrapper.key} (the language model's config) is missing")
    if inner.text("model_type", wrapper.model_type) != wrapper.model_type:
        raise inner.refuse("model_type", repr(wrapper.model_type), inner.get("model_type"))
    hf_refuse_unsupported(fields, wrapper.keys, model_type, foreign=False)
    return Fields({**inner.values, "model_type": wrapper.model_type}, inner.source, inner.label)


def hf_model_type(config: Mapping[str, Any]) -> HFModelType:
    """The row of :data:`HF_MODEL_TYPES` of a config.json that :meth:`LlamaConfig.from_hf` read (a multimodal
    model's language model's)."""
    model_type = config["model_type"]
    return HF_MODEL_TYPES[HF_LANGUAGE_MODELS[model_type].model_type if model_type in HF_LANGUAGE_MODELS else model_type]


def hf_tied(config: Mapping[str, Any], source: str = "config.json") -> bool:
    """Whether the output head of a config.json's model (read by :meth:`LlamaConfig.from_hf`) is its token
    embedding: ``tie_word_embeddings``, else its model type's default (a multimodal model's own)."""
    fields = Fields(config, source)
    model_type = fields.text("model_type")
    wrapper = HF_LANGUAGE_MODELS.get(model_type)
    return fields.flag("tie_word_embeddings", wrapper.tied if wrapper else HF_MODEL_TYPES[model_type].tied)


def json_kind(value: Any) -> str:
    """The JSON kind of a value read from a JSON file (a bool is no number)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array"}.get(type(value), "object" if isinstance(value, Mapping) else "null")


def json_text(value: Any) -> str:
    """A neutral value as messages say it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or any(json_kind(value) == json_kind(n) and value == n for n in neutral)


def hf_refuse_unsupported(fields: Fields, keys: Mapping[str, HFKey], model_type: str, foreign: bool = True) -> None:
    """Refuse each key of ``fields`` whose row in ``keys`` (its model type's table; else, where ``foreign``,
    :data:`FOREIGN_KEYS`) is refused unless neutral and whose value is not: ModelFileError where the value is of
    another JSON kind than the neutral ones, else UnsupportedError naming the key, its value, what it turns on and
    what is supported. A multimodal model's own config is checked without the foreign keys: its language model's
    settings are its language model config's (transformers reads nothing else of them)."""
    for key, value in fields.values.items():
        row = keys[key] if key in keys else FOREIGN_KEYS.get(key) if foreign else None
        if row is None or row.handling != REFUSED or is_neutral(value, row.neutral):
            continue
        supported = " or ".join(json_text(n) for n in row.neutral) or "null"
        if row.neutral and json_kind(value) not in {json_kind(n) for n in row.neutral}:
            raise fields.refuse(key, supported, value)
        shown = repr(value)
        shown = shown[:60] + "..." if len(shown) > 60 else shown
        raise UnsupportedError(
            f"{fields.source}: {model_type} model: {fields.name(key)} {shown} is not supported ({row.note}; "
            f"{supported} only)"
        )


def attention_scale(query_pre_attn_scalar: float, head_size: int) -> float:
    """The ``query_scale`` of queries scaled by ``query_pre_attn_scalar ** -0.5`` (transformers' Gemma): 0 (the
    attention's own 1 / sqrt(head size)) where that is the head size."""
    return 0.0 if query_pre_attn_scalar == head_size else query_pre_attn_scalar**-0.5


@dataclass(frozen=True)
class Size:
    """One integer of the config: its key in GGUF metadata (after ``<architecture>.``) and in config.json,
    and its range."""

    gguf: str
    hf: str
    low: int
    high: int


SIZES = {
    "hidden": Size("embedding_length", "hidden_size", 1, 1 << 17),
    "heads": Size("attention.head_count", "num_attention_heads", 1, 1 << 10),
    "kv_heads": Size("attention.head_count_kv", "num_key_value_heads", 1, 1 << 10),
    "head_size": Size("attention.key_length", "head_dim", 2, 1 << 12),
    "layers": Size("block_count", "num_hidden_layers", 1, 1 << 10),
    "ffn": Size("feed_forward_length", "intermediate_size", 1, 1 << 20),
    "vocab": Size("vocab_size", "vocab_size", 1, 1 << 23),
    "context": Size("context_length", "max_position_embeddings", 0, INT32_MAX),
    "sliding_window": Size("attention.sliding_window", "sliding_window", 0, INT32_MAX),
}
"""The config's integers, read by :func:`read_sizes` from either file. The upper bounds are several times
those of any released model (Llama 3.1 405B: 126 layers, 16384 wide, 128 heads, an FFN of 53248;
vocabularies to 262144): they keep what is computed from a config before its tensors are checked against
it small (RoPE factors, the tensor name map, the table of expected shapes). The tensors, which must have
the shapes the config implies and lie inside their file, bound everything else."""


def read_sizes(fields: Fields, source: str, defaults: Mapping[str, Any]) -> dict[str, int]:
    """The :data:`SIZES` values from ``fields`` by their ``source`` (``"gguf"`` / ``"hf"``) keys, with
    ``defaults`` where absent (besides: kv heads = heads, head size = hidden / heads, no context length,
    no window); ModelFileError naming the key where one is out of range or they do not fit together."""

    def key(name: str) -> str:
        return getattr(SIZES[name], source)

    def read(name: str, default: Any = REQUIRED) -> int:
        return fields.integer(key(name), default, low=SIZES[name].low, high=SIZES[name].high)

    hidden, heads = read("hidden"), read("heads")
    if not fields.has(key("head_size")) and hidden % (2 * heads):
        raise fields.refuse(
            key("hidden"),
            f"a multiple of 2 x {fields.name(key('heads'))} {heads} (no {key('head_size')} given)",
            hidden,
        )
    implied = {"kv_heads": heads, "head_size": hidden // heads, "context": 0, "sliding_window": 0, **defaults}
    sizes = {"hidden": hidden, "heads": heads}
    sizes.update({name: read(name, implied.get(name, REQUIRED)) for name in SIZES if name not in sizes})
    if heads % sizes["kv_heads"]:
        raise fields.refuse(key("kv_heads"), f"a divisor of {fields.name(key('heads'))} {heads}", sizes["kv_heads"])
    if sizes["head_size"] % 2:
        raise fields.refuse(key("head_size"), "even (RoPE rotates pairs)", sizes["head_size"])
    return sizes


def gguf_sliding(metadata: Fields, architecture: str, sizes: dict[str, int]) -> dict[str, Any]:
    """The sliding-window fields of a GGUF config beyond the window itself: the windowed layers, their RoPE
    base (:data:`SLIDING_LAYOUTS`) and the attention scale, as llama.cpp reads them (its converter leaves
    ``query_pre_attn_scalar`` out: hidden / heads in the 27B model, else the head size)."""
    layout = SLIDING_LAYOUTS.get(architecture)
    if layout is None:
        return {}
    if not sizes["sliding_window"]:
        metadata.integer("attention.sliding_window", low=1)  # missing or 0: refused by name (llama.cpp needs it)
    every = layout.global_every
    wide = sizes["layers"] == layout.wide_scale_layers
    return dict(
        sliding_layers=tuple(layer % every < every - 1 for layer in range(sizes["layers"])),
        local_theta=metadata.number("rope.freq_base_swa", layout.local_theta, positive=True),
        query_scale=attention_scale(sizes["hidden"] // sizes["heads"], sizes["head_size"]) if wide else 0.0,
    )


def hf_sliding(fields: Fields, sizes: dict[str, int], kind: HFModelType) -> dict[str, Any]:
    """``sizes`` with the sliding-window fields of a ``config.json``, by the model type's rule
    (:attr:`HFModelType.windows`, as transformers reads it): the windowed layers from ``layer_types`` (each one of
    :data:`LAYER_TYPES`), else Gemma 3's ``sliding_window_pattern`` or Qwen2's ``use_sliding_window`` and
    ``max_window_layers``; every layer for Mistral; none for Llama (a window it carries is refused). Where Qwen2's
    ``layer_types`` names windowed layers and ``use_sliding_window`` is absent (transformers fails on it), the
    layer types are applied. A model with windowed layers must have a window of 1 or more."""
    if kind.windows == "none":
        return dict(sizes, sliding_window=0)
    if kind.windows == "every":
        return sizes
    layers = sizes["layers"]
    layer_types = hf_layer_types(fields, layers)
    if kind.windows == "pattern":
        every = fields.integer("sliding_window_pattern", low=1, high=SIZES["layers"].high)
        if layer_types is None and fields.has("_sliding_window_pattern"):
            copy = fields.integer("_sliding_window_pattern", low=1, high=SIZES["layers"].high)
            if copy != every:
                raise fields.refuse(
                    "_sliding_window_pattern",
                    f"sliding_window_pattern {every} where there are no layer_types (transformers reads that one)",
                    copy,
                )
        windowed = layer_types or tuple((layer + 1) % every != 0 for layer in range(layers))  # transformers' rule
    else:
        use = fields.flag("use_sliding_window", False)
        if layer_types is None:
            first = fields.integer("max_window_layers", low=0, high=SIZES["layers"].high)
            windowed = tuple(use and bool(sizes["sliding_window"]) and layer >= first for layer in range(layers))
        elif not use and fields.has("use_sliding_window") and any(layer_types):
            raise fields.refuse("use_sliding_window", "true where layer_types names windowed layers", False)
        else:
            windowed = layer_types
    if not any(windowed):
        return dict(sizes, sliding_layers=windowed, sliding_window=0)
    if not sizes["sliding_window"]:
        fields.integer("sliding_window", low=1)  # missing or 0: refused by name
    return dict(sizes, sliding_layers=windowed)


def hf_layer_types(fields: Fields, layers: int) -> tuple[bool, ...] | None:
    """Per layer whether ``layer_types`` windows it (None where absent); each entry one of :data:`LAYER_TYPES`."""
    layer_types = fields.texts("layer_types", None)
    if layer_types is None:
        return None
    if len(layer_types) != layers:
        raise fields.refuse("layer_types", f"an array of one type per layer ({layers})", layer_types)
    for layer, value in enumerate(layer_types):
        if value not in LAYER_TYPES:
            raise fields.refuse(f"layer_types[{layer}]", f"one of {', '.join(LAYER_TYPES)}", value)
    return tuple(value == "sliding_attention" for value in layer_types)


def hf_rope(fields: Fields, head_size: int, kind: HFModelType) -> dict[str, Any]:
    """``theta``, ``rope_factors`` and ``local_theta`` of a ``config.json``: transformers 4's ``rope_theta`` and
    ``rope_scaling`` (and Gemma 3's ``rope_local_base_freq`` for the windowed layers), or 5's
    ``rope_parameters``, keyed by layer type where the windowed layers have a RoPE of their own
    (:attr:`HFModelType.local_theta`; elsewhere refused, as transformers cannot run it). One config gives one of
    ``rope_scaling`` and ``rope_parameters``; a base given both inside them and at the top level must agree
    (transformers 4 reads the top level, 5 the inside). Windowed layers with a base of their own are never
    frequency-scaled (as the decoder computes them)."""
    scaling, parameters = fields.mapping("rope_scaling"), fields.mapping("rope_parameters")
    if scaling is not None and parameters is not None:
        raise fields.refuse(
            "rope_scaling",
            "absent where rope_parameters is given (transformers 4 writes one, 5 the other)",
            None,
            "an object beside rope_parameters",
        )
    by_type = parameters is not None and any(parameters.has(layer_type) for layer_type in LAYER_TYPES)
    if by_type and not kind.local_theta:
        raise UnsupportedError(
            f"{fields.source}: {fields.get('model_type')} model: {fields.name('rope_parameters')} by layer type is "
            "not supported (one RoPE for every layer in this model type)"
        )
    if by_type:
        full = parameters.mapping("full_attention") or Fields({}, fields.source, parameters.name("full_attention."))
        local = parameters.mapping("sliding_attention")
    else:
        full = parameters or scaling or Fields({}, fields.source, fields.name("rope_scaling."))
        local = None
    theta = rope_base(full, fields, "rope_theta", kind.theta)
    rope = dict(theta=theta, rope_factors=hf_rope_factors(full, head_size, theta, fields))
    if kind.local_theta:
        local = local or Fields({}, fields.source, fields.name("rope_parameters.sliding_attention."))
        hf_refuse_unsupported(local, ROPE_KEYS, fields.get("model_type"), foreign=False)
        local_kind = local.text("rope_type", local.text("type", "default"))
        if local_kind != "default":
            raise UnsupportedError(
                f"{fields.source}: {local.name('rope_type')} {local_kind!r} is not supported (the windowed layers' "
                "RoPE is never scaled; supported: default)"
            )
        rope["local_theta"] = rope_base(local, fields, "rope_local_base_freq", kind.local_theta)
    return rope


def rope_base(rope: Fields, fields: Fields, key: str, default: float) -> float:
    """A RoPE base: ``rope_theta`` of the RoPE parameters ``rope``, else ``fields``' top-level ``key``, else
    ``default``; where both are given they must agree."""
    outer = fields.number(key, positive=True) if fields.has(key) else None
    inner = rope.number("rope_theta", positive=True) if rope.has("rope_theta") else None
    if outer is not None and inner is not None and outer != inner:
        raise rope.refuse(
            "rope_theta", f"{fields.name(key)} {outer:g} where both are given (transformers 4 reads that one)", inner
        )
    return next((base for base in (inner, outer) if base is not None), default)


def gguf_rope_factors(file: GGUFFile, head_size: int) -> tuple[float, ...]:
    """Llama 3's ``rope_freqs`` tensor: float32, one finite positive divisor per rotation pair."""
    tensor = file.tensors["rope_freqs.weight"]
    if tensor.kind != "F32" or tensor.shape != (head_size // 2,):
        raise ModelFileError(
            f"{file.source}: tensor 'rope_freqs.weight' must be F32 of shape ({head_size // 2},) (a factor per "
            f"rotation pair), got {tensor.kind} of shape {tensor.shape}"
        )
    factors = file.data(tensor).view("<f4").astype(np.float64)
    if not (np.isfinite(factors) & (factors > 0)).all():
        raise ModelFileError(f"{file.source}: tensor 'rope_freqs.weight' must hold finite factors above 0")
    return tuple(factors.tolist())


def hf_rope_factors(rope: Fields, head_dim: int, theta: float, fields: Fields) -> tuple[float, ...] | None:
    """Per-pair frequency divisors for a transformers RoPE config ``rope`` (:data:`ROPE_TYPES`): None (default),
    the factor everywhere (linear), or Llama 3's band-wise factors (as llama.cpp's converter writes
    ``rope_freqs``; the original context from ``fields``' top level where given, as transformers 5 reads it)."""
    hf_refuse_unsupported(rope, ROPE_KEYS, fields.get("model_type"), foreign=False)
    key = "rope_type" if rope.has("rope_type") else "type"
    kind = rope.text(key, "default")
    if kind not in ROPE_TYPES:
        raise UnsupportedError(
            f"{rope.source}: {rope.name(key)} {kind!r}: RoPE scaling {kind!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if kind == "default":
        return None
    if kind == "linear":
        return (rope.number("factor", positive=True),) * (head_dim // 2)
    low = rope.number("low_freq_factor", positive=True)
    high = rope.number("high_freq_factor", positive=True)
    if high <= low:
        raise rope.refuse("high_freq_factor", f"above low_freq_factor {low}", high)
    original = rope.integer("original_max_position_embeddings", None, low=1)
    outer = fields.integer("original_max_position_embeddings", None, low=1)
    if original is not None and outer is not None and original != outer:
        raise rope.refuse(
            "original_max_position_embeddings",
            f"the top-level original_max_position_embeddings {outer} where both are given (transformers 5 reads that "
            "one)",
            original,
        )
    return llama3_rope_factors(
        head_dim,
        theta,
        factor=rope.number("factor", positive=True),
        low=low,
        high=high,
        original_context=outer or rope.integer("original_max_position_embeddings", low=1),
    )


def llama3_rope_factors(
    head_dim: int, theta: float, *, factor: float, low: float, high: float, original_context: int
) -> tuple[float, ...]:
    """Llama 3.1's RoPE scaling as frequency divisors: 1 for wavelengths under ``original_context /
    high``, ``factor`` past ``original_context / low``, a smooth blend between (transformers'
    ``_compute_llama3_parameters``)."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original_context / high:
            factors.append(1.0)
        elif wavelength > original_context / low:
            factors.append(factor)
        else:
            smooth = (original_context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
