"""A recorded step's inputs on the host: one preallocated array per named input (:class:`StepFeeds`, views
of one buffer), a :class:`~batchgpu.llm.scheduler.StepPlan` packed into them, and only the inputs whose
values changed since the step's previous run fed to the batch (the others keep their values on the device).

A decode step whose rows hold the same sequences, in the same slots, as that step's previous run keeps its
arrays and rewrites only what moves every step: positions, KV rows, lengths, the draws of the sampling keys
and the block tables of sequences that took a block; any other change repacks the step from its idle
values. A prefill step is packed from its idle values every time."""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from .blocks import pool_row, pool_rows
from .grammar import fill_masks
from .scheduler import Chunk

IDLE_VALUES: dict[str, float] = {
    "kv_rows": -1,
    "count_slots": -1,
    "generated_slots": -1,
    "sampled_slots": -1,
    "logprob_n": -1,
    "prompt_n": -1,
    "prompt_targets": -1,
}
"""Inputs whose every element says "none" (no KV row written, no count, no logprobs) in an idle row; the
others are zero there, but for :data:`IDLE_COLUMNS`."""

IDLE_COLUMNS: dict[str, tuple[int, float]] = {"sampling": (1, 1.0), "penalties": (0, 1.0)}
"""Inputs with one column off at a value other than zero: top_p 1 and the repetition penalty 1."""


class StepFeeds:
    """The host arrays of a step's inputs (``shapes``: name -> (shape, dtype)), by name in ``arrays``: views
    of one buffer, so that resetting them to the idle values (:meth:`reset`) and finding those that changed
    since the last run (:meth:`changed`) are one numpy operation each. ``signature`` names what the arrays
    were last packed for (None: nothing reusable)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize for shape, dtype in shapes.values()]
        offsets = np.cumsum([0] + [-(-size // 8) * 8 for size in sizes])  # each array 8-byte aligned
        self.buffer = np.zeros(int(offsets[-1]), np.uint8)
        self.starts = offsets[:-1].astype(np.intp)
        self.arrays: dict[str, np.ndarray] = {}
        for (name, (shape, dtype)), start, size in zip(shapes.items(), self.starts, sizes):
            self.arrays[name] = self.buffer[start : start + size].view(dtype).reshape(shape)
        for name, value in IDLE_VALUES.items():
            if name in self.arrays:
                self.arrays[name][...] = value
        for name, (column, value) in IDLE_COLUMNS.items():
            if name in self.arrays:
                self.arrays[name][:, column] = value
        self.idle = self.buffer.copy()
        self.sent: np.ndarray | None = None  # the buffer as the step last ran with it (None: unknown)
        self.signature: Hashable | None = None
        self.rows = np.zeros(0, np.intp)  # the rows of the plan last packed (decode)
        self.tables: dict[int, list[int]] = {}  # block-table row -> the blocks written there (decode)

    def reset(self) -> dict[str, np.ndarray]:
        """Every array back to its idle values (no rows written, attended or counted, no logprobs)."""
        np.copyto(self.buffer, self.idle)
        self.signature = None
        self.tables.clear()
        return self.arrays

    def changed(self) -> dict[str, np.ndarray]:
        """The arrays whose values differ from the step's last run (all of them before the first)."""
        if self.sent is None:
            return dict(self.arrays)
        differs = np.logical_or.reduceat(self.buffer != self.sent, self.starts)
        return {name: array for (name, array), changed in zip(self.arrays.items(), differs) if changed}

    def ran(self) -> None:
        """The step ran with the current arrays: they are what its inputs hold now."""
        if self.sent is None:
            self.sent = self.buffer.copy()
        else:
            np.copyto(self.sent, self.buffer)

    def forget(self) -> None:
        """A run failed: what the inputs hold is unknown, so the next run feeds every array."""
        self.sent = None


def guided(chunk: Chunk) -> bool:
    """Whether ``chunk`` samples a real token under a grammar (its sequence's ``guide``)."""
    return chunk.sampled and chunk.sequence.guide is not None


def pack_masks(arrays: dict[str, np.ndarray], chunks: list[Chunk], samples: list[int]) -> None:
    """A masked step's grammar rows: sample ``samples[i]`` of a guided chunk ``i`` gets its guide's
    allowed-token bitmask (``allowed``) and the flag that applies it (``sampling[:, 3]``); the other rows keep
    theirs off, and so does a chunk whose sequence ended or was preempted since the plan (its token is
    dropped). Packing resets the flags with the rest (decode packing rewrites a row's sampling settings
    whenever its sequence changes)."""
    rows = [(chunk.sequence.guide, sample) for chunk, sample in zip(chunks, samples) if guided(chunk) and chunk.current]
    fill_masks(rows, arrays["allowed"])
    for _, sample in rows:
        arrays["sampling"][sample, 3] = 1.0


def wants_prompt_logprobs(chunk: Chunk) -> bool:
    """Whether ``chunk`` is a prompt piece whose sequence asks for its prompt's logprobs."""
    return chunk.sequence.params.prompt_logprobs is not None and chunk.start < len(chunk.sequence.prompt)


def pack_prefill(feeds: StepFeeds, chunks: list[Chunk], block_size: int) -> None:
    """A prefill step's inputs: each chunk's prompt piece a contiguous run of rows, in order; chunk ``i``
    samples from its last row (a real token only where its piece ends its prompt). A preempted sequence's
    prompt is its prompt and output: the output's rows count as generated tokens too."""
    arrays = feeds.reset()
    start = 0
    for index, chunk in enumerate(chunks):
        sequence = chunk.sequence
        rows = slice(start, start + chunk.count)
        positions = np.arange(chunk.start, chunk.start + chunk.count, dtype=np.int32)
        arrays["ids"][rows] = sequence.token_ids(chunk.start, chunk.start + chunk.count)
        arrays["positions"][rows] = positions
        arrays["kv_rows"][rows] = pool_rows(sequence.blocks, positions, block_size)
        arrays["seq"][rows] = index
        arrays["lengths"][rows] = positions + 1
        arrays["block_tables"][index, : len(sequence.blocks)] = sequence.blocks
        arrays["count_slots"][rows] = sequence.slot
        arrays["generated_slots"][rows] = np.where(positions >= len(sequence.prompt), sequence.slot, -1)
        if chunk.start == 0:  # (a prompt starting from prefix-cached blocks reads no counts: no penalties)
            arrays["reset"][sequence.slot] = 1
        pack_sample(arrays, index, chunk, row=start + chunk.count - 1)
        if "prompt_n" in arrays and wants_prompt_logprobs(chunk):
            pack_prompt_targets(arrays, rows, chunk)
        start += chunk.count


def pack_decode(feeds: StepFeeds, chunks: list[Chunk], rows: list[int], block_size: int) -> None:
    """A decode step's inputs: row ``rows[i]`` decodes chunk ``i``'s sequence at its position, from the token
    the step before left in its slot, and samples its next token (sample ``rows[i]``). Where the step's
    previous run served the same sequences in the same rows and slots (and epochs), only what moves is
    written (see the module)."""
    signature = (tuple(rows), tuple((c.sequence, c.sequence.slot, c.epoch, c.sampled) for c in chunks))
    if feeds.signature != signature:
        arrays = feeds.reset()
        for row, chunk in zip(rows, chunks):
            arrays["token_slots"][row] = chunk.sequence.slot  # its latest token, where the step before left it
            arrays["seq"][row] = row
            pack_sample(arrays, row, chunk, row=row)
        feeds.signature, feeds.rows = signature, np.array(rows, np.intp)
    arrays, index = feeds.arrays, feeds.rows
    positions = np.array([chunk.start for chunk in chunks], np.int32)
    arrays["positions"][index] = positions
    arrays["lengths"][index] = positions + 1
    arrays["kv_rows"][index] = [pool_row(c.sequence.blocks, c.start, block_size) for c in chunks]
    arrays["keys"][index, 1] = [chunk.draw for chunk in chunks]
    tables, written = arrays["block_tables"], feeds.tables
    for row, chunk in zip(rows, chunks):
        blocks = chunk.sequence.blocks
        if written.get(row) != blocks:
            tables[row] = 0
            tables[row, : len(blocks)] = blocks
            written[row] = list(blocks)


def pack_prompt_targets(arrays: dict[str, np.ndarray], rows: slice, chunk: Chunk) -> None:
    """A scoring prefill step's rows of ``chunk``: each row's target is the prompt token after it; the row of
    the prompt's last token has none (the sampled token's logprob is the first output's)."""
    sequence = chunk.sequence
    following = sequence.prompt[chunk.start + 1 : chunk.start + chunk.count + 1]
    first = rows.start or 0
    arrays["prompt_targets"][first : first + len(following)] = following
    arrays["prompt_n"][first : first + len(following)] = sequence.params.prompt_logprobs


def pack_sample(arrays: dict[str, np.ndarray], index: int, chunk: Chunk, *, row: int) -> None:
    """Sample ``index`` of a step: from ``row``'s logits, with its sequence's parameters, penalty counts
    (its slot's) and seeded key, counted for its slot where it is a real token."""
    sequence = chunk.sequence
    params = sequence.params
    arrays["sample_rows"][index] = row
    arrays["sample_slots"][index] = sequence.slot
    arrays["penalties"][index] = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    arrays["sampling"][index] = (params.temperature, params.top_p, params.min_p, 0.0)
    arrays["top_k"][index] = params.top_k
    arrays["keys"][index] = (sequence.seed, chunk.draw)
    arrays["sampled_slots"][index] = sequence.slot if chunk.sampled else -1
    if chunk.sampled and params.logprobs is not None:
        arrays["logprob_n"][index] = params.logprobs
