"""The output processor: one per request, outside the scheduler, it turns each token read back into a
:class:`Piece` of text (streaming detokenization through :class:`~batchgpu.llm.text.TextStream`) and
decides where the generation ends: the model's end-of-sequence token, a stop token id, a stop string
(its text left out) or ``max_tokens`` (as vLLM v1's output processor does beside its engine core); it
records each token's latency in the engine's :class:`~batchgpu.llm.metrics.EngineStats`."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .metrics import EngineStats, clock
from .params import SamplingParams
from .scheduler import Chunk, Sequence
from .step import ChunkLogprobs, TokenLogprob
from .text import TextCodec, TextStream
from .tools import ToolCall, parse_tool_calls, tool_format


@dataclass(slots=True)
class Piece:
    """Part of a generation's output: new text and token ids, and on the last piece why it ended
    (``finish_reason``: ``"stop"``, ``"length"`` or ``"cancelled"``) and the token counts. Where the
    request asked (``SamplingParams.logprobs``), ``logprobs`` has one entry per token of ``token_ids``; the
    first piece carries ``prompt_logprobs`` where asked: one per prompt token, the first with logprob None.
    ``index``: which of the request's ``n`` samples (choices) it belongs to. A request with ``tools`` gets
    its text whole on the last piece: the message's content (None where it is only calls) and the
    ``tool_calls`` parsed from it, with ``finish_reason`` ``"tool_calls"`` where there are any."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    token_texts: dict[int, str] | None = None
    index: int = 0
    tool_calls: list[ToolCall] | None = None


class PieceQueue:
    """The pieces (or the error that ends them) of one request on their way from the step loop to its one
    reader: ``asyncio.Queue``'s ``put_nowait`` and ``get`` for a queue that is never full and read by one
    task, without its bookkeeping (the step loop puts a piece per sequence per step)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Piece | BaseException] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Piece | BaseException) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Piece | BaseException:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


def joined(pieces: list[Piece]) -> Piece:
    """The pieces of one generation as one: their text, ids and logprobs in order, the first's prompt
    logprobs, the last's end and counts."""
    last, logprobs = pieces[-1], [entry for piece in pieces for entry in piece.logprobs or ()]
    texts = {i: text for piece in pieces for i, text in (piece.token_texts or {}).items()}
    return Piece(
        "".join(piece.text for piece in pieces), [i for piece in pieces for i in piece.token_ids],
        last.finish_reason, last.prompt_tokens, last.completion_tokens, logprobs or None,
        pieces[0].prompt_logprobs, texts or None, last.index, last.tool_calls,
    )  # fmt: skip


def choices(pieces: list[Piece]) -> list[Piece]:
    """The pieces of a request's samples (interleaved, each with its ``index``) as one joined piece per
    sample, in index order."""
    indices = sorted({piece.index for piece in pieces})
    return [joined([piece for piece in pieces if piece.index == index]) for index in indices]


def cumulative_logprob(piece: Piece) -> float:
    """The sum of the logprobs of a generation's tokens (its ``logprobs``, which it must have)."""
    assert piece.logprobs is not None, "cumulative_logprob needs the tokens' logprobs"
    return sum(entry.logprob for entry in piece.logprobs if entry.logprob is not None)


class OutputProcessor:
    """One request's output: :meth:`push` each token as it is read back, in order, until a piece comes
    back with its ``finish_reason``; text held back (an unfinished character, the possible start of a stop
    string) comes out on the last piece. ``queue`` takes the pieces (or the error that ends the request)
    on their way to its caller (``queue``: one that the request's other samples share; their pieces carry
    their ``index``). Each token pushed counts in ``stats`` (the engine's; None: a private
    one) with its latency: the first since ``arrival`` (a :func:`~batchgpu.llm.metrics.clock` time; None:
    now), the others since the token before."""

    def __init__(
        self,
        codec: TextCodec,
        params: SamplingParams,
        prompt_tokens: int,
        stats: EngineStats | None = None,
        arrival: float | None = None,
        queue: PieceQueue | None = None,
        index: int = 0,
        guide: Any = None,
    ) -> None:
        self.params = params
        self.codec = codec
        self.stream = TextStream(codec, params.stop)
        self.ends = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else codec.eos_ids)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.queue = queue if queue is not None else PieceQueue()
        self.index = index
        self.stats = stats if stats is not None else EngineStats()
        self.latest = arrival if arrival is not None else clock()  # the arrival, then the latest token
        self.prompt_logprobs: list[TokenLogprob] | None = None  # gathered over the prompt's pieces
        self.guide = guide  # a structured output's grammar state (batchgpu.llm.grammar.Guide): takes each token
        self.held: list[str] | None = [] if params.tools is not None else None  # a tool request's text, until its end

    def add_prompt_logprobs(self, prompt: list[int], entries: list[TokenLogprob], start: int) -> None:
        """The logprobs of the prompt tokens after positions ``start``, ``start + 1``, ... (a mixed step's
        piece; pieces come in order, and a preempted sequence's prompt runs again from 0, replacing what its
        first run gave); the first token of ``prompt`` opens the list with logprob None."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [TokenLogprob(prompt[0], None)]
        del self.prompt_logprobs[start + 1 :]
        self.prompt_logprobs += entries

    def push(self, token: int, logprob: TokenLogprob | None = None, now: float | None = None) -> Piece:
        """The piece of ``token`` (with its ``logprob`` where the request asked), read back at ``now`` (a
        :func:`~batchgpu.llm.metrics.clock` time; None: now): its new text, and whether (and why) the
        generation ends with it. RequestError where the request's grammar refuses the token."""
        if self.guide is not None:
            self.guide.accept(token)
        piece = self._piece(token, clock() if now is None else now)
        if self.held is not None:
            self.hold(piece)
        if logprob is None and (self.prompt_logprobs is None or self.completion_tokens != 1):
            return piece  # nothing asked: no logprobs, no token texts
        if logprob is not None:
            piece.logprobs = [logprob]
        if self.completion_tokens == 1:
            piece.prompt_logprobs = self.prompt_logprobs
        entries = [*(piece.logprobs or ()), *(piece.prompt_logprobs or ())]
        if entries:
            ids = {i for entry in entries for i in (entry.token, *(t for t, _ in entry.top))}
            piece.token_texts = {i: self.codec.decode([i]) for i in ids}
        return piece

    def hold(self, piece: Piece) -> None:
        """A tool request's piece: its text held until the last piece, which gets the content and calls."""
        assert self.held is not None and self.params.tools is not None
        self.held.append(piece.text)
        piece.text = ""
        if piece.finish_reason is not None:
            content, calls = parse_tool_calls("".join(self.held), tool_format(self.codec.chat_template))
            piece.text, piece.tool_calls = content or "", calls or None
            if calls:
                piece.finish_reason = "tool_calls"

    def _piece(self, token: int, now: float) -> Piece:
        self.completion_tokens += 1
        self.record_latency(now)
        ends = token in self.ends
        delta = self.stream.finish() if ends else self.stream.push(token)
        text, reason = delta.text, None
        if ends or delta.stopped:
            reason = "stop"
        elif self.guide is not None and self.guide.stopped:  # the grammar ended: nothing may follow
            text += self.stream.finish().text
            reason = "stop"
        elif self.completion_tokens >= self.params.max_tokens:
            tail = self.stream.finish()  # the text held back, up to a stop string it completes
            text += tail.text
            reason = "stop" if tail.stopped else "length"
        if reason is None:
            return Piece(text, [token], None, 0, 0, None, None, None, self.index)
        return Piece(text, [token], reason, self.prompt_tokens, self.completion_tokens, None, None, None, self.index)

    def record_latency(self, now: float) -> None:
        """Count the token just pushed (read back at ``now``) in ``stats``: the first with the prompt (a
        request's first sample alone counts it: its samples share it) and the time to it, the others with the
        time since the one before."""
        if self.completion_tokens == 1:
            self.stats.first_token(self.prompt_tokens if self.index == 0 else 0, now - self.latest)
        else:
            self.stats.next_token(now - self.latest)
        self.latest = now


def hand_prompt_logprobs(
    outputs: Mapping[Sequence, OutputProcessor], chunks: Iterable[Chunk], logprobs: list[ChunkLogprobs] | None
) -> dict[Sequence, list[TokenLogprob] | None]:
    """Give each chunk's prompt logprobs (a mixed step's prompt rows, where asked) to its request's output, and
    return each chunk's sampled tokens' logprobs by sequence (to push with its tokens)."""
    sampled = {}
    for chunk, entry in zip(chunks, logprobs or ()):
        output = outputs.get(chunk.sequence)
        if output is not None and entry.prompt is not None:
            output.add_prompt_logprobs(chunk.sequence.prompt, entry.prompt, chunk.start)
        sampled[chunk.sequence] = entry.sampled
    return sampled
