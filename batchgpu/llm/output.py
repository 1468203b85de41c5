"""The output processor: one per request, outside the scheduler, it turns each token read back into a
:class:`Piece` of text (streaming detokenization through :class:`~batchgpu.llm.text.TextStream`) and
decides where the generation ends: the model's end-of-sequence token, a stop token id, a stop string
(its text left out) or ``max_tokens`` (as vLLM v1's output processor does beside its engine core); it
records each token's latency in the engine's :class:`~batchgpu.llm.metrics.EngineStats`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .metrics import EngineStats, clock
from .params import SamplingParams
from .text import TextCodec, TextStream


@dataclass
class Piece:
    """Part of a generation's output: new text and token ids, and on the last piece why it ended
    (``finish_reason``: ``"stop"``, ``"length"`` or ``"cancelled"``) and the token counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class OutputProcessor:
    """One request's output: :meth:`push` each token as it is read back, in order, until a piece comes
    back with its ``finish_reason``; text held back (an unfinished character, the possible start of a stop
    string) comes out on the last piece. ``queue`` takes the pieces (or the error that ends the request)
    on their way to its caller. Each token pushed counts in ``stats`` (the engine's; None: a private
    one) with its latency: the first since ``arrival`` (a :func:`~batchgpu.llm.metrics.clock` time; None:
    now), the others since the token before."""

    def __init__(
        self,
        codec: TextCodec,
        params: SamplingParams,
        prompt_tokens: int,
        stats: EngineStats | None = None,
        arrival: float | None = None,
    ) -> None:
        self.params = params
        self.stream = TextStream(codec, params.stop)
        self.eos_ids = frozenset() if params.ignore_eos else codec.eos_ids
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.queue: asyncio.Queue[Piece | BaseException] = asyncio.Queue()
        self.stats = stats if stats is not None else EngineStats()
        self.latest = arrival if arrival is not None else clock()  # the arrival, then the latest token

    def push(self, token: int) -> Piece:
        """The piece of ``token``: its new text, and whether (and why) the generation ends with it."""
        self.completion_tokens += 1
        self.record_latency()
        ends = token in self.eos_ids or token in self.params.stop_token_ids
        delta = self.stream.finish() if ends else self.stream.push(token)
        text, reason = delta.text, None
        if ends or delta.stopped:
            reason = "stop"
        elif self.completion_tokens >= self.params.max_tokens:
            tail = self.stream.finish()  # the text held back, up to a stop string it completes
            text += tail.text
            reason = "stop" if tail.stopped else "length"
        if reason is None:
            return Piece(text, [token])
        return Piece(text, [token], reason, self.prompt_tokens, self.completion_tokens)

    def record_latency(self) -> None:
        """Count the token just pushed in ``stats``: the first with the prompt and the time to it, the
        others with the time since the one before."""
        now = clock()
        if self.completion_tokens == 1:
            self.stats.first_token(self.prompt_tokens, now - self.latest)
        else:
            self.stats.next_token(now - self.latest)
        self.latest = now
