"""A request's prompt into token ids: a text prompt, token ids, or chat messages through the model's chat
template, each checked (RequestError naming ``prompt`` or ``messages``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import RequestError
from .text import TextCodec

Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]
"""A text prompt, token ids, or chat messages (``[{"role": "user", "content": "..."}]``)."""

INLINE_PROMPT = 2048
"""Prompts up to this size (:func:`prompt_size`) are tokenized on the event loop (a millisecond or two);
larger ones on the engine's tokenizing thread."""


def prompt_size(prompt: Any) -> int:
    """The characters of a text prompt or of chat messages' strings, or the count of token ids."""
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        return 0
    strings = (v for m in prompt if isinstance(m, Mapping) for v in m.values() if isinstance(v, str))
    return len(prompt) + sum(len(s) for s in strings)


def prompt_ids(codec: TextCodec, vocab: int, prompt: Prompt, trusted: bool) -> list[int]:
    """The prompt's token ids: a text prompt encoded whole, chat messages through
    :meth:`~batchgpu.llm.text.TextCodec.encode_chat` (``trusted`` as there), token ids checked against
    ``vocab``. Safe to call from another thread."""
    if isinstance(prompt, str):
        return codec.encode(prompt)
    items = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
    if items and all(isinstance(m, Mapping) for m in items):
        return codec.encode_chat(items, trusted=trusted)
    if items is not None and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        bad = [t for t in items if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of [0, {vocab}): {bad[:5]}", "prompt")
        return [int(t) for t in items]
    raise RequestError(
        f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}",
        "prompt",
    )
