"""The engine's feed packing on the host (no device, no model): every plan a scheduler makes, packed into a
step's preallocated arrays (reused from step to step, only what changed fed) from the slots' persistent
rows, equals a straightforward packing chunk by chunk, array by array, for decode and mixed steps of
several sizes, idle rows, preemption, prompt logprobs and sampling parameters of every kind."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchgpu.llm import SamplingParams
from batchgpu.llm.blocks import BlockPool, pool_rows
from batchgpu.llm.feeds import SlotTable, StepFeeds, pack_decode, pack_mixed, wants_prompt_logprobs
from batchgpu.llm.scheduler import Chunk, Scheduler, StepKind, StepPlan
from batchgpu.llm.step import step_sizes

I32, F32, U32 = np.int32, np.float32, np.uint32
SCORING = 5  # scored rows per step at most (the scheduler's scoring_rows), below the budgets: pieces are cut


def input_shapes(*, rows: int, samples: int, slots: int, max_blocks: int, mixed: bool, scoring: int):
    """The inputs of :func:`batchgpu.llm.step.record_step` by name: (shape, dtype)."""
    sources = {"ids": ((rows,), I32), "sources": ((rows,), I32)} if mixed else {"token_slots": ((rows,), I32)}
    shapes = {
        **sources,
        "positions": ((rows,), I32),
        "kv_rows": ((rows,), I32),
        "seq": ((rows,), I32),
        "lengths": ((rows,), I32),
        "block_tables": ((samples, max_blocks), I32),
        "sample_rows": ((samples,), I32),
        "sample_slots": ((samples,), I32),
        "penalties": ((samples, 3), F32),
        "sampling": ((samples, 4), F32),
        "top_k": ((samples,), I32),
        "keys": ((samples, 2), U32),
        "sampled_slots": ((samples,), I32),
        "logprob_n": ((samples,), I32),
    }
    if mixed:
        shapes.update(count_slots=((rows,), I32), generated_slots=((rows,), I32), reset=((slots,), I32))
    if scoring:  # the scored rows
        shapes.update(score_rows=((scoring,), I32), prompt_targets=((scoring,), I32), prompt_n=((scoring,), I32))
    return {name: (shape, np.dtype(dtype)) for name, (shape, dtype) in shapes.items()}


# the packing chunk by chunk, on fresh arrays every step (the engine's before the preallocated arrays) ------

IDLE_NONE = ("kv_rows", "count_slots", "generated_slots", "sampled_slots", "logprob_n", "prompt_n", "prompt_targets")


def idle_feeds(shapes) -> dict[str, np.ndarray]:
    feeds = {name: np.zeros(shape, dtype) for name, (shape, dtype) in shapes.items()}
    for name in IDLE_NONE:
        if name in feeds:
            feeds[name][:] = -1
    feeds["sampling"][:, 1] = 1.0
    feeds["penalties"][:, 0] = 1.0
    return feeds


def mixed_feeds(shapes, chunks: list[Chunk], block_size: int, slots: int) -> dict[str, np.ndarray]:
    feeds = idle_feeds(shapes)
    start = scored = 0
    for index, chunk in enumerate(chunks):
        sequence = chunk.sequence
        rows = slice(start, start + chunk.count)
        positions = np.arange(chunk.start, chunk.start + chunk.count, dtype=np.int32)
        if chunk.decode:  # its token is the one the step before left in its slot
            assert chunk.count == 1 and chunk.start >= sequence.prefill_length
            feeds["sources"][rows] = sequence.slot
        else:
            feeds["ids"][rows] = sequence.token_ids(chunk.start, chunk.start + chunk.count)
            feeds["sources"][rows] = np.arange(slots + start, slots + start + chunk.count)
        feeds["positions"][rows] = positions
        feeds["kv_rows"][rows] = pool_rows(sequence.blocks, positions, block_size)
        feeds["seq"][rows] = index
        feeds["lengths"][rows] = positions + 1
        feeds["block_tables"][index, : len(sequence.blocks)] = sequence.blocks
        if not chunk.decode:  # a decode row's token was counted when it was sampled
            feeds["count_slots"][rows] = sequence.slot
            feeds["generated_slots"][rows] = np.where(positions >= len(sequence.prompt), sequence.slot, -1)
        if chunk.start == 0:
            feeds["reset"][sequence.slot] = 1
        sampling_feeds(feeds, index, chunk, row=start + chunk.count - 1)
        feeds["sampled_slots"][index] = sequence.slot if chunk.sampled else -1
        if "prompt_n" in feeds and wants_prompt_logprobs(chunk):  # its rows among the scored ones
            following = sequence.prompt[chunk.start + 1 : chunk.start + chunk.count + 1]
            feeds["score_rows"][scored : scored + chunk.count] = range(start, start + chunk.count)
            feeds["prompt_targets"][scored : scored + len(following)] = following
            feeds["prompt_n"][scored : scored + len(following)] = sequence.params.prompt_logprobs
            scored += chunk.count
        start += chunk.count
    assert scored <= shapes.get("score_rows", ((0,),))[0][0]
    return feeds


def decode_feeds(shapes, chunks: list[Chunk], rows: list[int], block_size: int) -> dict[str, np.ndarray]:
    feeds = idle_feeds(shapes)
    for row, chunk in zip(rows, chunks):
        sequence, position = chunk.sequence, chunk.start
        feeds["token_slots"][row] = sequence.slot
        feeds["positions"][row] = position
        feeds["kv_rows"][row] = pool_rows(sequence.blocks, position, block_size)
        feeds["seq"][row] = row
        feeds["lengths"][row] = position + 1
        feeds["block_tables"][row, : len(sequence.blocks)] = sequence.blocks
        sampling_feeds(feeds, row, chunk, row=row)
        feeds["sampled_slots"][row] = sequence.slot
    return feeds


def sampling_feeds(feeds: dict[str, np.ndarray], index: int, chunk: Chunk, *, row: int) -> None:
    sequence = chunk.sequence
    params = sequence.params
    feeds["sample_rows"][index] = row
    feeds["sample_slots"][index] = sequence.slot
    feeds["penalties"][index] = (params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    feeds["sampling"][index] = (params.temperature, params.top_p, params.min_p, 0.0)
    feeds["top_k"][index] = params.top_k
    feeds["keys"][index] = (sequence.seed, chunk.draw)
    if chunk.sampled and params.logprobs is not None:
        feeds["logprob_n"][index] = params.logprobs


# ---------------------------------------------------------------------------------------------------------


class Steps:
    """Per kind, row count and scoring, one :class:`StepFeeds` reused by every plan it runs, as the engine's
    StepRunner places plans (the smallest step that holds the rows; a full-width decode step by slot)."""

    def __init__(self, *, max_batch: int, max_step_tokens: int, max_blocks: int, block_size: int) -> None:
        self.max_batch, self.max_blocks, self.block_size = max_batch, max_blocks, block_size
        self.largest = {StepKind.DECODE: max_batch, StepKind.MIXED: max_step_tokens}
        self.feeds: dict[tuple[StepKind, int, bool], tuple[StepFeeds, dict]] = {}
        self.table = SlotTable(max_batch, max_blocks, block_size)

    def place(self, plan: StepPlan) -> tuple[StepFeeds, dict, list[int]]:
        size = next(size for size in step_sizes(self.largest[plan.kind]) if size >= plan.rows)
        mixed = plan.kind is StepKind.MIXED
        scoring = mixed and any(wants_prompt_logprobs(c) for c in plan.chunks)
        key = (plan.kind, size, scoring)
        if key not in self.feeds:
            samples = min(self.max_batch, size)
            shapes = input_shapes(
                rows=size, samples=samples, slots=self.max_batch, max_blocks=self.max_blocks, mixed=mixed,
                scoring=min(size, SCORING) if scoring else 0,
            )  # fmt: skip
            self.feeds[key] = (StepFeeds(shapes), shapes)
        feeds, shapes = self.feeds[key]
        if mixed:
            rows = list(range(len(plan.chunks)))
        else:
            rows = [c.sequence.slot for c in plan.chunks] if size == self.max_batch else list(range(len(plan.chunks)))
        return feeds, shapes, rows

    def check(self, plan: StepPlan) -> None:
        """Pack ``plan`` both ways; the arrays are equal, and exactly those that changed since the step's
        previous run are the ones fed."""
        feeds, shapes, rows = self.place(plan)
        before = {name: array.copy() for name, array in feeds.arrays.items()} if feeds.sent is not None else None
        if plan.kind is StepKind.MIXED:
            pack_mixed(feeds, self.table, plan.chunks)
            expected = mixed_feeds(shapes, plan.chunks, self.block_size, self.max_batch)
        else:
            pack_decode(feeds, self.table, plan.chunks, rows)
            expected = decode_feeds(shapes, plan.chunks, rows, self.block_size)
        assert feeds.arrays.keys() == expected.keys()
        for name, array in expected.items():
            np.testing.assert_array_equal(feeds.arrays[name], array, err_msg=f"{plan.kind.value} input {name}")
            assert feeds.arrays[name].dtype == array.dtype and feeds.arrays[name].shape == array.shape
        fed = feeds.changed()
        if before is None:
            assert fed.keys() == feeds.arrays.keys()
        else:
            assert set(fed) == {name for name in expected if not np.array_equal(before[name], expected[name])}
        feeds.ran()


def random_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        logprobs=rng.choice([None, 0, 3]),
        prompt_logprobs=rng.choice([None, None, 2]),
        ignore_eos=True,
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("max_batch", "chunk", "block_size", "blocks"), [(5, 7, 3, 40), (8, 16, 4, 24), (3, 4, 2, 16)])
def test_every_plan_packs_as_the_straightforward_packing_did(seed, max_batch, chunk, block_size, blocks) -> None:
    rng = random.Random(seed * 7919 + max_batch)
    context = 48
    pool = BlockPool(blocks, block_size)
    s = Scheduler(pool, max_batch=max_batch, max_context=context, max_step_tokens=chunk, scoring_rows=SCORING)
    steps = Steps(max_batch=max_batch, max_step_tokens=chunk, max_blocks=s.pool.needed(context), block_size=block_size)
    live, kinds, mixed_with_decode_rows = [], set(), 0
    for _ in range(160):
        if rng.random() < 0.25 and len(s.waiting) < 6:
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 19))]
            live.append(s.add(prompt, random_params(rng, rng.randrange(1, 14)), seed=rng.getrandbits(32)))
        if live and rng.random() < 0.05:
            s.finish(live.pop(rng.randrange(len(live))))  # cancelled: its rows leave the next steps
        plan = s.schedule()
        if plan is None:
            continue
        kinds.add((plan.kind, len(plan.chunks) < max_batch))
        mixed_with_decode_rows += plan.kind is StepKind.MIXED and any(c.decode for c in plan.chunks)
        steps.check(plan)
        for sequence, _ in s.update(plan, [rng.randrange(1, 1000) for _ in plan.chunks]):
            if len(sequence.output) >= sequence.params.max_tokens:
                s.finish(sequence)
                live.remove(sequence)
    assert {kind for kind, _ in kinds} == {StepKind.MIXED, StepKind.DECODE}
    assert mixed_with_decode_rows > 0  # mixed steps carried decode rows beside prompt pieces


def test_a_reused_step_keeps_nothing_of_a_larger_plan_before_it() -> None:
    """Four sequences prefill (16 rows) and decode in the 4-row step, then three others (other sampling
    parameters, shorter block tables, the same slots) prefill in the same 16-row step (12 rows) and decode in the same
    4-row step: every row the larger plans wrote and the smaller ones do not is idle again."""
    s = Scheduler(BlockPool(64, 2), max_batch=4, max_context=40, max_step_tokens=16, scoring_rows=SCORING)
    steps = Steps(max_batch=4, max_step_tokens=16, max_blocks=20, block_size=2)
    first = [s.add(list(range(1, 5 + 2 * i)), random_params(random.Random(i), 6), seed=11 + i) for i in range(4)]
    plans = []
    while not plans or plans[-1] != (StepKind.DECODE, 4):
        plan = s.schedule()
        assert plan is not None
        steps.check(plan)
        plans.append((plan.kind, plan.rows))
        s.update(plan, [5] * len(plan.chunks))
    assert plans[0] == (StepKind.MIXED, 16)
    for sequence in first:
        s.finish(sequence)
    params = SamplingParams(max_tokens=4, temperature=0.5, top_k=3, logprobs=2)
    second = [s.add([3, 4, 5, 6], params, seed=99 + i) for i in range(3)]
    plan = s.schedule()
    assert plan is not None and plan.kind is StepKind.MIXED and plan.rows == 12
    assert steps.place(plan)[0].sent is not None  # the 16-row mixed step that ran the first plan
    steps.check(plan)
    s.update(plan, [7, 8, 9])
    plan = s.schedule()
    assert plan is not None and plan.kind is StepKind.DECODE and [c.sequence for c in plan.chunks] == second
    feeds, _, rows = steps.place(plan)
    assert feeds.sent is not None  # it ran for the four first sequences: what they wrote must go
    steps.check(plan)
    idle = [row for row in range(4) if row not in rows]
    assert idle and (feeds.arrays["lengths"][idle] == 0).all() and (feeds.arrays["block_tables"][idle] == 0).all()


def test_only_changed_inputs_are_fed_and_a_failed_run_feeds_them_all_again() -> None:
    shapes = input_shapes(rows=4, samples=4, slots=4, max_blocks=3, mixed=False, scoring=False)
    feeds = StepFeeds(shapes)
    assert feeds.changed().keys() == shapes.keys()  # nothing ran yet: every input
    feeds.ran()
    assert feeds.changed() == {}
    feeds.arrays["positions"][2] = 7
    feeds.arrays["keys"][3, 1] = 5
    assert set(feeds.changed()) == {"positions", "keys"}
    feeds.ran()
    assert feeds.changed() == {}
    feeds.forget()  # a run failed: what the device holds is unknown
    assert feeds.changed().keys() == shapes.keys()
    np.testing.assert_array_equal(feeds.changed()["positions"], [0, 0, 7, 0])
