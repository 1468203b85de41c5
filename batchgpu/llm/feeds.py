"""A recorded step's inputs on the host: one preallocated array per named input (:class:`StepFeeds`, views
of one buffer), a :class:`~batchgpu.llm.scheduler.StepPlan` packed into them, and only the inputs whose
values changed since the step's previous run fed to the batch (the others keep their values on the device).

What a row needs of its sequence beyond its position and draw (the KV block table, the sampling settings,
the seed) lives in the engine's persistent per-slot arrays (:class:`SlotTable`, vLLM's persistent batch),
written when a sequence takes a slot or a block, so packing a step is a few numpy gathers by slot over
its rows, not a loop over sequences; only the rows of prompt pieces are written piece by piece."""

from __future__ import annotations

import numpy as np

from .grammar import fill_masks
from .params import SamplingParams
from .scheduler import Chunk, Sequence, scores_prompt

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

GREEDY = SamplingParams(temperature=0.0)
"""The sampling of a greedy :class:`SlotTable`'s rows."""

IDLE_COLUMNS: dict[str, tuple[int, float]] = {"sampling": (1, 1.0), "penalties": (0, 1.0)}
"""Inputs with one column off at a value other than zero: top_p 1 and the repetition penalty 1."""


class StepFeeds:
    """The host arrays of a step's inputs (``shapes``: name -> (shape, dtype)), by name in ``arrays``: views
    of one buffer, so that resetting them to the idle values (:meth:`reset`) and finding those that changed
    since the last run (:meth:`changed`) are one numpy operation each."""

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
        self.packed_for: tuple[list[int], list[tuple[Sequence, int]]] | None = None  # a decode step's rows, owners

    def reset(self) -> dict[str, np.ndarray]:
        """Every array back to its idle values (no rows written, attended or counted, no logprobs)."""
        np.copyto(self.buffer, self.idle)
        self.packed_for = None
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


class SlotTable:
    """Per slot, what every step's rows of the sequence holding it need besides their position and draw:
    its KV block table (``tables``, (slots, max_blocks)), its sampling settings as the steps take them
    (``penalties``, ``sampling``, ``top_k``, ``logprob_n``: -1 where it asks none) and its seed. Written when
    a sequence takes the slot or a block (:meth:`sync`); read by slot, many rows at once. ``greedy``: every
    sequence samples greedily, without penalties or logprobs, whatever it asked (a draft model's drafts)."""

    def __init__(self, slots: int, max_blocks: int, block_size: int, greedy: bool = False) -> None:
        self.block_size, self.greedy = block_size, greedy
        self.owners: list[tuple[Sequence, int] | None] = [None] * slots  # the sequence (and epoch) of each row
        self.lengths = [0] * slots  # blocks written in each slot's table row
        self.tables = np.zeros((slots, max_blocks), np.int32)
        self.penalties = np.zeros((slots, 3), np.float32)
        self.sampling = np.zeros((slots, 4), np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.logprob_n = np.full(slots, -1, np.int32)
        self.seeds = np.zeros(slots, np.uint32)

    def sync(self, chunks: list[Chunk]) -> np.ndarray:
        """Bring the rows of ``chunks``' sequences up to date (a new holder of a slot, a block taken);
        returns their slots, in chunk order."""
        slots = np.empty(len(chunks), np.intp)
        for index, chunk in enumerate(chunks):
            sequence = chunk.sequence
            slot = slots[index] = sequence.slot
            owner = (sequence, sequence.preemptions)
            if self.owners[slot] != owner:
                self.take(slot, sequence)
                self.owners[slot] = owner
            if self.lengths[slot] != len(sequence.blocks):
                self.tables[slot, : len(sequence.blocks)] = sequence.blocks
                self.lengths[slot] = len(sequence.blocks)
        return slots

    def take(self, slot: int, sequence: Sequence) -> None:
        """``sequence`` holds ``slot`` now: its settings and seed in the slot's rows, its table empty."""
        params = GREEDY if self.greedy else sequence.params
        self.penalties[slot] = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        self.sampling[slot] = (params.temperature, params.top_p, params.min_p, 0.0)
        self.top_k[slot] = params.top_k
        self.logprob_n[slot] = -1 if params.logprobs is None else params.logprobs
        self.seeds[slot] = sequence.seed
        self.tables[slot] = 0
        self.lengths[slot] = 0

    def kv_rows(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The pool rows of the tokens at ``positions`` of the sequences in ``slots``."""
        size = self.block_size
        return self.tables[slots, positions // size] * size + positions % size


def guided(chunk: Chunk) -> bool:
    """Whether ``chunk`` samples a real token under a grammar (its sequence's ``guide``)."""
    return chunk.sampled and chunk.sequence.guide is not None


def pack_masks(arrays: dict[str, np.ndarray], chunks: list[Chunk], samples: list[range]) -> None:
    """A masked step's grammar rows: the samples ``samples[i]`` of a guided chunk ``i`` get its guide's
    allowed-token bitmasks (``allowed``; a verify step's drafted chunk, one per row: the grammar's state after
    the drafted tokens before that row) and the flag that applies them (``sampling[:, 3]``); the other rows
    keep theirs off, and so does a chunk whose sequence ended or was preempted since the plan (its tokens are
    dropped). Packing resets the flags with the rest."""
    plain = []
    for chunk, rows in zip(chunks, samples):
        if not (guided(chunk) and chunk.current):
            continue
        if chunk.draft:
            chunk.sequence.guide.fill_draft(arrays["allowed"][rows.start : rows.stop], chunk.draft)
        else:
            plain.append((chunk.sequence.guide, rows.start))
        arrays["sampling"][rows.start : rows.stop, 3] = 1.0
    fill_masks(plain, arrays["allowed"])


def wants_prompt_logprobs(chunk: Chunk) -> bool:
    """Whether ``chunk`` is a prompt piece whose rows are scored (:func:`~batchgpu.llm.scheduler.scores_prompt`)."""
    return scores_prompt(chunk.sequence, chunk.start)


def pack_rows(
    arrays: dict[str, np.ndarray], table: SlotTable, chunks: list[Chunk], rows: np.ndarray, slots: np.ndarray
) -> None:
    """Rows ``rows[i]`` of one-row chunks ``chunks[i]`` (decode rows, sequences in ``slots``): each row's
    position, KV row, block table (table row ``rows[i]``) and attention length, and sample ``rows[i]``
    from that row with its sequence's settings and key, counted for its slot."""
    positions = np.fromiter([chunk.start for chunk in chunks], np.int32, len(chunks))
    arrays["positions"][rows] = positions
    arrays["lengths"][rows] = positions + 1
    arrays["kv_rows"][rows] = table.kv_rows(slots, positions)
    arrays["seq"][rows] = rows
    arrays["block_tables"][rows] = table.tables[slots]
    arrays["sample_rows"][rows] = rows
    pack_samples(arrays, table, rows, slots, *draws_of(chunks))


def draws_of(chunks: list[Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """The draws of ``chunks``' samples (their keys' second word) and whether each is a real token."""
    draws = np.fromiter([chunk.draw for chunk in chunks], np.uint32, len(chunks))
    return draws, np.fromiter([chunk.sampled for chunk in chunks], bool, len(chunks))


def pack_samples(
    arrays: dict[str, np.ndarray],
    table: SlotTable,
    samples: np.ndarray,
    slots: np.ndarray,
    draws: np.ndarray,
    counted: np.ndarray,
) -> None:
    """Samples ``samples[i]`` of the sequences in ``slots``: the sequence's settings, penalty counts (its
    slot's) and key (its seed, ``draws[i]``); with logprobs where asked; counted for its slot (and left as its
    latest token) where ``counted[i]``."""
    arrays["sample_slots"][samples] = slots
    arrays["penalties"][samples] = table.penalties[slots]
    arrays["sampling"][samples] = table.sampling[slots]
    arrays["top_k"][samples] = table.top_k[slots]
    arrays["keys"][samples, 0] = table.seeds[slots]
    arrays["keys"][samples, 1] = draws
    arrays["sampled_slots"][samples] = np.where(counted, slots, -1)
    arrays["logprob_n"][samples] = np.where(counted, table.logprob_n[slots], -1)


def pack_decode(feeds: StepFeeds, table: SlotTable, chunks: list[Chunk], rows: list[int]) -> None:
    """A decode step's inputs: row ``rows[i]`` decodes chunk ``i``'s sequence at its position, from the token
    the step before left in its slot, and samples its next token (sample ``rows[i]``); the other rows idle.
    Where the step last ran the same sequences (and epochs) in the same rows, only what moves each step is
    written: positions, lengths, KV rows, the draws and the block tables."""
    slots = table.sync(chunks)
    index = np.asarray(rows, np.intp)
    packed_for = (rows, [(chunk.sequence, chunk.epoch) for chunk in chunks])
    if feeds.packed_for != packed_for:
        arrays = feeds.reset()
        arrays["token_slots"][index] = slots
        pack_rows(arrays, table, chunks, index, slots)
        feeds.packed_for = packed_for
        return
    arrays = feeds.arrays
    positions = np.fromiter([chunk.start for chunk in chunks], np.int32, len(chunks))
    arrays["positions"][index] = positions
    arrays["lengths"][index] = positions + 1
    arrays["kv_rows"][index] = table.kv_rows(slots, positions)
    arrays["keys"][index, 1] = np.fromiter([chunk.draw for chunk in chunks], np.uint32, len(chunks))
    arrays["block_tables"][index] = table.tables[slots]


def pack_mixed(feeds: StepFeeds, table: SlotTable, chunks: list[Chunk]) -> None:
    """A mixed step's inputs: chunk ``i``'s rows a contiguous run, in order, sample ``i`` from its last row
    (a real token only where its piece ends its prompt). A decode chunk's one row reads its token where the
    step before left it (``sources``: its slot of the device's latest tokens); a prompt piece's rows read
    theirs from ``ids`` (``sources``: the slots' count + the row). A preempted sequence's prompt is its prompt
    and output: the output's rows count as generated tokens too."""
    arrays = feeds.reset()
    slots = table.sync(chunks)
    decode = sum(1 for chunk in chunks if chunk.decode)  # the plan's decode rows come first
    rows = np.arange(decode, dtype=np.intp)
    arrays["sources"][:decode] = slots[:decode]
    pack_rows(arrays, table, chunks[:decode], rows, slots[:decode])
    start, samples, scored = decode, np.arange(decode, len(chunks), dtype=np.intp), 0
    base = table.tables.shape[0]
    for index, chunk in enumerate(chunks[decode:], decode):
        pack_piece(arrays, table, chunk, index, start, base)
        if "score_rows" in arrays and wants_prompt_logprobs(chunk):
            pack_prompt_targets(arrays, start, scored, chunk)
            scored += chunk.count
        start += chunk.count
    pack_samples(arrays, table, samples, slots[decode:], *draws_of(chunks[decode:]))


def pack_verify(feeds: StepFeeds, table: SlotTable, chunks: list[Chunk]) -> list[range]:
    """A verify step's inputs: chunk ``i``'s rows a contiguous run, its sequence's latest token (read back) and
    its drafted tokens, all from ``ids``; every row samples (sample ``r`` from row ``r``, the key's draw one
    more per row), with logprobs where asked. A chunk that drafted counts none of its samples and leaves its
    slot's latest token as it was (the read puts the accepted one there:
    :meth:`~batchgpu.llm.step.StepRunner.put_tokens`); one that did not is a decode row. Returns each
    chunk's samples."""
    arrays = feeds.reset()
    slots = table.sync(chunks)
    counts = np.fromiter([chunk.count for chunk in chunks], np.intp, len(chunks))
    total, firsts = int(counts.sum()), np.cumsum(counts) - counts
    rows, index = np.arange(total, dtype=np.intp), np.repeat(np.arange(len(chunks), dtype=np.intp), counts)
    offsets = rows - firsts[index]  # each row's place in its chunk
    starts = np.fromiter([chunk.start for chunk in chunks], np.int32, len(chunks))
    positions = (starts[index] + offsets).astype(np.int32)
    row_slots = slots[index]
    arrays["ids"][:total] = [
        t for chunk in chunks for t in (chunk.sequence.token_ids(chunk.start, chunk.start + 1)[0], *chunk.draft)
    ]
    arrays["sources"][:total] = table.tables.shape[0] + rows
    arrays["positions"][:total] = positions
    arrays["lengths"][:total] = positions + 1
    arrays["kv_rows"][:total] = table.kv_rows(row_slots, positions)
    arrays["seq"][:total] = index
    arrays["block_tables"][: len(chunks)] = table.tables[slots]
    arrays["sample_rows"][:total] = rows
    draws, _ = draws_of(chunks)
    undrafted = np.fromiter([not chunk.draft for chunk in chunks], bool, len(chunks))
    pack_samples(arrays, table, rows, row_slots, draws[index] + offsets.astype(np.uint32), undrafted[index])
    arrays["logprob_n"][:total] = table.logprob_n[row_slots]  # every row's token is real
    return [range(first, first + count) for first, count in zip(firsts.tolist(), counts.tolist())]


def pack_piece(
    arrays: dict[str, np.ndarray], table: SlotTable, chunk: Chunk, index: int, start: int, base: int
) -> None:
    """The rows ``[start, start + count)`` of prompt piece ``chunk``, chunk ``index`` of its mixed step (its
    table row, its sample from its last row); ``base``: the slots' count (``sources`` of host ids)."""
    sequence, slot = chunk.sequence, chunk.sequence.slot
    rows = slice(start, start + chunk.count)
    positions = np.arange(chunk.start, chunk.start + chunk.count, dtype=np.int32)
    arrays["ids"][rows] = sequence.token_ids(chunk.start, chunk.start + chunk.count)
    arrays["sources"][rows] = np.arange(base + start, base + start + chunk.count, dtype=np.int32)
    arrays["positions"][rows] = positions
    arrays["kv_rows"][rows] = table.kv_rows(np.full(chunk.count, slot, np.intp), positions)
    arrays["seq"][rows] = index
    arrays["lengths"][rows] = positions + 1
    arrays["block_tables"][index] = table.tables[slot]
    arrays["count_slots"][rows] = slot
    arrays["generated_slots"][rows] = np.where(positions >= len(sequence.prompt), slot, -1)
    if chunk.start == 0:  # (a prompt starting from prefix-cached blocks reads no counts: no penalties)
        arrays["reset"][slot] = 1
    arrays["sample_rows"][index] = start + chunk.count - 1


def pack_prompt_targets(arrays: dict[str, np.ndarray], start: int, scored: int, chunk: Chunk) -> None:
    """A scoring step's rows of ``chunk`` (from row ``start``), scored rows ``scored`` on: each row's target is
    the prompt token after it; the row of the prompt's last token has none (the sampled token's logprob is
    the first output's)."""
    sequence = chunk.sequence
    following = sequence.prompt[chunk.start + 1 : chunk.start + chunk.count + 1]
    arrays["score_rows"][scored : scored + chunk.count] = np.arange(start, start + chunk.count, dtype=np.int32)
    arrays["prompt_targets"][scored : scored + len(following)] = following
    arrays["prompt_n"][scored : scored + len(following)] = sequence.params.prompt_logprobs
