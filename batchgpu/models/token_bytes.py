"""Each token's bytes: what a token id adds to the text its tokenizer decodes, as exact bytes (a token that
holds part of a UTF-8 character holds those bytes, where decoding it alone gives U+FFFD), derived from the
tokenizer's own decoder (a ``tokenizers`` Tokenizer's, read from its JSON form):

- ``ByteLevel`` (GPT-2's byte-level BPE: SmolLM2, Llama 3, Qwen): each character of a token stands for one
  byte (GPT-2's byte alphabet, :func:`byte_characters`); a token with a character outside that alphabet (an
  added token such as ``<think>`` can have one) is its own UTF-8, as the decoder takes it;
- SentencePiece as BPE with byte fallback (``Replace`` ``▁`` -> space, ``ByteFallback``, ``Fuse``, and for
  a dummy prefix ``Strip``: Llama 2, Gemma 3, the GGUF "llama" vocabularies): ``▁`` is a space and
  ``<0xXX>`` is byte XX; ``Strip(" ", n, 0)`` after ``Fuse`` drops up to n leading spaces of the whole
  text, so from its first tokens;
- ``Metaspace`` (Hugging Face's Llama 2 form): ``▁`` is a space, but a text's first token drops every
  ``▁`` (prepend scheme ``first`` or ``always``);
- no decoder: tokens joined by spaces, so each token but a text's first has a space before it;
- control (special) tokens add nothing (decoding leaves them out, as a reply's text does), nor do ids the
  tokenizer does not know (a model's padded vocabulary).

So decoding is the concatenation of the tokens' bytes, read as UTF-8 (U+FFFD for bytes that do not form
characters), once a text's first tokens are read as first (:class:`TokenReader` keeps that place). Other
decoders (WordPiece's joining and clean-up, BPEDecoder's suffix, CTC, regex replacements, steps in another
order) are not concatenations: their tokens' bytes are each token decoded alone, and :attr:`TokenBytes.exact`
is False. Where the bytes are not valid UTF-8 the decodings differ in their U+FFFD: a UTF-8 decoder (and the
byte-level decoder) writes one per maximal invalid or unfinished sequence, while byte fallback writes one per
byte of a run of byte pieces that is not valid as a whole, ASCII bytes in it included.

Every table is checked when built: for a text of multi-byte characters, random id sequences (control tokens
among them) and random sequences of tokens that are whole characters, the joined bytes decode to the
tokenizer's own decoding (exactly where they are valid UTF-8; else, byte fallback aside, with each run of
U+FFFD counted as one); a table that fails the check is replaced by the inexact one.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from typing import Any

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A SentencePiece byte piece (``ByteFallback`` decodes it to its byte)."""

CHECK_TEXT = "Hello wörld: 你好, ½ 😀 ▁x\n\t  end"
"""A text of multi-byte characters the table's check encodes and decodes (beside random id sequences)."""


@functools.cache
def byte_characters() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@functools.cache
def _character_bytes() -> dict[str, int]:
    return {character: byte for byte, character in enumerate(byte_characters())}


@dataclass(frozen=True)
class Decoding:
    """How a decoder makes text of tokens: ``steps`` on each token's string (``("replace", old, new)``,
    ``("strip", content, start, stop)``, ``("metaspace", replacement, first_drops)``, ``("bytes",)``: byte
    fallback pieces, ``("bytelevel",)``), ``separator`` before each token but a text's first, and ``strip``:
    up to ``count`` leading ``content`` characters dropped from the whole text."""

    steps: tuple[tuple[Any, ...], ...] = ()
    separator: bytes = b""
    strip: tuple[bytes, int] = (b"", 0)

    def value(self, token: str, first: bool) -> bytes:
        """The bytes of ``token`` (a token's string) as a text's first token or a later one (before the
        whole text's ``strip``)."""
        value: str | bytes = token
        for step in self.steps:
            kind = step[0]
            if isinstance(value, bytes):
                continue  # a byte piece: the steps after byte fallback are Fuse and Strip (plan)
            if kind == "replace":
                value = value.replace(step[1], step[2])
            elif kind == "metaspace":
                value = value.replace(step[1], "" if first and step[2] else " ")
            elif kind == "strip":
                value = _stripped(value, step[1], step[2], step[3])
            elif kind == "bytes":
                if BYTE_TOKEN.fullmatch(value):
                    value = bytes([int(value[3:5], 16)])
            else:  # bytelevel
                table = _character_bytes()
                if all(character in table for character in value):
                    value = bytes(table[character] for character in value)
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        return data if first else self.separator + data


def decoding(spec: dict[str, Any] | None) -> Decoding | None:
    """The :class:`Decoding` of a decoder's JSON form (None: no decoder), or None where decoding is not a
    concatenation of per-token bytes."""
    if spec is None:
        return Decoding(separator=b" ")
    steps: list[tuple[Any, ...]] = []
    strip: tuple[bytes, int] = (b"", 0)
    fused = bytewise = metaspace = False
    for step in (spec.get("decoders") or ()) if spec.get("type") == "Sequence" else (spec,):
        kind = step.get("type")
        if fused:  # the whole text: a leading strip is the only step that stays per token
            if kind == "Strip" and not step.get("stop") and not strip[1] and isinstance(step.get("content"), str):
                strip = (step["content"].encode("utf-8"), int(step.get("start", 0)))
            elif kind != "Fuse":
                return None
        elif kind == "Fuse":
            fused = True
        elif kind == "ByteLevel":
            steps.append(("bytelevel",))
            fused = bytewise = True
        elif kind == "ByteFallback":
            steps.append(("bytes",))
            bytewise = True
        elif bytewise:  # a string step after byte fallback sees its decoded runs, not single tokens
            return None
        elif kind == "Replace" and isinstance(step.get("pattern"), dict) and "String" in step["pattern"]:
            steps.append(("replace", step["pattern"]["String"], step.get("content", "")))
        elif kind == "Strip":
            steps.append(("strip", step.get("content", " "), int(step.get("start", 0)), int(step.get("stop", 0))))
        elif kind == "Metaspace" and not metaspace:
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            steps.append(("metaspace", step.get("replacement", "\u2581"), scheme != "never"))
            metaspace = True
        else:
            return None
    return Decoding(tuple(steps), strip=strip)


def _stripped(text: str, content: str, start: int, stop: int) -> str:
    """``text`` without up to ``start`` leading and ``stop`` trailing ``content`` characters (``Strip``)."""
    begin = 0
    while begin < min(start, len(text)) and text[begin] == content:
        begin += 1
    end = len(text)
    while len(text) - end < stop and end > begin and text[end - 1] == content:
        end -= 1
    return text[begin:end]


class TokenBytes:
    """The bytes of each token id of a ``tokenizers`` Tokenizer (see the module docstring), computed once per
    id as asked. ``exact``: decoding is the concatenation of these bytes (else each token's bytes are its
    text decoded alone); ``special``: the control tokens' texts by id (their bytes are empty)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()
        self.special = {int(i): token.content for i, token in added.items() if token.special}
        decoder = tokenizer.decoder
        self.decoding = decoding(json.loads(decoder.__getstate__()) if decoder is not None else None)
        self._later: dict[int, bytes] = {}
        self._first: dict[int, bytes] = {}
        self._skipped: dict[int, bool] = {}
        self._alone: dict[int, str] = {}
        self._later_text: dict[int, str | None] = {}
        self.exact = self.decoding is not None and self._check()
        if not self.exact:
            self.decoding = None
            self._later.clear()
            self._first.clear()

    def skipped(self, token: int) -> bool:
        """Whether decoding leaves ``token`` out: a control token, or an id the tokenizer does not know."""
        skipped = self._skipped.get(token)
        if skipped is None:
            known = 0 <= token < self.size and self.tokenizer.id_to_token(token) is not None
            skipped = self._skipped[token] = token in self.special or not known
        return skipped

    def later(self, token: int) -> bytes:
        """The bytes ``token`` adds after a text's first token (empty where decoding leaves it out)."""
        data = self._later.get(token)
        if data is None:
            data = self._later[token] = self._bytes(token, first=False)
        return data

    def later_text(self, token: int) -> str | None:
        """The text ``token`` adds after a text's first token where its bytes are whole UTF-8 characters
        (None where they are not: part of a character, or invalid)."""
        try:
            return self._later_text[token]
        except KeyError:
            data = self.later(token)
            text = self._later_text[token] = data.decode("utf-8") if _valid(data) else None
            return text

    def first(self, token: int) -> bytes:
        """The bytes ``token`` adds as a text's first token (before the text's leading strip)."""
        data = self._first.get(token)
        if data is None:
            data = self._first[token] = self._bytes(token, first=True)
        return data

    def _bytes(self, token: int, *, first: bool) -> bytes:
        if self.skipped(token):
            return b""
        if self.decoding is None:
            return self.tokenizer.decode([token], skip_special_tokens=True).encode("utf-8")
        return self.decoding.value(self.tokenizer.id_to_token(token), first)

    def reader(self) -> TokenReader:
        """A reader of one text's tokens, from its start."""
        return TokenReader(self)

    def text(self, ids: list[int]) -> list[bytes]:
        """The bytes each of ``ids`` adds to the text they make, from its start."""
        reader = self.reader()
        return [reader.take(token) for token in ids]

    def alone(self, token: int) -> str:
        """A token's own text: a control token's text, else its bytes as the text's only token, the bytes of
        an unfinished character written ``\\xNN`` (OpenAI's form)."""
        text = self._alone.get(token)
        if text is None:
            special = self.special.get(token)
            text = self._alone[token] = special if special is not None else shown(self.text([token])[0])
        return text

    def _check(self) -> bool:
        """Whether the table gives the tokenizer's decoding (see the module docstring)."""
        rng = random.Random(len(self.special) * 7919 + self.size)
        specials = list(self.special)
        sequences = [self.tokenizer.encode(CHECK_TEXT, add_special_tokens=False).ids]
        whole = [i for i in (rng.randrange(self.size) for _ in range(256)) if _valid(self.later(i))]
        for length in (1, 1, 2, 2, 3, 3, 4, 5, 6, 8, 8, 12, 16, 24):
            for pool in (range(self.size), whole):
                ids = [rng.choice(pool) for _ in range(length)] if pool else []
                if ids and specials and length > 2:
                    ids[rng.randrange(length)] = rng.choice(specials)
                sequences.append(ids)
        fallback = any(step[0] == "bytes" for step in self.decoding.steps) if self.decoding is not None else False
        for ids in sequences:
            decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
            data = b"".join(self.text(ids))
            if _valid(data):
                if data.decode("utf-8") != decoded:
                    return False
            elif not fallback and _one_replacement(data.decode("utf-8", "replace")) != _one_replacement(decoded):
                return False
        return True


def _valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _one_replacement(text: str) -> str:
    return re.sub("\ufffd+", "\ufffd", text)


class TokenReader:
    """One text's tokens read in order (a reply's output, a prompt): :meth:`place` gives the bytes a token
    adds at the next place of the text (a text's first token is read as first, and its leading strip taken
    from its first bytes), :meth:`take` reads it there."""

    __slots__ = ("table", "started", "strip")

    def __init__(self, table: TokenBytes) -> None:
        self.table = table
        self.started = False  # a token decoding keeps has been read
        self.strip = table.decoding.strip[1] if table.decoding is not None else 0  # leading characters to drop

    def place(self, token: int) -> bytes:
        """The bytes ``token`` would add at the next place."""
        return self._at(token)[0]

    def take(self, token: int) -> bytes:
        """The bytes ``token`` adds at the next place, which it then takes."""
        data, started, strip = self._at(token)
        self.started, self.strip = started, strip
        return data

    def _at(self, token: int) -> tuple[bytes, bool, int]:
        table = self.table
        if table.skipped(token):
            return b"", self.started, self.strip
        data = table.later(token) if self.started else table.first(token)
        strip = self.strip
        if strip:
            content = table.decoding.strip[0] if table.decoding is not None else b""
            while strip and content and data.startswith(content):
                data, strip = data[len(content) :], strip - 1
            if data:
                strip = 0  # the text has begun: nothing more is stripped
        return data, True, strip


def shown(data: bytes) -> str:
    """Bytes as text, each byte that is not part of a whole character written ``\\xNN`` (as OpenAI writes a
    token that holds part of a character)."""
    return data.decode("utf-8", "backslashreplace")
