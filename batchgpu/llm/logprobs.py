"""OpenAI's logprobs objects from the engine's :class:`~batchgpu.llm.step.TokenLogprob` entries, each with the
bytes its token and its top ids add to the text at that place (a reply's output, or a prompt; the output
processor fills them in from the model's :class:`~batchgpu.models.token_bytes.TokenBytes`):

- chat (``content``: per token its ``token``, ``logprob``, ``bytes`` and ``top_logprobs``): ``bytes`` are the
  token's exact bytes in the reply (joined over the tokens, the content's UTF-8: a character split over
  tokens has its bytes split the same way), ``token`` those bytes as text, each byte that is not part of a
  whole character within the token written ``\\xNN`` (OpenAI's form: ``"\\xe4\\xbd"`` for a token holding
  the first two bytes of 你). The top ids likewise, at the same place.
- completions (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; an echoed prompt's first
  token has null logprob and top_logprobs): the shape has no bytes, so each token's string is the part of
  the choice's text it completes: the characters whose last byte it holds (a token that ends inside a
  character has ``""``; the one that completes it has the whole character; bytes that never form one are
  U+FFFD, on the text's last token where the text ends unfinished). So the tokens join to the text, and
  ``text_offset`` is each token's character offset in it (OpenAI's legacy ``"bytes:\\xe4\\xbd"`` strings do
  not join to the text). Each ``top_logprobs`` dict holds the top ids asked for, keyed by each one's string
  at that place (the most likely where two share one), and the token itself (vLLM's rule: up to
  ``logprobs`` + 1 entries).

Control tokens (an end of turn, a BOS) add nothing to decoded text, so they have ``""`` and no bytes; in the
echo of a text prompt that spells one (``<|im_start|>``), the token has that text, as the echoed prompt
does. Where the tokens do not join to the text: a stop string ends the text before it while the tokens that
hold it are listed (with their whole bytes), as is a stop token id that is not a control token; a tool
request's content is the text less its calls; an echoed text prompt is the prompt as given, which a
tokenizer's decoding need not give back (normalized or unknown characters, SentencePiece's space after a
control token); bytes that are not valid UTF-8 (a text cut inside a character, a model's invalid output) are
one U+FFFD per invalid sequence in the tokens' strings, where SentencePiece's byte fallback writes one per byte
of such a run of byte pieces in the text; a tokenizer whose decoding is not a concatenation of its tokens
(:attr:`~batchgpu.models.token_bytes.TokenBytes.exact`) has each token's text decoded alone."""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from typing import Any

from ..models.token_bytes import shown
from .step import TokenLogprob


class CompletionTokens:
    """The completions ``logprobs`` of one text read in order (a choice's output over the pieces of its
    stream, or an echoed prompt): ``offset``, the character of the choice's text where it starts; ``given``,
    an echoed text prompt as given (a control token that spells its text there shows it)."""

    def __init__(self, offset: int = 0, given: str | None = None) -> None:
        self.offset = offset
        self.pending = b""  # bytes of a character not finished yet
        self.given = given.encode("utf-8") if given is not None else None
        self.read = 0  # bytes of ``given`` the tokens so far spell

    def logprobs(self, entries: Sequence[TokenLogprob], texts: Mapping[int, str], *, end: bool) -> dict[str, Any]:
        """The logprobs object of the next ``entries`` (``texts``: the ids' own texts, for control tokens);
        ``end``: the text ends with them."""
        tokens, offsets, tops = [], [], []
        for index, entry in enumerate(entries):
            top = None
            if entry.logprob is not None:
                top = {}
                for (_, logprob), data in zip(entry.top, entry.top_bytes):
                    top.setdefault(completed(self.pending, data)[0], logprob)
            string = self._take(entry, texts)
            if end and index == len(entries) - 1 and self.pending:
                string += self.pending.decode("utf-8", "replace")
                self.pending = b""
            tokens.append(string)
            offsets.append(self.offset)
            self.offset += len(string)
            if top is not None:
                top.setdefault(string, entry.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _take(self, entry: TokenLogprob, texts: Mapping[int, str]) -> str:
        data = entry.token_bytes
        if not data and self.given is not None:  # a control token, which the echoed prompt may spell
            spelled = texts.get(entry.token, "").encode("utf-8")
            if spelled and self.given.startswith(spelled, self.read):
                data = spelled
        self.read += len(data)
        string, self.pending = completed(self.pending, data)
        return string


def completed(pending: bytes, data: bytes) -> tuple[str, bytes]:
    """The characters ``data`` completes after the unfinished ``pending`` bytes (U+FFFD for bytes that can
    form none), and the bytes then still unfinished."""
    if not pending and data.isascii():
        return data.decode("ascii"), b""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.setstate((pending, 0))
    text = decoder.decode(data)
    return text, decoder.getstate()[0]


def merge_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects one after the other (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``: ``top_logprobs`` are the most likely tokens asked for,
    most likely first."""
    return {
        "content": [
            {
                **_chat_token(entry.token_bytes, entry.logprob),
                "top_logprobs": [_chat_token(data, logprob) for (_, logprob), data in zip(entry.top, entry.top_bytes)],
            }
            for entry in entries
        ]
    }


def _chat_token(data: bytes, logprob: float | None) -> dict[str, Any]:
    return {"token": shown(data), "logprob": logprob, "bytes": list(data)}
