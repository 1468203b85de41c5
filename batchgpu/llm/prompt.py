"""A request's prompt into token ids: a text prompt, token ids, or chat messages through the model's chat
template, each checked (RequestError naming ``prompt`` or ``messages``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import RequestError
from .grammar import GrammarEngine, Guide, constraint
from .params import SamplingParams
from .text import TextCodec
from .tools import ToolCalling, ToolFormat, plain_history, tool_format, tool_messages

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


def prepare(
    codec: TextCodec, vocab: int, prompt: Prompt, trusted: bool, params: SamplingParams, grammars: GrammarEngine
) -> tuple[list[int], list[Guide] | None]:
    """A request's prompt ids (:func:`prompt_ids`, with its tools) and, where its output follows a grammar
    (:func:`~batchgpu.llm.grammar.constraint`), one guide per sample (None: free text). Safe to call from
    another thread."""
    return prompt_ids(codec, vocab, prompt, trusted, params.tools), request_guides(codec, params, grammars)


def request_guides(codec: TextCodec, params: SamplingParams, grammars: GrammarEngine) -> list[Guide] | None:
    """One guide per sample where the request's output follows a grammar
    (:func:`~batchgpu.llm.grammar.constraint`), else None. Safe to call from another thread."""
    output = constraint(params, codec.chat_template)
    return None if output is None else grammars.guides(grammars.compile(output), params.samples, output.param)


def prompt_ids(
    codec: TextCodec, vocab: int, prompt: Prompt, trusted: bool, tools: ToolCalling | None = None
) -> list[int]:
    """The prompt's token ids: a text prompt encoded whole, chat messages through
    :meth:`~batchgpu.llm.text.TextCodec.encode_chat` (``trusted`` as there; ``tools`` rendered as the
    chat template's tool format has them, :func:`~batchgpu.llm.tools.tool_messages`), token ids checked
    against ``vocab``. Safe to call from another thread."""
    items = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
    chat = bool(items) and all(isinstance(m, Mapping) for m in items or ())
    if tools is not None and not chat:
        raise RequestError("tools are served with chat messages only", "tools")
    if isinstance(prompt, str):
        return codec.encode(prompt)
    if chat and items:
        return chat_ids(codec, items, trusted, tools)
    if items is not None and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        bad = [t for t in items if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of [0, {vocab}): {bad[:5]}", "prompt")
        return [int(t) for t in items]
    raise RequestError(
        f"prompt must be a str, a list of token ids or a list of chat messages, got {type(prompt).__name__}",
        "prompt",
    )


def chat_ids(
    codec: TextCodec, messages: list[Mapping[str, Any]], trusted: bool, tools: ToolCalling | None
) -> list[int]:
    """Token ids of chat ``messages`` through the model's template, with ``tools`` where given (a template
    without a tool format of its own sees earlier calls as the generic format's JSON)."""
    form = tool_format(codec.chat_template)
    if form is ToolFormat.GENERIC:
        messages = plain_history(messages)
    if tools is None:
        return codec.encode_chat(messages, trusted=trusted)
    rendered, offered = tool_messages(messages, tools, form)
    return codec.encode_chat(rendered, trusted=trusted, tools=offered)
