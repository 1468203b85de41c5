"""A ``tokenizers`` Tokenizer from the vocabulary a GGUF file carries (``tokenizer.ggml.*``): byte-level BPE
("gpt2": SmolLM2, Llama 3, Qwen) split the way its merges were learned (``tokenizer.ggml.pre``), or
SentencePiece ("llama": Llama 2, Mistral) as BPE with byte fallback, its merges recovered from the token
scores when the file has none (as transformers and llama.cpp read the same files)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import BatchError, ModelFileError
from .fields import INT32_MAX, Fields

CONTROL, USER_DEFINED = 3, 4
"""``tokenizer.ggml.token_type`` of control tokens (``<|im_start|>``) and user-defined ones (``<think>``)."""

GPT2_SPLIT = None  # the ByteLevel pre-tokenizer's own regex
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": GPT2_SPLIT,
    "gpt2": GPT2_SPLIT,
    "smollm": GPT2_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
"""``tokenizer.ggml.pre`` -> the regex that splits text before byte-level BPE (llama.cpp's names); a file
naming another is refused, since splitting differently gives other token ids."""


def gguf_tokenizer(fields: Fields) -> Any:
    """The tokenizer of a GGUF file's ``tokenizer.ggml.*`` metadata (``fields``: the file's metadata under
    that prefix), its control tokens special (kept whole, left out of decoded text) and user-defined ones
    whole. SentencePiece vocabularies get a BOS post-processor where the file asks for one
    (``tokenizer.ggml.add_bos_token``, default on). Every value is checked as it is read; a vocabulary the
    ``tokenizers`` library refuses is a ModelFileError too."""
    from tokenizers import AddedToken

    model = fields.text("model", "gpt2")
    tokens = fields.texts("tokens")
    builders = {"gpt2": _byte_level, "llama": _sentencepiece}
    if model not in builders:
        raise BatchError(
            f"{fields.source}: GGUF tokenizer model {model!r} is not supported; supported: {', '.join(builders)}"
        )
    tokenizer = _built(fields, "merges", lambda: builders[model](fields, tokens))
    types = _per_token(fields, fields.integers("token_type", np.zeros(0, np.int64), low=-INT32_MAX), tokens)
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, kind in enumerate(types) if kind == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, kind in enumerate(types) if kind == USER_DEFINED]
    )
    return tokenizer


def token_id(fields: Fields, key: str, tokens: list[str]) -> int | None:
    """The id ``key`` names (``bos_token_id``), a token of the vocabulary, or None where absent."""
    return fields.integer(key, None, low=0, high=len(tokens) - 1)


def _per_token(fields: Fields, values: Any, tokens: list[str], key: str = "token_type") -> Any:
    """``values`` where there is one per token (or none at all)."""
    if len(values) and len(values) != len(tokens):
        raise fields.refuse(key, f"an array of one value per token ({len(tokens)})", values)
    return values


def _built(fields: Fields, key: str, build: Callable[[], Any]) -> Any:
    """``build()``, a failure of the ``tokenizers`` library (which raises plain Exceptions) a ModelFileError."""
    try:
        return build()
    except BatchError:
        raise
    except Exception as error:  # the tokenizers library refuses the vocabulary
        raise ModelFileError(
            f"{fields.source}: {fields.name(key)}: the tokenizers library refuses it: {error}"
        ) from None


def _merges(fields: Fields) -> list[tuple[str, str]] | None:
    """The file's merges as pairs (None where it has none): each two tokens separated by a space."""
    merges = fields.texts("merges", None)
    if merges is None:
        return None
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    bad = next((merge for merge, pair in zip(merges, pairs) if len(pair) != 2 or not all(pair)), None)
    if bad is not None:
        raise fields.refuse("merges", "an array of two tokens separated by a space each", bad, f"{bad!r} among them")
    return pairs  # type: ignore[return-value]


def _byte_level(fields: Fields, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = fields.text("pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise BatchError(
            f"{fields.source}: GGUF tokenizer pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(PRE_TOKENIZER_SPLITS)}"
        )
    merges = _merges(fields) or []
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(fields: Fields, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = _merges(fields)
    if pairs is None:
        scores = _per_token(fields, fields.numbers("scores", np.zeros(len(tokens))), tokens, "scores")
        pairs = merges_from_scores(vocab, dict(zip(tokens, scores.tolist())))
    unk = token_id(fields, "unknown_token_id", tokens)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = fields.flag("add_space_prefix", True)
    # spaces become U+2581 and, as sentencepiece's dummy prefix, one goes in front even of a leading space
    # (the Metaspace pre-tokenizer skips it there)
    spaces = [normalizers.Replace(" ", "\u2581")]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), *spaces] if prefix else spaces)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    bos = token_id(fields, "bos_token_id", tokens)
    if bos is not None and fields.flag("add_bos_token", True):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
        )
    return tokenizer


def merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens, the
    splits of higher-scoring tokens first (ties: shorter left piece), as transformers' ``generate_merges``."""
    merges = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in pairs)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
