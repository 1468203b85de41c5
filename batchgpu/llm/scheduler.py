"""The engine's scheduler: which sequences the next step serves, in which rows, on which KV blocks, as
plain Python over integers (vLLM v1's seam: :meth:`Scheduler.schedule` returns a :class:`StepPlan`, the
step packs it into its feeds and runs it, :meth:`Scheduler.update` takes the tokens read back).

One token budget per step (``max_step_tokens``, vLLM's ``max_num_batched_tokens``): a step first carries a
row for every running sequence that is ready to decode (including those whose latest token is still on the
device, in a step submitted ahead), then pieces of the prompts being prefilled, oldest first, then pieces
of waiting prompts, admitted oldest first while a slot is free, the budget lasts and the pool has the KV
blocks of their first piece. A step without prompt rows is a decode step (:attr:`StepKind.DECODE`, the
engine's fast path); one with them is mixed. The budget is at least ``max_batch``, so no step leaves a
decode-ready sequence out.

Blocks are taken as the sequences grow; when the pool has none left for a step, the newest running
sequence is preempted: its blocks go back, it waits again at the front of the queue (in arrival order),
and it later runs its prompt and the tokens it had generated as one prompt again (vLLM v1's recompute
preemption); a step that preempts admits nobody. The oldest running sequence always fits (a request that
would not fit the whole pool alone is refused), so every sequence ends.

Prefix caching: each full block whose step was read back is registered under the chained hash of its
tokens (:mod:`~batchgpu.llm.blocks`); a sequence that joins takes the registered blocks of its longest
cached prefix and runs only the rest (at least its last token, whose logits it samples from).

Plans may be made before the previous steps' tokens are read (the engine's ``ahead``): a sequence counts
the tokens its submitted steps sample (``sampled``) apart from those read back (``output``), and a
sequence that finished or was preempted meanwhile gets none of the tokens still on their way (the steps
already submitted write only into blocks it held, before any later step of the blocks' next holder runs:
steps run in submission order). A sequence with a grammar (``guide``) runs at most one step ahead: its next
token's mask depends on the token before it, so a step that samples it is planned while that token is on
its way at most (the engine reads it before it submits that step's sampling part)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..errors import ArgumentError, RequestError, ShapeError
from .blocks import BlockPool, chain_hashes
from .params import SamplingParams


class SequenceState(Enum):
    """Where a sequence is: waiting for a slot and blocks (``PREEMPTED``: waiting again, its blocks taken
    back, to run its prompt and output as one prompt), running its prompt, sampling tokens, or done
    (stopped, cancelled or failed: its slot and blocks given back)."""

    WAITING = "waiting"
    PREEMPTED = "preempted"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


QUEUED = (SequenceState.WAITING, SequenceState.PREEMPTED)


class StepKind(Enum):
    """A decode step (one row per decode-ready sequence, nothing else: the engine's fast path), a mixed
    step (pieces of prompts, beside a row per decode-ready sequence) or a verify step (a decode step whose
    sequences' rows are followed by their drafted tokens' rows: speculative decoding)."""

    MIXED = "mixed"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class SchedulerStats:
    """Counters since the scheduler started: ``preemptions``, prompt tokens whose KV came from the prefix
    cache (``prefix_cache_hit_tokens``), prefill rows computed (``prompt_tokens_computed``, prompts and
    the recomputation of preempted sequences) and speculative decoding's drafted and accepted tokens."""

    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens_computed: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted into verify steps read back
    accepted_tokens: int = 0  # ... and those of them accepted


@dataclass(eq=False)
class Sequence:
    """One generation as the scheduler sees it: prompt ids, sampling parameters and seed, its state, slot
    and KV blocks, and how far the submitted steps took it."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    state: SequenceState = SequenceState.WAITING
    slot: int = -1
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # KV rows the submitted steps write (and those taken from the prefix cache)
    sampled: int = 0  # tokens the submitted steps sample for it (read back or not yet)
    output: list[int] = field(default_factory=list)  # tokens read back
    resumed: int = 0  # output tokens its prefill runs again (after a preemption)
    preemptions: int = 0  # also the epoch of its chunks: those of an older one are stale
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks of known tokens
    registered: int = 0  # its first blocks that are registered in the prefix cache
    parent: Sequence | None = None  # a parallel sample's first sibling, whose prompt blocks it shares
    draft_limit: int = 0  # tokens its next draft may have (speculative decoding; 0: not speculated yet)
    draft_misses: int = 0  # its drafts in a row that had nothing accepted
    draft_pause: int = 0  # steps it decodes without drafting before it drafts again
    guide: Any = (
        None  # a structured output's grammar state (batchgpu.llm.grammar.Guide): its masks need every token read
    )

    @property
    def prefill_length(self) -> int:
        """Rows its prefill runs: the prompt, and after a preemption the output read back before it."""
        return len(self.prompt) + self.resumed

    @property
    def wants_token(self) -> bool:
        """Its prompt ran and it needs more tokens than the submitted steps sample; a sequence with a
        ``guide`` only with at most one token on its way (its next mask follows from it: the step's sampling
        waits for that read, its forward part need not)."""
        waiting = self.guide is not None and self.sampled > len(self.output) + 1
        return self.state is SequenceState.DECODING and self.sampled < self.params.max_tokens and not waiting

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Its tokens at positions ``[start, stop)``: the prompt, then the output."""
        return (self.prompt + self.output)[start:stop]


def penalized(params: SamplingParams) -> bool:
    """Whether a request with ``params`` samples with a repetition, presence or frequency penalty (its
    sampling reads its slot's token counts on the device)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def computes_whole_prompt(params: SamplingParams) -> bool:
    """Whether a request with ``params`` must run every prompt row, so it takes nothing from the prefix
    cache: it is :func:`penalized` (the prefill counts every token), or it asks for its prompt's logprobs
    (each row's logits give the next prompt token's)."""
    return penalized(params) or params.prompt_logprobs is not None


class Chunk:
    """A sequence's rows in a step: ``count`` tokens from position ``start`` (``decode``: one row, its newest
    token, which the step before left on the device; else a piece of its prompt); the step samples a token
    for it from its last row, with key ``(seed, draw)``, and ``sampled`` says whether that token is real (not
    for a prompt piece that leaves more of the prompt to run); ``epoch``: the sequence's preemptions when
    planned. A decode chunk of a verify step also has ``draft``: the drafted tokens that follow its first
    row (``count`` is one more), each row sampling (keys ``draw``, ``draw + 1``, ...). Immutable by convention
    (a plain class with slots: a step makes one per sequence)."""

    __slots__ = ("sequence", "start", "count", "draw", "sampled", "epoch", "decode", "draft")

    def __init__(
        self,
        sequence: Sequence,
        start: int,
        count: int,
        draw: int,
        sampled: bool,
        epoch: int = 0,
        decode: bool = False,
        draft: tuple[int, ...] = (),
    ) -> None:
        self.sequence, self.start, self.count, self.draw = sequence, start, count, draw
        self.sampled, self.epoch, self.decode, self.draft = sampled, epoch, decode, draft

    def __repr__(self) -> str:
        kind = "decode" if self.decode else "prompt"
        return f"Chunk({kind} of sequence {self.sequence.id}: {self.count} from {self.start}, draw {self.draw})"

    @property
    def current(self) -> bool:
        """Its sequence has neither finished nor been preempted since the chunk was planned."""
        return self.sequence.state is not SequenceState.FINISHED and self.epoch == self.sequence.preemptions


@dataclass(frozen=True)
class StepPlan:
    """What the next step runs: its kind, one chunk per sequence (decode rows first, in slot order, then the
    prompt pieces, oldest first), rows in chunk order, and ``rows``, their count."""

    kind: StepKind
    chunks: list[Chunk]
    rows: int


SCORING_ROWS = 256
"""Prompt rows a step computes logprobs for at most (the head runs on each: rows x vocab logits), however
large its budget: a prompt that asks for its logprobs runs in pieces of at most this many rows."""


def scores_prompt(sequence: Sequence, start: int) -> bool:
    """Whether a piece of ``sequence``'s prompt from ``start`` is scored: it asks for its prompt's logprobs and
    the piece starts in its prompt (a preempted sequence's output, run again, is not)."""
    return sequence.params.prompt_logprobs is not None and start < len(sequence.prompt)


def check_size(prompt_tokens: int, max_tokens: int, max_context: int, block_size: int, blocks: int) -> None:
    """RequestError unless a generation of ``prompt_tokens`` + ``max_tokens`` can ever run: within
    ``max_context``, and alone in a pool of ``blocks`` KV blocks of ``block_size`` tokens."""
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty", "prompt")
    if prompt_tokens + max_tokens > max_context:
        raise RequestError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceed the engine's max_context "
            f"({max_context})",
            "max_tokens" if max_tokens >= max_context else "prompt",  # past it alone, or with the prompt
        )
    needed = -(-(prompt_tokens + max_tokens) // block_size)
    if needed > blocks:
        raise RequestError(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) need {needed} KV blocks of "
            f"{block_size} tokens; the cache has {blocks}",
            "max_tokens",
        )


def check_step_tokens(max_batch: int, max_step_tokens: int) -> None:
    """ArgumentError unless ``max_step_tokens`` is an int of at least ``max_batch`` (a step carries a row for
    every decoding sequence)."""
    if isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int) or max_step_tokens < max_batch:
        raise ArgumentError(
            f"max_step_tokens must be an int of at least max_batch ({max_batch}): a step carries a row for every "
            f"decoding sequence; got {max_step_tokens!r}"
        )


class Scheduler:
    """Admission, the token budget of each step (``max_step_tokens``, at least ``max_batch``; at most
    ``scoring_rows`` of them scored: prompt rows whose logprobs are asked for), KV block accounting,
    preemption and prefix caching (off with ``prefix_caching=False``) for ``max_batch`` slots over ``pool``;
    ``stats`` counts what happened."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_batch: int,
        max_context: int,
        max_step_tokens: int,
        prefix_caching: bool = True,
        scoring_rows: int = SCORING_ROWS,
    ) -> None:
        check_step_tokens(max_batch, max_step_tokens)
        self.scoring_rows = scoring_rows  # prompt rows whose logprobs one step computes, at most
        self.pool = pool
        self.max_batch, self.max_context, self.max_step_tokens = max_batch, max_context, max_step_tokens
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * max_batch
        self.ids = itertools.count()
        self.stats = SchedulerStats()

    # sequences in and out ------------------------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams, seed: int, parent: Sequence | None = None) -> Sequence:
        """A new sequence, waiting; RequestError (nothing queued) for an empty prompt, one whose prompt and
        ``max_tokens`` exceed ``max_context``, or one that needs more KV blocks than the pool has. A
        ``parent`` (another sample of the same prompt, added before it) makes it a parallel sample that
        shares the parent's full prompt blocks (:meth:`shared_prefix`)."""
        self.check(len(prompt), params.max_tokens)
        sequence = Sequence(next(self.ids), list(prompt), params, seed, parent=parent)
        self.waiting.append(sequence)
        return sequence

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """RequestError unless a generation of this size can ever run (alone, in the whole pool)."""
        check_size(prompt_tokens, max_tokens, self.max_context, self.pool.block_size, self.pool.blocks)

    def finish(self, sequence: Sequence) -> None:
        """End ``sequence`` (stopped, cancelled or failed): its slot and blocks are free for the next step,
        and tokens still on their way to it are dropped. Finishing twice is harmless. (Its blocks in the
        prefix cache were registered when the steps writing them had been read back: a failed step
        registers none.)"""
        if sequence.state in QUEUED:
            self.waiting.remove(sequence)
        sequence.state = SequenceState.FINISHED
        self.vacate(sequence)

    def vacate(self, sequence: Sequence) -> None:
        """``sequence`` gives back its slot and blocks."""
        if sequence.slot >= 0 and self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None
        self.pool.release(sequence.blocks)
        sequence.slot, sequence.registered = -1, 0

    def preempt(self, sequence: Sequence) -> None:
        """Take a running sequence's slot and blocks back: it waits again, ahead of the sequences that came
        after it, to run its prompt and the output read back so far as one prompt; the tokens on their
        way to it are dropped (their draws are sampled again)."""
        self.vacate(sequence)
        sequence.state = SequenceState.PREEMPTED
        sequence.preemptions += 1
        sequence.resumed = len(sequence.output)
        sequence.sampled = len(sequence.output)
        sequence.computed = 0
        later = next((i for i, s in enumerate(self.waiting) if s.id > sequence.id), len(self.waiting))
        self.waiting.insert(later, sequence)
        self.stats.preemptions += 1

    def running(self) -> list[Sequence]:
        """The sequences holding a slot, in slot order."""
        return [s for s in self.slots if s is not None]

    def status(self) -> dict[str, int]:
        """Sequences running and waiting, preemptions and prefix cache hits so far (an engine's ``status()``)."""
        return {
            "running": len(self.running()),
            "waiting": len(self.waiting),
            "preemptions": self.stats.preemptions,
            "prefix_cache_hit_tokens": self.stats.prefix_cache_hit_tokens,
        }

    def unfinished(self) -> list[Sequence]:
        """Every sequence waiting or running."""
        return [*self.waiting, *self.running()]

    # the plan ------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step (None: nothing to run) and count it as submitted: the running sequences' rows
        (:meth:`plan_running`), then, unless that preempted a sequence, the first pieces of waiting ones
        (:meth:`admit`) in the budget left."""
        while True:
            preemptions = self.stats.preemptions
            chunks, pieces = self.plan_running()
            rows = len(chunks) - len(pieces) + sum(piece.count for piece in pieces)
            if self.stats.preemptions == preemptions:
                scoring = self.scoring_rows - sum(c.count for c in pieces if scores_prompt(c.sequence, c.start))
                admitted = self.admit(self.max_step_tokens - rows, scoring)
                chunks += admitted
                rows += sum(chunk.count for chunk in admitted)
            if chunks:  # decode rows first: the last is one where every chunk is
                return StepPlan(StepKind.DECODE if chunks[-1].decode else StepKind.MIXED, chunks, rows)
            if self.stats.preemptions == preemptions:  # nothing runs until the reads end sequences
                return None

    def plan_running(self) -> tuple[list[Chunk], list[Chunk]]:
        """A decode row for each decode-ready running sequence (slot order), then the next pieces of the
        prompts being prefilled (oldest first) while the step's budget lasts; preempts where the pool lacks
        blocks for them (:meth:`allocate`). Returns all the chunks, and the prompt pieces among them."""
        running = self.running()
        decoding = [s for s in running if s.wants_token]
        budget, scoring = self.max_step_tokens - len(decoding), self.scoring_rows
        pieces = []
        for sequence in sorted((s for s in running if s.state is SequenceState.PREFILLING), key=lambda s: s.id):
            count = self.piece(sequence, sequence.computed, budget, scoring)
            if count:
                pieces.append((sequence, count))
                budget -= count
                scoring -= count if scores_prompt(sequence, sequence.computed) else 0
        size, preemptions = self.pool.block_size, self.stats.preemptions
        growing = [(s, s.computed + 1) for s in decoding if s.computed >= len(s.blocks) * size]  # a new block
        denied = self.allocate(growing + [(s, s.computed + count) for s, count in pieces])
        if denied or self.stats.preemptions != preemptions:  # some wait for blocks, or were preempted
            decoding = [s for s in decoding if s.state is SequenceState.DECODING and s not in denied]
            pieces = [(s, count) for s, count in pieces if s.state is SequenceState.PREFILLING and s not in denied]
        chunks = []
        for sequence in decoding:
            chunks.append(Chunk(sequence, sequence.computed, 1, sequence.sampled, True, sequence.preemptions, True))
            sequence.computed += 1
            sequence.sampled += 1
        prompts = [self.prompt_chunk(sequence, count) for sequence, count in pieces]
        return chunks + prompts, prompts

    def piece(self, sequence: Sequence, start: int, budget: int, scoring: int) -> int:
        """The rows of ``sequence``'s next prompt piece from ``start`` that a step with ``budget`` rows left (and
        ``scoring`` scored rows left, where its rows are scored) holds."""
        rows = min(sequence.prefill_length - start, budget)
        return max(min(rows, scoring) if scores_prompt(sequence, start) else rows, 0)

    def admit(self, budget: int, scoring: int) -> list[Chunk]:
        """Waiting sequences take free slots, oldest first, each with the blocks of its cached prefix and the
        first piece of its prompt that the step's ``budget`` (and ``scoring`` rows, where its rows are scored)
        holds, while the pool has free blocks for that piece; the oldest waits (it fits an empty pool:
        :meth:`check`) and those behind it with it. Returns their prompt chunks."""
        chunks = []
        while budget > 0 and self.waiting and None in self.slots:
            sequence = self.waiting[0]
            shared = self.shared_prefix(sequence)
            if shared is None:
                break  # its parent's prompt blocks are on their way: it waits for them
            cached = shared or self.cached_prefix(sequence)
            hit = len(cached) * self.pool.block_size
            count = self.piece(sequence, hit, budget, scoring)
            cost = self.pool.needed(hit + count) - len(cached) + sum(self.pool.refs(b) == 0 for b in cached)
            if count == 0 or cost > self.pool.free:
                break
            self.waiting.popleft()
            self.pool.take(cached)
            sequence.blocks, sequence.computed, sequence.registered = cached, hit, len(cached)
            self.pool.grow(sequence.blocks, hit + count)
            self.stats.prefix_cache_hit_tokens += hit
            sequence.slot = self.slots.index(None)
            sequence.state = SequenceState.PREFILLING
            self.slots[sequence.slot] = sequence
            scoring -= count if scores_prompt(sequence, hit) else 0
            chunks.append(self.prompt_chunk(sequence, count))
            budget -= count
        return chunks

    def cached_prefix(self, sequence: Sequence) -> list[int]:
        """The registered blocks of ``sequence``'s longest cached prefix, leaving at least its last prefill
        token to compute (its logits give the next token); none where prefix caching is off or the
        sequence must run its whole prompt (:func:`computes_whole_prompt`)."""
        if not self.prefix_caching or computes_whole_prompt(sequence.params):
            return []
        blocks = (sequence.prefill_length - 1) // self.pool.block_size
        tokens = sequence.token_ids(0, sequence.prefill_length)
        return self.pool.lookup(chain_hashes(sequence.hashes, tokens, self.pool.block_size, blocks)[:blocks])

    def shared_prefix(self, sequence: Sequence) -> list[int] | None:
        """The blocks a parallel sample takes from its parent: the parent's full blocks of the prompt
        (leaving at least its last prefill token to compute, whose logits it samples its first token from)
        once the steps writing them are planned (in this step too: a step writes every row's keys and values
        before any row attends); None while they are not (the parent runs its prompt first); none where it
        has no parent, the parent has ended, or it must run its whole prompt."""
        parent = sequence.parent
        if parent is None or parent.state is SequenceState.FINISHED or computes_whole_prompt(sequence.params):
            return []
        blocks = min(len(sequence.prompt), sequence.prefill_length - 1) // self.pool.block_size
        if parent.state in QUEUED or parent.computed < blocks * self.pool.block_size:
            return None
        return parent.blocks[:blocks]

    def allocate(self, demands: list[tuple[Sequence, int]]) -> set[Sequence]:
        """Grow each sequence's blocks to its rows, oldest first; where the pool has too few, preempt the
        newest running sequence that still needs blocks (possibly the one asking: it then waits instead
        where sequences whose every token is sampled hold blocks, since their reads free them) until they
        fit. Returns those that wait (neither granted nor preempted)."""
        denied = set()
        for sequence, rows in sorted(demands, key=lambda demand: demand[0].id):
            while sequence.state is not SequenceState.PREEMPTED and not self.pool.grow(sequence.blocks, rows):
                running = self.running()
                candidates = [s for s in running if s.state is SequenceState.PREFILLING or s.wants_token]
                victim = max(candidates, key=lambda s: s.id)
                if victim is sequence and len(candidates) < len(running):
                    denied.add(sequence)
                    break
                self.preempt(victim)
        return denied

    def prompt_chunk(self, sequence: Sequence, count: int) -> Chunk:
        """The next ``count`` rows of ``sequence``'s prompt, counted as submitted; a piece that ends the
        prompt samples its first token and starts its decoding."""
        ends = sequence.computed + count == sequence.prefill_length
        chunk = Chunk(sequence, sequence.computed, count, sequence.sampled, ends, sequence.preemptions)
        sequence.computed += count
        self.stats.prompt_tokens_computed += count
        if ends:
            sequence.sampled += 1
            sequence.state = SequenceState.DECODING
        return chunk

    # results -------------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """Take a step's tokens (one per chunk of ``plan``): each real token of a sequence that has neither
        finished nor been preempted meanwhile joins its output, and the blocks the step filled join the
        prefix cache; returns those (sequence, token) pairs, in chunk order."""
        if len(tokens) != len(plan.chunks):
            raise ShapeError(f"update: the plan has {len(plan.chunks)} chunks, got {len(tokens)} tokens")
        taken, size, finished = [], self.pool.block_size, SequenceState.FINISHED
        for chunk, token in zip(plan.chunks, tokens):
            sequence = chunk.sequence
            if sequence.state is finished or chunk.epoch != sequence.preemptions:  # not current
                continue
            if chunk.sampled:
                sequence.output.append(token)
                taken.append((sequence, token))
            if self.prefix_caching and (chunk.start + chunk.count) // size > sequence.registered:
                self.register(sequence, chunk.start + chunk.count)
        return taken

    def register(self, sequence: Sequence, rows: int) -> None:
        """Register ``sequence``'s full blocks among its first ``rows`` (written by steps read back)."""
        full = min(rows // self.pool.block_size, len(sequence.blocks))
        if full <= sequence.registered:
            return
        tokens = sequence.token_ids(0, full * self.pool.block_size)
        hashes = chain_hashes(sequence.hashes, tokens, self.pool.block_size, full)
        for j in range(sequence.registered, full):
            self.pool.register(sequence.blocks[j], hashes[j])
        sequence.registered = full
