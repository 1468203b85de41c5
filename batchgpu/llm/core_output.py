"""A sequence's output inside the engine's core process (:mod:`~batchgpu.llm.core_process`): where the step
loop would hand a token to the request's :class:`~batchgpu.llm.output.OutputProcessor`, it decides only
what the core must know, whether the sequence ends (the model's end-of-sequence token or a stop token id,
``max_tokens``, its grammar's end or refusal), and puts the token ids, their logprobs and that end in the
:class:`Outbox`, which sends one message per step to the client's process. Text, stop strings, logprob
bytes, latencies and tool calls are the client's (vLLM v1 splits its engine core from its output processor
the same way); a stop string the client finds comes back as an abort."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..errors import BatchError
from .output import Piece, end_ids
from .params import SamplingParams
from .step import TokenLogprob

GRAMMAR_END = "grammar"
"""The end an item carries where the sequence's grammar ended it (the client's processor ends its text there)."""

Item = tuple[Any, ...]
"""What the outbox carries, in order: ``(request, index, token_ids, logprobs, end)`` (``end``: None, ``"stop"``,
``"length"`` or :data:`GRAMMAR_END`), ``(request, index, error)``, or ``(request, index, start, entries)``
(prompt logprobs after positions ``start``...)."""


class Outbox:
    """The items of the core's step loop on their way to the client: :meth:`put` each; those put in one turn
    of the event loop (a step's tokens) go in one message, with ``extra()`` (the core's counts)."""

    __slots__ = ("items", "send", "extra")

    def __init__(self, send: Callable[[Any], None], extra: Callable[[], Any]) -> None:
        self.items: list[Item] = []
        self.send, self.extra = send, extra

    def put(self, item: Item) -> None:
        if not self.items:
            asyncio.get_running_loop().call_soon(self.flush)
        self.items.append(item)

    def flush(self) -> None:
        """Send what was put (nothing where it was sent already)."""
        if self.items:
            items, self.items = self.items, []
            self.send(("out", items, self.extra()))


class CoreQueue:
    """Where the step loop puts the error that ends a sequence (``put_nowait``): onto the outbox."""

    __slots__ = ("outbox", "request", "index")

    def __init__(self, outbox: Outbox, request: int, index: int) -> None:
        self.outbox, self.request, self.index = outbox, request, index

    def put_nowait(self, item: Piece | BaseException) -> None:
        assert isinstance(item, BaseException), "the core's outputs hand over tokens through take()"
        self.outbox.put((self.request, self.index, item))


class CoreOutput:
    """Sample ``index`` of request ``request`` in the core: :meth:`take` the tokens read back, in order,
    until they end the sequence; they go to ``outbox`` with their logprobs and end. ``ends``: the model's
    end-of-sequence ids."""

    __slots__ = ("params", "ends", "guide", "tokens", "queue")

    def __init__(self, params: SamplingParams, ends: frozenset[int], outbox: Outbox, request: int, index: int,
                 guide: Any = None) -> None:  # fmt: skip
        self.params, self.guide, self.tokens = params, guide, 0
        self.ends = end_ids(params, ends)
        self.queue = CoreQueue(outbox, request, index)

    def take(
        self, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float, grammar_end: bool = False
    ) -> bool:
        """Put ``tokens`` (up to the one that ends the sequence) on the outbox with their logprobs and end;
        whether they ended it (an error the grammar raises goes after the tokens before)."""
        queue, end = self.queue, None
        for index, token in enumerate(tokens):
            try:
                end = self.end(token)
            except BatchError as exc:  # a token its grammar refuses: that request fails alone
                if index:
                    queue.outbox.put((queue.request, queue.index, tokens[:index], logprobs and logprobs[:index], None))
                queue.put_nowait(exc)
                return True
            if end is not None:
                tokens, logprobs = tokens[: index + 1], logprobs and logprobs[: index + 1]
                break
        queue.outbox.put((queue.request, queue.index, tokens, logprobs, end))
        return end is not None

    def end(self, token: int) -> str | None:
        """How ``token``, the next read back, ends the sequence (as the client's output processor decides, but
        for stop strings; :data:`GRAMMAR_END` where the grammar ends), or None; RequestError where the grammar
        refuses it."""
        if self.params.max_tokens == 0:  # the prompt alone: the client drops the token
            return "length"
        if self.guide is not None:
            self.guide.accept(token)
        self.tokens += 1
        if token in self.ends:
            return "stop"
        if self.guide is not None and self.guide.stopped:
            return GRAMMAR_END
        return "length" if self.tokens >= self.params.max_tokens else None

    def add_prompt_logprobs(self, prompt: list[int], entries: list[TokenLogprob], start: int) -> None:
        """Prompt logprobs of a mixed step's piece: to the client as they come."""
        self.queue.outbox.put((self.queue.request, self.queue.index, start, entries))
