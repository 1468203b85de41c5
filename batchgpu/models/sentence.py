"""A sentence-transformers model directory read as untrusted input: ``modules.json`` (the pipeline: a
Transformer, a Pooling, optionally a Normalize), the Pooling folder's ``config.json`` (mean or CLS pooling),
``sentence_bert_config.json`` (``max_seq_length``, ``do_lower_case``) and the tokenizer (``tokenizer.json``,
read by the ``tokenizers`` library). A pipeline with any other module (Dense, max pooling, ...) is refused
by name rather than run as a different model; every refusal is a :class:`~batchgpu.errors.ModelFileError`
naming the file and the field with expected vs actual."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import ModelFileError
from .fields import Fields
from .files import (
    describe,
    model_file,
    optional_file,
    parse_json,
    plain_file_name,
    read_bytes,
    read_json,
    read_text,
    roots,
)

MODULES_FILE = "modules.json"
SETTINGS_FILE = "sentence_bert_config.json"
TOKENIZER_FILE = "tokenizer.json"
MODULE_PREFIX = "sentence_transformers.models."
MAX_MODULES = 16
"""Entries ``modules.json`` may list (a served pipeline has three)."""


class Pooling(Enum):
    """How token vectors become one text vector (sentence-transformers' ``pooling_mode_*``)."""

    MEAN = "mean_tokens"
    CLS = "cls_token"


UNSERVED_POOLING = ("max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
"""``pooling_mode_*`` flags sentence-transformers has that are not computed here (each must be false)."""

PIPELINE = ("Transformer", "Pooling", "Normalize")
"""The modules served, in their order; Normalize is optional."""


@dataclass(frozen=True)
class SentenceModel:
    """What a sentence-transformers directory asks for beyond its encoder: the pooling, whether vectors
    are L2-normalized, the token limit (longer texts are truncated, as sentence-transformers does), whether
    texts are lower-cased first, and the tokenizer (``tokenizers.Tokenizer``, truncating at
    ``max_seq_length`` and not padding)."""

    pooling: Pooling
    normalize: bool
    max_seq_length: int
    lower_case: bool
    tokenizer: Any

    @classmethod
    def read(cls, directory: Path, hidden: int, positions: int, vocab: int) -> SentenceModel:
        """The directory's pipeline, for an encoder of ``hidden`` features, ``positions`` positions and a
        vocabulary of ``vocab`` rows."""
        modules = read_modules(directory)
        pooling = read_pooling(directory, modules["Pooling"], hidden)
        length, lower = read_settings(directory, positions)
        tokenizer = read_tokenizer(directory, length, vocab)
        return cls(pooling, "Normalize" in modules, length, lower, tokenizer)


def read_modules(directory: Path) -> dict[str, str]:
    """``modules.json``'s modules (short type name -> folder), checked to be the served pipeline:
    Transformer (the directory itself), Pooling, and optionally Normalize, in this order."""
    file = model_file(directory, MODULES_FILE, directory, "file")
    entries = parse_json(read_bytes(file), file)
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_MODULES:
        raise ModelFileError(f"{file}: must be an array of 1 to {MAX_MODULES} modules, got {describe(entries)}")
    modules: dict[str, str] = {}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ModelFileError(f"{file}: module [{index}] must be an object, got {describe(entry)}")
        fields = Fields(entry, file, f"[{index}].")
        kind = fields.text("type")
        if index >= len(PIPELINE) or kind != MODULE_PREFIX + PIPELINE[index]:
            served = ", ".join(MODULE_PREFIX + name for name in PIPELINE)
            raise fields.refuse("type", f"module {index} of the served pipeline {served} (Normalize optional)", kind)
        modules[PIPELINE[index]] = fields.text("path", "")
    if "Pooling" not in modules:
        raise ModelFileError(f"{file}: the pipeline has no {MODULE_PREFIX}Pooling module (a text vector needs one)")
    if modules["Transformer"] != "":
        got = describe(modules["Transformer"])
        raise ModelFileError(f'{file}: the Transformer\'s path must be "" (the directory itself), got {got}')
    return modules


def subfolder(directory: Path, name: Any, source: Path, field: str) -> Path:
    """The folder ``name`` of the model directory (a plain name whose real path lies inside it)."""
    if not plain_file_name(name):
        raise ModelFileError(f"{source}: {field} must be a plain folder name in {directory}, got {describe(name)}")
    real = (directory / name).resolve()
    if not any(real.is_relative_to(root) for root in roots(directory)):
        raise ModelFileError(f"{source}: {field} {name!r} resolves to {real}, outside the model directory")
    if not real.is_dir():
        raise ModelFileError(f"{source}: {field} {name!r} is not a folder in {directory}")
    return directory / name


def read_pooling(directory: Path, folder: str, hidden: int) -> Pooling:
    """The Pooling module's mode, from ``<folder>/config.json``: exactly one of mean and CLS pooling."""
    source = directory / MODULES_FILE
    place = subfolder(directory, folder, source, "the Pooling module's path")
    file = model_file(place, "config.json", place, "file")
    fields = Fields(read_json(file), file)
    width = fields.integer("word_embedding_dimension")
    if width != hidden:
        raise fields.refuse("word_embedding_dimension", f"{hidden} (the encoder's hidden_size)", width)
    for mode in UNSERVED_POOLING:
        if fields.flag(f"pooling_mode_{mode}", False):
            raise fields.refuse(f"pooling_mode_{mode}", "false (served: mean or CLS pooling)", True)
    if not fields.flag("include_prompt", True):
        raise fields.refuse("include_prompt", "true (no prompts are served)", False)
    chosen = [mode for mode in Pooling if fields.flag(f"pooling_mode_{mode.value}", False)]
    if len(chosen) != 1:
        names = " and ".join(f"pooling_mode_{mode.value}" for mode in Pooling)
        raise ModelFileError(f"{file}: exactly one of {names} must be true, got {len(chosen)}")
    return chosen[0]


def read_settings(directory: Path, positions: int) -> tuple[int, bool]:
    """``sentence_bert_config.json``'s ``max_seq_length`` (at most the encoder's ``positions``; default
    ``positions``) and ``do_lower_case`` (default false)."""
    file = optional_file(directory, SETTINGS_FILE)
    fields = Fields(read_json(file) if file is not None else {}, file or directory / SETTINGS_FILE)
    length = fields.integer("max_seq_length", positions, low=2, high=positions)
    return length, fields.flag("do_lower_case", False)


def read_tokenizer(directory: Path, max_length: int, vocab: int) -> Any:
    """The directory's ``tokenizer.json`` as a ``tokenizers`` Tokenizer that truncates at ``max_length``
    tokens (special tokens included, longest first, as sentence-transformers asks its tokenizer) and does
    not pad (the batches pad); its ids must all be rows of the model's ``vocab``, and it must encode a text
    within ``max_length`` (its special tokens fit)."""
    from tokenizers import Tokenizer

    file = model_file(directory, TOKENIZER_FILE, directory, "file")
    try:
        tokenizer = Tokenizer.from_str(read_text(file))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_length, strategy="longest_first")
        tokenizer.encode("a")
    except Exception as error:  # the tokenizers library raises plain Exceptions
        raise ModelFileError(f"{file}: not a tokenizer the tokenizers library reads: {error}") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab:
        raise ModelFileError(
            f"{file}: the tokenizer has {size} ids; the model's vocab_size must hold them, got {vocab}"
        )
    return tokenizer
