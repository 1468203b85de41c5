"""OpenAI's logprobs objects from the engine's :class:`~batchgpu.llm.step.TokenLogprob` entries: the legacy
completions shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``; an echoed prompt's
first token has null logprob and top_logprobs) and the chat shape (``content``: per token its text,
logprob, UTF-8 ``bytes`` and ``top_logprobs``). Token texts are each token id decoded alone."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .step import TokenLogprob


def completion_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str], offset: int = 0) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``entries``; ``text_offset`` counts characters of the choice's
    text from ``offset`` (where these tokens' text starts in it). Each ``top_logprobs`` dict holds the top
    ids asked for and the token itself (vLLM's rule: up to ``logprobs`` + 1 entries)."""
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(texts[entry.token])
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [_top_dict(entry, texts) for entry in entries],
        "text_offset": offsets,
    }


def merge_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects one after the other (an echoed prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str]) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``: ``top_logprobs`` are the most likely tokens asked for,
    most likely first."""
    return {
        "content": [
            {**_chat_token(texts[entry.token], entry.logprob), "top_logprobs": _top_list(entry, texts)}
            for entry in entries
        ]
    }


def _top_dict(entry: TokenLogprob, texts: Mapping[int, str]) -> dict[str, float] | None:
    if entry.logprob is None:
        return None
    top = {texts[token]: logprob for token, logprob in entry.top}
    top.setdefault(texts[entry.token], entry.logprob)
    return top


def _top_list(entry: TokenLogprob, texts: Mapping[int, str]) -> list[dict[str, Any]]:
    return [_chat_token(texts[token], logprob) for token, logprob in entry.top]


def _chat_token(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
