"""The engine's scheduler: which sequences the next step serves, in which rows, on which KV blocks, as
plain Python over integers (vLLM v1's seam: :meth:`Scheduler.schedule` returns a :class:`StepPlan`, the
step packs it into its feeds and runs it, :meth:`Scheduler.update` takes the tokens read back).

Sequences wait in arrival order; the oldest joins when a slot and the KV blocks of its whole generation
(prompt and ``max_tokens``) are free, so a running sequence never runs out of blocks. Admitted prompts
run in chunks of at most ``prefill_chunk`` rows, several prompts' pieces packed into one prefill step in
slot order; a decode step serves every decoding sequence at once. Prefill and decode steps alternate
while both have work, so a long prompt does not stall the sequences already decoding.

Plans may be made before the previous steps' tokens are read (the engine's ``ahead``): a sequence counts
the tokens its submitted steps sample (``sampled``) apart from those read back (``output``), and a
sequence that finished meanwhile gets none of the tokens still on their way."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ..errors import RequestError, ShapeError
from .blocks import BlockPool
from .params import SamplingParams


class SequenceState(Enum):
    """Where a sequence is: waiting for a slot and blocks, running its prompt, sampling tokens, or done
    (stopped, cancelled or failed: its slot and blocks given back). Preemption adds a state here."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


class StepKind(Enum):
    """A prefill step (pieces of prompts) or a decode step (one row per decoding sequence)."""

    PREFILL = "prefill"
    DECODE = "decode"


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
    prefilled: int = 0  # prompt tokens in submitted steps
    sampled: int = 0  # tokens the submitted steps sample for it (read back or not yet)
    output: list[int] = field(default_factory=list)  # tokens read back

    @property
    def length(self) -> int:
        """Tokens in the KV cache once the submitted steps ran (the prompt rows, then every sampled token
        but the newest): the position of the next decode step's row."""
        return self.prefilled + max(self.sampled - 1, 0)

    @property
    def wants_token(self) -> bool:
        """Its prompt ran and it needs more tokens than the submitted steps sample."""
        return self.state is SequenceState.DECODING and self.sampled < self.params.max_tokens


@dataclass(frozen=True)
class Chunk:
    """A sequence's rows in a step: ``count`` tokens from position ``start`` (a decode step: 1, its newest
    token); the step samples a token for it from its last row, with key ``(seed, draw)``, and ``sampled``
    says whether that token is real (not for a prompt piece that leaves more of the prompt to run)."""

    sequence: Sequence
    start: int
    count: int
    draw: int
    sampled: bool


@dataclass(frozen=True)
class StepPlan:
    """What the next step runs: its kind and one chunk per sequence, rows in chunk order."""

    kind: StepKind
    chunks: list[Chunk]

    @property
    def rows(self) -> int:
        """Token rows the step needs."""
        return sum(chunk.count for chunk in self.chunks)


class Scheduler:
    """Admission, chunked-prefill choice and KV block accounting for ``max_batch`` slots over ``pool``."""

    def __init__(self, pool: BlockPool, *, max_batch: int, max_context: int, prefill_chunk: int) -> None:
        self.pool = pool
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.prefill_width = min(max_batch, prefill_chunk)  # prompts one prefill step serves (its samples)
        self.waiting: deque[Sequence] = deque()
        self.slots: list[Sequence | None] = [None] * max_batch
        self.prefill_turn = True
        self.ids = itertools.count()

    # sequences in and out ------------------------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams, seed: int) -> Sequence:
        """A new sequence, waiting; RequestError (nothing queued) for an empty prompt, one whose prompt and
        ``max_tokens`` exceed ``max_context``, or one that needs more KV blocks than the pool has."""
        self.check(len(prompt), params.max_tokens)
        sequence = Sequence(next(self.ids), list(prompt), params, seed)
        self.waiting.append(sequence)
        return sequence

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """RequestError unless a generation of this size can ever run."""
        if prompt_tokens == 0:
            raise RequestError("the prompt is empty", "prompt")
        if prompt_tokens + max_tokens > self.max_context:
            raise RequestError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceed the engine's max_context "
                f"({self.max_context})",
                "prompt",
            )
        needed = self.pool.needed(prompt_tokens + max_tokens)
        if needed > self.pool.blocks:
            raise RequestError(f"the request needs {needed} KV blocks; the cache has {self.pool.blocks}", "max_tokens")

    def finish(self, sequence: Sequence) -> None:
        """End ``sequence`` (stopped, cancelled or failed): its slot and blocks are free for the next step,
        and tokens still on their way to it are dropped. Finishing twice is harmless."""
        if sequence.state is SequenceState.WAITING:
            self.waiting.remove(sequence)
        sequence.state = SequenceState.FINISHED
        if sequence.slot >= 0 and self.slots[sequence.slot] is sequence:
            self.slots[sequence.slot] = None
        self.pool.release(sequence.blocks)
        sequence.slot = -1

    def running(self) -> list[Sequence]:
        """The sequences holding a slot, in slot order."""
        return [s for s in self.slots if s is not None]

    def unfinished(self) -> list[Sequence]:
        """Every sequence waiting or running."""
        return [*self.waiting, *self.running()]

    # the plan ------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Admit what fits, then plan the next step (None: nothing to run) and count it as submitted."""
        self.admit()
        running = self.running()
        prefilling = [s for s in running if s.state is SequenceState.PREFILLING]
        decoding = [s for s in running if s.wants_token]
        if prefilling and (self.prefill_turn or not decoding):
            self.prefill_turn = False
            return self.plan_prefill(prefilling)
        self.prefill_turn = True
        return self.plan_decode(decoding) if decoding else None

    def admit(self) -> None:
        """Waiting sequences take free slots, oldest first, while the pool holds their whole generation;
        the oldest waits for blocks (it fits an empty pool: :meth:`check`) and those behind it with it."""
        while self.waiting and None in self.slots:
            sequence = self.waiting[0]
            if not self.pool.grow(sequence.blocks, len(sequence.prompt) + sequence.params.max_tokens):
                return
            self.waiting.popleft()
            sequence.slot = self.slots.index(None)
            sequence.state = SequenceState.PREFILLING
            self.slots[sequence.slot] = sequence

    def plan_prefill(self, prefilling: list[Sequence]) -> StepPlan:
        """The next pieces of the prompts, in slot order, while rows of ``prefill_chunk`` are left (the last
        one may get only part of what is left of its prompt), at most ``prefill_width`` prompts."""
        chunks, rows = [], 0
        for sequence in prefilling[: self.prefill_width]:
            if rows >= self.prefill_chunk:
                break
            first = sequence.prefilled
            count = min(len(sequence.prompt) - first, self.prefill_chunk - rows)
            ends = first + count == len(sequence.prompt)
            chunks.append(Chunk(sequence, first, count, sequence.sampled, ends))
            rows += count
        for chunk in chunks:
            self.advance_prefill(chunk)
        return StepPlan(StepKind.PREFILL, chunks)

    def advance_prefill(self, chunk: Chunk) -> None:
        """Count a planned prompt piece as submitted; a piece that ends the prompt starts the decoding."""
        sequence = chunk.sequence
        sequence.prefilled += chunk.count
        if chunk.sampled:
            sequence.sampled += 1
            sequence.state = SequenceState.DECODING

    def plan_decode(self, decoding: list[Sequence]) -> StepPlan:
        """One row per decoding sequence, at its next position, each sampling its next token."""
        chunks = [Chunk(s, s.length, 1, s.sampled, True) for s in decoding]
        for sequence in decoding:
            sequence.sampled += 1
        return StepPlan(StepKind.DECODE, chunks)

    # results -------------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, tokens: list[int]) -> list[tuple[Sequence, int]]:
        """Take a step's tokens (one per chunk of ``plan``): each real token of a sequence that has not
        finished meanwhile joins its output; returns those (sequence, token) pairs, in chunk order."""
        if len(tokens) != len(plan.chunks):
            raise ShapeError(f"update: the plan has {len(plan.chunks)} chunks, got {len(tokens)} tokens")
        taken = []
        for chunk, token in zip(plan.chunks, tokens):
            sequence = chunk.sequence
            if chunk.sampled and sequence.state is not SequenceState.FINISHED:
                sequence.output.append(token)
                taken.append((sequence, token))
        return taken
