"""A draft model for the engine's speculative decoding (:class:`~batchgpu.models.speculative.Speculative`
``method="draft"``): another model's file with the same vocabulary, on the same device, drafting greedily.
Its KV cache has the target's block layout, so every sequence's block table serves both models (the
speculator grows a sequence's blocks for its drafted rows before drafting); it keeps, per sequence, which of
the sequence's tokens its own KV rows hold, and computes only the rest.

A draft of up to k tokens for a group of sequences is one step of the draft model over each sequence's
tokens it has not seen (the first time, its whole prompt and output; then the tokens accepted since, about
two), which samples the first drafted token, then k - 1 decode steps, each read before the next (greedy
tokens feed the next step on the device)."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from pathlib import Path
from typing import Any

import numpy as np

from ..device import Device
from ..errors import ArgumentError
from ..models.llama import load_model
from ..models.speculative import Speculative
from .scheduler import Chunk, Sequence, SequenceState, StepKind, StepPlan
from .step import KVCache, StepRunner


class DraftModel:
    """The drafter of ``settings.draft`` for an engine of ``vocab`` tokens whose KV pool has ``blocks`` blocks of
    ``block_size`` rows for ``max_batch`` slots, on ``device`` (see the module)."""

    def __init__(
        self,
        device: Device,
        settings: Speculative,
        *,
        vocab: int,
        max_context: int,
        quantized: bool,
        kv_dtype: Any,
        blocks: int,
        block_size: int,
        max_batch: int,
        max_step_tokens: int,
    ) -> None:
        assert settings.draft is not None
        self.config, _, weights = load_model(
            device, Path(settings.draft), max_context, quantized=quantized, fuse=True, what="the draft model"
        )
        if self.config.vocab != vocab:
            raise ArgumentError(
                f"the draft model's vocabulary has {self.config.vocab} tokens, the engine's model {vocab}: "
                "speculative decoding needs the same vocabulary"
            )
        cache = KVCache.allocate(
            device, self.config, blocks=blocks, block_size=block_size, slots=max_batch, dtype=np.dtype(kv_dtype)
        )
        self.runner = StepRunner(
            device, self.config, weights, cache, max_batch=max_batch, max_step_tokens=max_step_tokens,
            max_blocks=-(-max_context // block_size), greedy=True,
        )  # fmt: skip
        self.budget = max_step_tokens
        self.held: dict[Sequence, tuple[int, int, tuple[int, ...]]] = {}  # (epoch, tokens, drafted) in its KV

    async def propose(self, chunks: Sequence_[Chunk], limits: Sequence_[int]) -> list[list[int]]:
        """Up to ``limits[i]`` greedy tokens after each chunk's sequence's tokens."""
        drafting = [(chunk.sequence, limit) for chunk, limit in zip(chunks, limits) if limit]
        drafts: dict[Sequence, list[int]] = {sequence: [] for sequence, _ in drafting}
        for sequence, token in await self.catch_up([sequence for sequence, _ in drafting]):
            drafts[sequence].append(token)
        for _ in range(max(limit for _, limit in drafting) - 1):
            more = [sequence for sequence, limit in drafting if len(drafts[sequence]) < limit]
            for sequence, token in await self.decode(more, drafts):
                drafts[sequence].append(token)
        for sequence, _ in drafting:
            tokens = sequence.prompt + sequence.output
            self.held[sequence] = (sequence.preemptions, len(tokens), tuple(drafts[sequence][:-1]))
        self.forget()
        return [drafts.get(chunk.sequence, []) for chunk in chunks]

    def known(self, sequence: Sequence, tokens: list[int]) -> int:
        """How many of ``tokens`` (``sequence``'s, now) the draft KV holds: those it held, and of the drafted
        tokens it ran then, those the target accepted."""
        epoch, count, drafted = self.held.get(sequence, (-1, 0, ()))
        if epoch != sequence.preemptions:
            return 0
        matching = 0
        while (
            matching < len(drafted) and count + matching < len(tokens) and tokens[count + matching] == drafted[matching]
        ):
            matching += 1
        return count + matching

    async def catch_up(self, sequences: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Steps over each sequence's tokens the draft KV lacks (at least its last, whose logits give the first
        drafted token), in pieces of the engine's budget; returns each sequence's first drafted token."""
        pending = {}
        for sequence in sequences:
            tokens = sequence.prompt + sequence.output
            pending[sequence] = min(self.known(sequence, tokens), len(tokens) - 1)
        firsts = []
        while pending:
            chunks, budget = [], self.budget
            for sequence, start in list(pending.items()):
                end = len(sequence.prompt) + len(sequence.output)
                count = min(end - start, budget)
                if count <= 0:
                    break
                chunks.append(Chunk(sequence, start, count, 0, start + count == end, sequence.preemptions))
                budget -= count
                pending[sequence] = start + count
                if start + count == end:
                    del pending[sequence]
            tokens = await self.run(StepPlan(StepKind.MIXED, chunks, sum(c.count for c in chunks)))
            firsts += [(chunk.sequence, token) for chunk, token in zip(chunks, tokens) if chunk.sampled]
        return firsts

    async def decode(self, sequences: list[Sequence], drafts: dict[Sequence, list[int]]) -> list[tuple[Sequence, int]]:
        """One decode step of the draft model: each sequence's next greedy token after its drafts so far (the
        latest one on the device, where the step before left it)."""
        chunks = []
        for sequence in sequences:
            position = len(sequence.prompt) + len(sequence.output) + len(drafts[sequence]) - 1
            chunks.append(Chunk(sequence, position, 1, 0, True, sequence.preemptions, True))
        tokens = await self.run(StepPlan(StepKind.DECODE, chunks, len(chunks)))
        return list(zip(sequences, tokens))

    async def run(self, plan: StepPlan) -> list[int]:
        """Run ``plan`` on the draft model and read its tokens (one per chunk)."""
        samples = await self.runner.run(plan).read_async()
        return [tokens[0] for tokens in samples]

    def forget(self) -> None:
        """Drop what it holds of sequences that ended."""
        for sequence in [s for s in self.held if s.state is SequenceState.FINISHED]:
            del self.held[sequence]
