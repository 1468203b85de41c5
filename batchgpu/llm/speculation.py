"""Speculative decoding in the engine (:mod:`batchgpu.models.speculative` says why it is exact): a decode
step whose sequences may draft becomes a verify step. Each eligible sequence's row is followed by the rows of
its drafted tokens (a :class:`Drafter`'s: prompt lookup, or a draft model), every row samples as a decode
row would at that output position, and the step's read keeps each sequence's accepted prefix and one more
token; the KV rows past it are left to be overwritten (its block table keeps the blocks).

Which sequences draft: those without repetition, presence or frequency penalties (the device's counts would
take the drafted tokens), while at most ``Speculative.max_batch`` sequences decode (past
that a decode step is full without drafts). How much: each sequence's limit starts at
``Speculative.tokens``, grows by one after a draft accepted whole and falls to one more than what was
accepted after one that was not (so a sequence whose drafts fail drafts one token, and one that copies its
input drafts the most). After a draft with nothing accepted it drafts nothing for 6 steps, then 14, 30 and
62 after more such drafts in a row, until one is accepted (a rejected draft makes a step that gives one token
cost more rows: on the CPU devices, about what two decode steps cost). A step where nothing was drafted stays
a decode step: free text with no match costs nothing. Every token must be read before its sequence drafts
again, so the engine runs steps one at a time (``ahead`` 0)."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import Protocol

from ..errors import ArgumentError
from ..models.speculative import Speculative, accepted, prompt_lookup
from .scheduler import Chunk, Scheduler, Sequence, StepKind, StepPlan, penalized

MAX_MISSES = 4
"""Drafts in a row with nothing accepted that lengthen a sequence's pause (at most 62 steps)."""


class Drafter(Protocol):
    """What drafts tokens: for each decode chunk, up to ``limits[i]`` tokens after its sequence's tokens
    (its prompt and output, every one read back)."""

    async def propose(self, chunks: Sequence_[Chunk], limits: Sequence_[int]) -> list[list[int]]: ...


class PromptLookup:
    """The prompt-lookup drafter (n-gram matches in the sequence's own tokens)."""

    def __init__(self, settings: Speculative) -> None:
        self.settings = settings

    async def propose(self, chunks: Sequence_[Chunk], limits: Sequence_[int]) -> list[list[int]]:
        low, high = self.settings.min_ngram, self.settings.max_ngram
        return [
            prompt_lookup(chunk.sequence.prompt + chunk.sequence.output, limit, low, high) if limit else []
            for chunk, limit in zip(chunks, limits)
        ]


class Speculator:
    """Verify steps for ``scheduler``'s decode steps (see the module), drafts from ``drafter``."""

    def __init__(self, scheduler: Scheduler, settings: Speculative, drafter: Drafter) -> None:
        self.scheduler, self.settings, self.drafter = scheduler, settings, drafter

    async def speculate(self, plan: StepPlan) -> StepPlan:
        """``plan`` as a verify step where its sequences drafted (their counts as if every drafted token were
        accepted, until :meth:`verified`); unchanged where it is not a decode step or nothing was drafted."""
        if plan.kind is not StepKind.DECODE or len(plan.chunks) > self.settings.max_batch:
            return plan
        limits = [self.limit(chunk) for chunk in plan.chunks]
        if not any(limits):
            return plan
        proposed = await self.drafter.propose(plan.chunks, limits)
        drafts = [
            allowed(chunk.sequence, tuple(tokens[:limit]))
            for chunk, limit, tokens in zip(plan.chunks, limits, proposed)
        ]
        if not any(drafts):
            return plan
        chunks = []
        for chunk, draft in zip(plan.chunks, drafts):
            sequence = chunk.sequence
            sequence.computed += len(draft)
            sequence.sampled += len(draft)
            count = 1 + len(draft)
            chunks.append(Chunk(sequence, chunk.start, count, chunk.draw, True, chunk.epoch, True, draft))
        return StepPlan(StepKind.VERIFY, chunks, sum(chunk.count for chunk in chunks))

    def limit(self, chunk: Chunk) -> int:
        """Tokens ``chunk``'s sequence may draft: 0 where it may not (penalties) or the pool has no
        block for its drafted rows; else its limit, within its ``max_tokens``."""
        sequence = chunk.sequence
        if penalized(sequence.params):
            return 0
        if sequence.draft_pause:
            sequence.draft_pause -= 1
            return 0
        limit = min(sequence.draft_limit or self.settings.tokens, sequence.params.max_tokens - sequence.sampled)
        if limit <= 0 or not self.scheduler.pool.grow(sequence.blocks, chunk.start + 1 + limit):
            return 0
        return limit

    def adapt(self, sequence: Sequence, drafted: int, accepted: int) -> None:
        """``sequence``'s next draft limit and pause after a draft of ``drafted`` tokens, ``accepted`` of them."""
        limit = sequence.draft_limit or self.settings.tokens
        sequence.draft_limit = min(self.settings.tokens, limit + 1) if accepted == drafted else accepted + 1
        sequence.draft_misses = 0 if accepted else min(sequence.draft_misses + 1, MAX_MISSES)
        sequence.draft_pause = (4 << sequence.draft_misses) - 2 if sequence.draft_misses else 0

    def verified(self, plan: StepPlan, samples: list[list[int]]) -> list[tuple[Sequence, list[int]]]:
        """Take a verify step's samples (per chunk, one per row): each current sequence's accepted tokens join
        its output, its counts and KV rows go back to them and its next draft's limit follows; returns the
        (sequence, tokens) pairs, in chunk order."""
        taken, stats = [], self.scheduler.stats
        for chunk, sampled in zip(plan.chunks, samples):
            sequence = chunk.sequence
            if not chunk.current:
                continue
            tokens = accepted(chunk.draft, sampled)
            sequence.output += tokens
            sequence.computed, sequence.sampled = chunk.start + len(tokens), chunk.draw + len(tokens)
            stats.drafted_tokens += len(chunk.draft)
            stats.accepted_tokens += len(tokens) - 1
            if chunk.draft:
                self.adapt(sequence, len(chunk.draft), len(tokens) - 1)
            if self.scheduler.prefix_caching:
                self.scheduler.register(sequence, sequence.computed)
            taken.append((sequence, tokens))
        return taken


def allowed(sequence: Sequence, draft: tuple[int, ...]) -> tuple[int, ...]:
    """``draft`` as far as ``sequence``'s grammar (where it has one) allows it: tokens the grammar forbids are
    never verified, so each row's mask is the grammar's state after the drafted tokens before it."""
    return sequence.guide.draftable(draft) if sequence.guide is not None and draft else draft


def check_speculative(settings: Speculative | None, ahead: int) -> None:
    """ArgumentError unless ``settings`` is None or a :class:`Speculative` with steps one at a time."""
    if settings is None:
        return
    if not isinstance(settings, Speculative):
        raise ArgumentError(f"Engine: speculative must be a Speculative, got {type(settings).__name__}")
    if ahead:
        raise ArgumentError(f"Engine: speculative decoding runs steps one at a time (ahead 0), got ahead={ahead}")


def verify_rows(settings: Speculative | None, max_batch: int) -> tuple[int, int]:
    """The rows of the largest verify step (every sequence that may draft, with all its drafted tokens), and
    up to how many rows every count has a step of its own (two sequences' drafts: a padded row costs what a
    drafted one does); (0, 0) without speculation."""
    if settings is None:
        return 0, 0
    return min(settings.max_batch, max_batch) * (settings.tokens + 1), 2 * (settings.tokens + 1)
