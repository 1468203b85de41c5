"""The output processor: one per request, outside the scheduler, it turns each token read back into a
:class:`Piece` of text (streaming detokenization through :class:`~batchgpu.llm.text.TextStream`) and
decides where the generation ends: the model's end-of-sequence token, a stop token id, a stop string
(its text left out) or ``max_tokens`` (as vLLM v1's output processor does beside its engine core; with
``max_tokens`` 0 the prompt alone: the token sampled after it is dropped, neither reported nor counted); it
records each token's latency in the engine's :class:`~batchgpu.llm.metrics.EngineStats` and gives each
logprob entry the bytes its token (and each top id) adds to the text there
(:class:`~batchgpu.models.token_bytes.TokenReader`). A request's tokens are counted once, from what its
answer reports (:class:`Tally`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BatchError
from ..models.token_bytes import TokenReader
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
    first piece carries ``prompt_logprobs`` where asked: one per prompt token, the first with logprob None;
    each entry has the bytes its token and top ids add to the text (:class:`~batchgpu.llm.step.TokenLogprob`),
    and ``token_texts`` each of their ids' own text (:meth:`~batchgpu.models.token_bytes.TokenBytes.alone`).
    ``index``: which of the request's ``n`` samples (choices) it belongs to. A request with ``tools`` gets
    its text whole on the last piece: the message's content (None where it is only calls) and the
    ``tool_calls`` parsed from it, with ``finish_reason`` ``"tool_calls"`` where there are any. The last
    piece a request's caller gets carries the request's ``usage`` (what its answer reports, and what the
    engine's metrics count)."""

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
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """What a request's answer reports: its prompt's tokens (once, however many samples), the tokens of the
    samples it returns (``best_of``'s others are not returned) and each returned sample's finish reason."""

    prompt_tokens: int
    completion_tokens: int
    finish_reasons: tuple[str, ...] = ()

    def openai(self) -> dict[str, int]:
        """OpenAI's ``usage`` object."""
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


class Tally:
    """The pieces a request's caller gets, ``samples`` of them ending: :meth:`take` each before it is handed
    over; the last gets the request's :class:`Usage` (from the counts the samples' last pieces carry)."""

    __slots__ = ("left", "prompt_tokens", "completion_tokens", "reasons")

    def __init__(self, samples: int) -> None:
        self.left, self.prompt_tokens, self.completion_tokens = samples, 0, 0
        self.reasons: list[str] = []

    def take(self, piece: Piece) -> Usage | None:
        """The request's usage where ``piece`` is its last (set on the piece too), else None."""
        if piece.finish_reason is None:
            return None
        self.left -= 1
        self.prompt_tokens = max(self.prompt_tokens, piece.prompt_tokens)
        self.completion_tokens += piece.completion_tokens
        self.reasons.append(piece.finish_reason)
        if self.left:
            return None
        piece.usage = Usage(self.prompt_tokens, self.completion_tokens, tuple(self.reasons))
        return piece.usage


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
    logprobs, the last's end, counts and usage."""
    if len(pieces) == 1:
        return pieces[0]
    last, logprobs = pieces[-1], [entry for piece in pieces for entry in piece.logprobs or ()]
    texts = {i: text for piece in pieces for i, text in (piece.token_texts or {}).items()}
    return Piece(
        "".join(piece.text for piece in pieces), [i for piece in pieces for i in piece.token_ids],
        last.finish_reason, last.prompt_tokens, last.completion_tokens, logprobs or None,
        pieces[0].prompt_logprobs, texts or None, last.index, last.tool_calls, last.usage,
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


def end_ids(params: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The token ids that end a request's generation: its ``stop_token_ids`` and, unless it ignores them, the
    model's end-of-sequence ids."""
    return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)


class ItemQueue(Protocol):
    """Where a sequence's pieces (or the error that ends it) go: :class:`PieceQueue`, or the core process's."""

    def put_nowait(self, item: Piece | BaseException) -> None: ...


class Output(Protocol):
    """What the step loop hands a sequence's tokens to: :class:`OutputProcessor`, or in the engine's core
    process :class:`~batchgpu.llm.core_output.CoreOutput`."""

    queue: ItemQueue

    def take(
        self, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float, grammar_end: bool = False
    ) -> bool:
        """Hand over ``tokens``; whether the generation ended with them."""
        ...

    def add_prompt_logprobs(self, prompt: list[int], entries: list[TokenLogprob], start: int) -> None:
        """The logprobs of the prompt tokens after positions ``start``, ``start + 1``, ..."""
        ...


class OutputProcessor:
    """One request's output: :meth:`push` each token as it is read back, in order, until a piece comes
    back with its ``finish_reason``; text held back (an unfinished character, the possible start of a stop
    string) comes out on the last piece. ``queue`` takes the pieces (or the error that ends the request)
    on their way to its caller (``queue``: one that the request's other samples share; their pieces carry
    their ``index``). Each token pushed has its latency recorded in ``stats`` (the engine's; None: a private
    one): the first since ``arrival`` (a :func:`~batchgpu.llm.metrics.clock` time; None: now), the others
    since the token before. Where the request asks for logprobs, each entry gets the bytes of its token and
    top ids at their place in the output (or the prompt)."""

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
        self.ends = end_ids(params, codec.eos_ids)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.queue = queue if queue is not None else PieceQueue()
        self.index = index
        self.stats = stats if stats is not None else EngineStats()
        self.latest = arrival if arrival is not None else clock()  # the arrival, then the latest token
        self.prompt_logprobs: list[TokenLogprob] | None = None  # gathered over the prompt's pieces
        self.guide = guide  # a structured output's grammar state (batchgpu.llm.grammar.Guide): takes each token
        self.held: list[str] | None = [] if params.tools is not None else None  # a tool request's text, until its end
        self.reader: TokenReader | None = None  # the output's tokens read for their bytes (logprobs asked)

    def add_prompt_logprobs(self, prompt: list[int], entries: list[TokenLogprob], start: int) -> None:
        """The logprobs of the prompt tokens after positions ``start``, ``start + 1``, ... (a mixed step's
        piece; pieces come in order, and a preempted sequence's prompt runs again from 0, replacing what its
        first run gave); the first token of ``prompt`` opens the list with logprob None."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [TokenLogprob(prompt[0], None)]
        del self.prompt_logprobs[start + 1 :]
        self.prompt_logprobs += entries

    def take(
        self, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float, grammar_end: bool = False
    ) -> bool:
        """Hand ``tokens`` (with their ``logprobs`` where asked), read back at ``now``, to the caller as one
        piece on :attr:`queue` (a verify step's accepted tokens reach it at once, as one stream event);
        whether the generation ended with them (a token that ends it drops those after it; an error the
        grammar raised goes on the queue after the piece of the tokens before). ``grammar_end``: the last
        token ends the request's grammar (decided elsewhere: the engine's core process)."""
        pieces = []
        for index, token in enumerate(tokens):
            try:
                last = grammar_end and index == len(tokens) - 1
                piece = self.push(token, logprobs[index] if logprobs else None, now, last)
            except BatchError as exc:  # a token its grammar refuses: that request fails alone
                if pieces:
                    self.queue.put_nowait(joined(pieces))
                self.queue.put_nowait(exc)
                return True
            pieces.append(piece)
            if piece.finish_reason is not None:
                break
        if pieces:
            self.queue.put_nowait(joined(pieces))
        return bool(pieces) and pieces[-1].finish_reason is not None

    def push(
        self, token: int, logprob: TokenLogprob | None = None, now: float | None = None, grammar_end: bool = False
    ) -> Piece:
        """The piece of ``token`` (with its ``logprob`` where the request asked), read back at ``now`` (a
        :func:`~batchgpu.llm.metrics.clock` time; None: now): its new text, and whether (and why) the
        generation ends with it (``grammar_end``: the grammar ends with it, as the engine's core process
        found). RequestError where the request's grammar refuses the token. With ``max_tokens`` 0 the token
        (the one sampled after the prompt) is dropped: the piece is the prompt's alone, ended by length, with
        no token."""
        if self.params.max_tokens == 0:
            return self._prompt_piece(clock() if now is None else now)
        if self.guide is not None:
            self.guide.accept(token)
        piece = self._piece(token, clock() if now is None else now, grammar_end)
        if self.held is not None:
            self.hold(piece)
        if logprob is None and (self.prompt_logprobs is None or self.completion_tokens != 1):
            return piece  # nothing asked: no logprobs, no token texts
        if logprob is not None:
            if self.reader is None:
                self.reader = self.codec.token_bytes.reader()
            piece.logprobs = [placed(logprob, self.reader)]
        if self.completion_tokens == 1:
            piece.prompt_logprobs = self._prompt_entries()
        self._add_texts(piece)
        return piece

    def _prompt_piece(self, now: float) -> Piece:
        """The whole answer of a request with ``max_tokens`` 0: its prompt's logprobs where asked."""
        self.record_latency(now)
        piece = Piece("", [], "length", self.prompt_tokens, 0, None, self._prompt_entries(), None, self.index)
        if self.held is not None:
            self.hold(piece)
        self._add_texts(piece)
        return piece

    def _prompt_entries(self) -> list[TokenLogprob] | None:
        """The prompt's logprob entries (where asked), each with its bytes at its place in the prompt."""
        if self.prompt_logprobs is None:
            return None
        reader = self.codec.token_bytes.reader()
        return [placed(entry, reader) for entry in self.prompt_logprobs]

    def _add_texts(self, piece: Piece) -> None:
        """``piece.token_texts``: the own text of each id among its entries (none without entries)."""
        entries = [*(piece.logprobs or ()), *(piece.prompt_logprobs or ())]
        if entries:
            table = self.codec.token_bytes
            ids = {i for entry in entries for i in (entry.token, *(t for t, _ in entry.top))}
            piece.token_texts = {i: table.alone(i) for i in ids}

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

    def _piece(self, token: int, now: float, grammar_end: bool = False) -> Piece:
        self.completion_tokens += 1
        self.record_latency(now)
        ends = token in self.ends
        delta = self.stream.finish() if ends else self.stream.push(token)
        text, reason = delta.text, None
        if ends or delta.stopped:
            reason = "stop"
        elif grammar_end or (self.guide is not None and self.guide.stopped):  # the grammar ended: nothing may follow
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
        """Record the latency of the token just pushed (read back at ``now``) in ``stats``: the first's since
        the arrival (with ``max_tokens`` 0, the prompt's end), the others' since the one before."""
        if self.completion_tokens <= 1:
            self.stats.first_token(now - self.latest)
        else:
            self.stats.next_token(now - self.latest)
        self.latest = now


def placed(entry: TokenLogprob, reader: TokenReader) -> TokenLogprob:
    """``entry`` with the bytes its top ids would add at the reader's next place and those its token adds
    there, which the token then takes."""
    top = tuple(reader.place(token) for token, _ in entry.top)
    return TokenLogprob(entry.token, entry.logprob, entry.top, reader.take(entry.token), top)


def hand_prompt_logprobs(
    outputs: Mapping[Sequence, Output], chunks: Iterable[Chunk], logprobs: list[ChunkLogprobs] | None
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
