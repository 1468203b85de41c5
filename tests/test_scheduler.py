"""The engine's scheduler on integers alone (no device, no model): admission under KV block pressure,
one token budget per step (every decode-ready sequence's row, then prompt pieces oldest first), a long
prompt beside short ones, the bookkeeping of steps planned ahead of their reads, and blocks returning to
the pool."""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgpu.errors import ArgumentError, RequestError, ShapeError
from batchgpu.llm import SamplingParams
from batchgpu.llm.blocks import BlockPool
from batchgpu.llm.scheduler import Scheduler, Sequence, SequenceState, StepPlan, scores_prompt

WAITING, PREEMPTED, PREFILLING, DECODING, FINISHED = (
    SequenceState.WAITING,
    SequenceState.PREEMPTED,
    SequenceState.PREFILLING,
    SequenceState.DECODING,
    SequenceState.FINISHED,
)


def scheduler(blocks: int = 64, block_size: int = 4, *, max_batch: int = 4, max_context: int = 64, budget: int = 8):
    pool = BlockPool(blocks, block_size)
    return Scheduler(pool, max_batch=max_batch, max_context=max_context, max_step_tokens=budget)


def add(s: Scheduler, prompt_tokens: int, max_tokens: int) -> Sequence:
    """A sequence whose prompt ids are 1, 2, ... (their values never matter to the scheduler)."""
    return s.add(list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=max_tokens), seed=7)


def shape(plan: StepPlan | None) -> tuple[str, list[tuple[int, int, int, bool]]] | None:
    """A plan as (kind, [(sequence id, first position, rows, samples a real token)])."""
    if plan is None:
        return None
    return plan.kind.value, [(c.sequence.id, c.start, c.count, c.sampled) for c in plan.chunks]


def token(sequence: Sequence, draw: int) -> int:
    """The token a test device samples: which sequence and which of its draws, readable from the value."""
    return 1000 * sequence.id + draw


def test_prompts_run_in_pieces_oldest_first_beside_every_decode_ready_row() -> None:
    s = scheduler(budget=8)
    a, b, c = add(s, 19, 2), add(s, 3, 2), add(s, 5, 2)
    plans = [s.schedule() for _ in range(6)]
    assert [shape(plan) for plan in plans] == [
        ("mixed", [(a.id, 0, 8, False)]),
        ("mixed", [(a.id, 8, 8, False)]),
        ("mixed", [(a.id, 16, 3, True), (b.id, 0, 3, True), (c.id, 0, 2, False)]),  # packed; c cut at 8 rows
        ("mixed", [(a.id, 19, 1, True), (b.id, 3, 1, True), (c.id, 2, 3, True)]),  # decode rows, then c's rest
        ("decode", [(c.id, 5, 1, True)]),  # a and b sample max_tokens in the steps submitted: none for them
        None,  # every token of every sequence is on its way: nothing to run until reads end them
    ]
    decode_rows = [[chunk.decode for chunk in plan.chunks] for plan in plans[2:5]]
    assert decode_rows == [[False] * 3, [True, True, False], [True]]
    assert [plan.rows for plan in plans[:5]] == [8, 8, 8, 5, 1]
    assert [seq.state for seq in (a, b, c)] == [DECODING] * 3
    assert (a.sampled, a.computed) == (2, 20)  # 19 prompt rows and its first token's


def test_a_long_prompt_does_not_stall_decoding_and_short_prompts_join_its_last_piece() -> None:
    """The decoding sequence has its row in every step; the long prompt takes what the budget leaves."""
    s = scheduler(budget=4)
    short = add(s, 2, 50)
    assert shape(s.schedule()) == ("mixed", [(short.id, 0, 2, True)])
    long = add(s, 17, 4)
    plans = [s.schedule() for _ in range(4)]
    late = add(s, 3, 4)  # arrives while the long prompt runs: packed beside its last piece
    plans += [s.schedule() for _ in range(3)]
    assert [shape(plan) for plan in plans] == [
        ("mixed", [(short.id, 2, 1, True), (long.id, 0, 3, False)]),
        ("mixed", [(short.id, 3, 1, True), (long.id, 3, 3, False)]),
        ("mixed", [(short.id, 4, 1, True), (long.id, 6, 3, False)]),
        ("mixed", [(short.id, 5, 1, True), (long.id, 9, 3, False)]),
        ("mixed", [(short.id, 6, 1, True), (long.id, 12, 3, False)]),
        ("mixed", [(short.id, 7, 1, True), (long.id, 15, 2, True), (late.id, 0, 1, False)]),
        ("mixed", [(short.id, 8, 1, True), (long.id, 17, 1, True), (late.id, 1, 2, True)]),
    ]
    assert shape(s.schedule()) == ("decode", [(short.id, 9, 1, True), (long.id, 18, 1, True), (late.id, 3, 1, True)])


def test_blocks_are_taken_as_sequences_grow() -> None:
    """4 blocks of 8 rows: three generations of 5 + 12, 5 + 12 and 1 + 1 tokens (7 blocks if reserved
    whole) all start at once, each with the block of its prompt; a sequence takes its next block when its
    rows cross into it."""
    s = scheduler(4, 8, max_batch=4, max_context=32, budget=16)
    first, second, small = add(s, 5, 12), add(s, 5, 12), add(s, 1, 1)
    plan = s.schedule()
    assert shape(plan) == ("mixed", [(first.id, 0, 5, True), (second.id, 0, 5, True), (small.id, 0, 1, True)])
    assert (first.blocks, second.blocks, small.blocks, s.pool.used) == ([0], [1], [2], 3)
    s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks])
    s.finish(small)  # its one token read
    for _ in range(3):  # positions 5, 6, 7: still the first block
        s.schedule()
    assert (first.blocks, second.blocks, s.pool.used) == ([0], [1], 2)
    assert shape(s.schedule()) == ("decode", [(first.id, 8, 1, True), (second.id, 8, 1, True)])
    assert (first.blocks, second.blocks, s.pool.used, s.stats.preemptions) == ([0, 2], [1, 3], 4, 0)


def test_the_newest_running_sequence_is_preempted_when_the_pool_runs_out() -> None:
    """3 blocks of 4 rows, two generations of 3 + 6 tokens (3 blocks each): the second, newer one gives
    its blocks to the first when the first crosses into its third block, and waits at the front of the
    queue (before a later arrival) with its output read so far; its tokens still on their way are dropped."""
    s = scheduler(3, 4, max_batch=4, max_context=16)
    a, b = add(s, 3, 6), add(s, 3, 6)
    plans = [s.schedule() for _ in range(3)]  # none read yet
    assert [shape(p) for p in plans] == [
        ("mixed", [(a.id, 0, 3, True), (b.id, 0, 3, True)]),
        ("decode", [(a.id, 3, 1, True), (b.id, 3, 1, True)]),
        ("decode", [(a.id, 4, 1, True)]),  # position 4: a second block each, one left: b preempted
    ]
    assert (a.blocks, b.blocks, s.pool.free) == ([0, 2], [], 1)
    assert (b.state, b.slot, b.preemptions, b.sampled, s.stats.preemptions) == (PREEMPTED, -1, 1, 0, 1)
    late = add(s, 2, 2)
    assert list(s.waiting) == [b, late]
    read = [s.update(p, [token(c.sequence, c.draw) for c in p.chunks]) for p in plans]
    assert read == [[(a, 0)], [(a, 1)], [(a, 2)]]  # b's tokens of the steps before its preemption dropped
    assert (a.output, b.output) == ([0, 1, 2], [])
    assert shape(s.schedule()) == ("mixed", [(a.id, 5, 1, True), (b.id, 0, 3, True)])  # b again (the free block)
    assert list(s.waiting) == [late]


def test_a_preempted_sequence_runs_its_prompt_and_output_again_and_goes_on_drawing() -> None:
    """Its prompt is then prompt + output read back; its next draw is the one the dropped steps sampled,
    with its own seed, so its tokens continue where they were read up to."""
    s = scheduler(3, 4, max_batch=2, max_context=16)
    a, b = add(s, 3, 5), add(s, 3, 6)
    for _ in range(4):
        plan = s.schedule()
        s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks])
    assert (b.state, b.output, b.resumed, b.prefill_length) == (PREEMPTED, [1000, 1001], 2, 5)
    while a.sampled < 5:  # a runs alone to its end
        plan = s.schedule()
        s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks])
    assert shape(s.schedule()) is None  # b waits: its 5 rows need 2 blocks, a holds 2 of the 3
    s.finish(a)
    plan = s.schedule()
    assert shape(plan) == ("mixed", [(b.id, 4, 1, True)])  # its first block, full and read, was cached
    assert plan.chunks[0].draw == 2 and b.token_ids(0, 5) == [1, 2, 3, 1000, 1001]
    s.update(plan, [token(b, 2)])
    while b.sampled < 6:
        plan = s.schedule()
        s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks])
    assert b.output == [token(b, d) for d in range(6)] and b.state is DECODING


def test_preempted_sequences_wait_in_arrival_order_ahead_of_later_ones() -> None:
    """Four running sequences all needing a block where one is left: the newest go first, newest first,
    until the oldest has its block; they resume oldest first."""
    s = scheduler(5, 2, max_batch=4, max_context=16)
    seqs = [add(s, 2, 4) for _ in range(4)]
    s.schedule()  # one prefill: a block each, one left
    late = add(s, 1, 1)
    plan = s.schedule()  # the decode row at position 2 needs a second block for each of them
    assert [c.sequence for c in plan.chunks] == seqs[:2]
    assert [seq.state for seq in seqs] == [DECODING, DECODING, PREEMPTED, PREEMPTED]
    assert list(s.waiting) == [seqs[2], seqs[3], late] and s.stats.preemptions == 2
    assert [seq.blocks for seq in seqs] == [[0, 4], [1, 3], [], []]


def test_prefix_cache_hits_skip_the_prefill_of_cached_blocks() -> None:
    """A prompt's full blocks are registered once the step writing them is read back; a later prompt
    with the same first tokens takes those blocks (shared: each held twice) and computes the rest; a
    prompt that is all full cached blocks still computes its last token (its logits give the first one)."""
    s = scheduler(16, 4, max_batch=4, max_context=32, budget=16)
    first = s.add(list(range(1, 12)), SamplingParams(max_tokens=2), seed=7)  # 11 tokens: 2 full blocks
    plan = s.schedule()
    assert s.pool.cached == 0  # not read back yet
    s.update(plan, [token(first, 0)])
    assert s.pool.cached == 2
    same_prefix = s.add([*range(1, 9), 50, 51, 52, 53, 54], SamplingParams(max_tokens=2), seed=7)
    whole = s.add(list(range(1, 9)), SamplingParams(max_tokens=2), seed=7)  # exactly the 2 cached blocks
    other = s.add([2, *range(2, 12)], SamplingParams(max_tokens=2), seed=7)  # its first token differs
    assert shape(s.schedule()) == (
        "mixed",
        [(first.id, 11, 1, True), (same_prefix.id, 8, 5, True), (whole.id, 4, 4, True), (other.id, 0, 6, False)],
    )
    assert same_prefix.blocks[:2] == first.blocks[:2] and whole.blocks[:1] == first.blocks[:1]
    assert [s.pool.refs(b) for b in first.blocks[:2]] == [3, 2]
    assert s.stats.prefix_cache_hit_tokens == 8 + 4
    assert s.stats.prompt_tokens_computed == 11 + 5 + 4 + 6
    for seq in (first, same_prefix, whole, other):
        s.finish(seq)
    assert s.pool.used == 0 and s.pool.free == 16


@pytest.mark.parametrize(
    "whole", [dict(presence_penalty=0.5), dict(prompt_logprobs=1)], ids=["penalized", "prompt_logprobs"]
)
def test_no_prefix_cache_for_requests_that_run_every_prompt_row_or_when_off(whole) -> None:
    """A penalty reads the slot's token counts, which the prefill of the prompt's rows builds, and a request
    for its prompt's logprobs reads every prompt row's logits: such a sequence computes its whole prompt;
    and an engine without prefix caching registers nothing."""
    s = scheduler(16, 4, budget=16)
    first = add(s, 9, 2)
    plan = s.schedule()
    s.update(plan, [token(first, 0)])
    computed = s.add(list(range(1, 10)), SamplingParams(max_tokens=2, **whole), seed=7)
    plain = add(s, 9, 2)
    assert shape(s.schedule()) == ("mixed", [(first.id, 9, 1, True), (computed.id, 0, 9, True), (plain.id, 8, 1, True)])
    off = scheduler(16, 4, budget=16)
    off.prefix_caching = False
    first = add(off, 9, 2)
    plan = off.schedule()
    off.update(plan, [token(first, 0)])
    again = add(off, 9, 2)
    assert shape(off.schedule()) == ("mixed", [(first.id, 9, 1, True), (again.id, 0, 9, True)])
    assert off.pool.cached == 0 and off.stats.prefix_cache_hit_tokens == 0


def test_unheld_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    """Free blocks without cached contents are handed out first; then the cached ones whose holders
    finished longest ago, and of one sequence its last blocks before its first (a shared prefix stays)."""
    s = scheduler(8, 2, max_batch=4, max_context=16, budget=16)
    older, newer = add(s, 4, 1), s.add([9, 8, 7, 6, 5], SamplingParams(max_tokens=1), seed=7)
    plan = s.schedule()
    s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks])
    assert (older.blocks, newer.blocks, s.pool.cached) == ([0, 1], [2, 3, 4], 4)
    s.finish(older)
    s.finish(newer)
    assert (s.pool.used, s.pool.free, s.pool.cached) == (0, 8, 4)
    taker = s.add([1, 2, 9, 9, 9, 9, 9], SamplingParams(max_tokens=1), seed=7)  # older's first block: a hit
    s.schedule()
    assert taker.blocks == [0, 4, 5, 6]  # its hit, then blocks that hold no cached tokens
    big = s.add([30, 31, 32, 33, 34, 35, 36], SamplingParams(max_tokens=1), seed=7)
    s.schedule()
    assert big.blocks == [7, 1, 3, 2]  # the last such block, then older's second, newer's second and first
    assert s.pool.lookup(older.hashes) == [0] and s.pool.cached == 1


def test_a_generation_that_fits_the_pool_alone_never_fails_nor_waits_forever() -> None:
    """Sequences each needing the whole pool (3 blocks) arrive together: they take turns, preempting one
    another, and every one ends with its own tokens."""
    s = scheduler(3, 4, max_batch=3, max_context=12)
    seqs = [add(s, 4, 8) for _ in range(3)]
    for _ in range(200):
        plan = s.schedule()
        if plan is None:
            break
        for seq, _ in s.update(plan, [token(c.sequence, c.draw) for c in plan.chunks]):
            if len(seq.output) == seq.params.max_tokens:
                s.finish(seq)
    assert [seq.output for seq in seqs] == [[token(seq, d) for d in range(8)] for seq in seqs]
    assert s.stats.preemptions > 0 and s.pool.used == 0


def test_slots_bound_the_running_sequences() -> None:
    s = scheduler(max_batch=2)
    sequences = [add(s, 3, 2) for _ in range(3)]
    s.schedule()
    assert [seq.state for seq in sequences] == [DECODING, DECODING, WAITING]
    assert s.slots == sequences[:2] and list(s.waiting) == sequences[2:]


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "param", "message"),
    [
        (0, 4, "prompt", "empty"),
        (20, 13, "prompt", "max_context"),
        (5, 20, "max_tokens", "need 4 KV blocks of 8 tokens; the cache has 3"),
    ],
)
def test_a_generation_that_can_never_run_is_refused_and_nothing_queued(prompt_tokens, max_tokens, param, message):
    s = scheduler(3, 8, max_context=32)
    with pytest.raises(RequestError, match=message) as refused:
        add(s, prompt_tokens, max_tokens)
    assert refused.value.param == param
    assert not s.waiting and s.schedule() is None and s.pool.used == 0
    assert shape(s.schedule()) is None
    fits = add(s, 5, 19)  # 24 rows: the 3 blocks exactly
    assert shape(s.schedule()) == ("mixed", [(fits.id, 0, 5, True)])


def test_tokens_planned_ahead_go_to_their_sequence_and_stop_with_it() -> None:
    """Steps planned before the previous ones' tokens are read: positions and draws advance as if each
    were read; a sequence that finishes meanwhile gets none of the tokens still on their way, and its
    slot and blocks serve the next sequence at once."""
    s = scheduler(budget=8)
    a, b = add(s, 3, 6), add(s, 2, 6)
    in_flight = [s.schedule() for _ in range(4)]  # a prefill and 3 decode steps, none read
    assert [shape(p) for p in in_flight] == [
        ("mixed", [(a.id, 0, 3, True), (b.id, 0, 2, True)]),
        ("decode", [(a.id, 3, 1, True), (b.id, 2, 1, True)]),
        ("decode", [(a.id, 4, 1, True), (b.id, 3, 1, True)]),
        ("decode", [(a.id, 5, 1, True), (b.id, 4, 1, True)]),
    ]
    assert [c.draw for p in in_flight for c in p.chunks if c.sequence is a] == [0, 1, 2, 3]
    first = in_flight.pop(0)
    assert s.update(first, [token(c.sequence, c.draw) for c in first.chunks]) == [(a, 0), (b, 1000)]
    b_blocks = list(b.blocks)
    s.finish(b)  # b stops at its first token (a stop string, say)
    c = add(s, 4, 2)
    assert shape(s.schedule()) == ("mixed", [(a.id, 6, 1, True), (c.id, 0, 4, True)])
    assert c.slot == 1 and c.blocks == b_blocks[:1]  # b's slot and first block
    for plan in in_flight:
        taken = s.update(plan, [token(ch.sequence, ch.draw) for ch in plan.chunks])
        assert [seq for seq, _ in taken] == [a]  # b's tokens on the way are dropped
    assert (a.output, b.output) == ([0, 1, 2, 3], [1000])


def test_update_needs_one_token_per_chunk() -> None:
    s = scheduler()
    add(s, 3, 2)
    plan = s.schedule()
    with pytest.raises(ShapeError, match="1 chunks, got 2 tokens"):
        s.update(plan, [1, 2])


def test_finishing_a_waiting_sequence_takes_it_out_of_the_queue() -> None:
    s = scheduler(max_batch=1)
    running, waiting = add(s, 3, 2), add(s, 3, 2)
    s.schedule()
    s.finish(waiting)
    s.finish(waiting)  # twice: harmless
    assert not s.waiting and waiting.state is FINISHED and running.state is DECODING and s.pool.used == 1


def test_a_sequence_waits_rather_than_preempting_itself_for_blocks_that_reads_will_free() -> None:
    """The newest sequence lacking a block, beside one whose every token is sampled (its reads end it):
    it waits a step instead of being preempted, then takes the block the other one gave back."""
    s = scheduler(2, 4, max_batch=2, max_context=8)
    done, newest = add(s, 4, 1), add(s, 3, 3)
    first = s.schedule()
    assert shape(first) == ("mixed", [(done.id, 0, 4, True), (newest.id, 0, 3, True)])
    assert shape(s.schedule()) == ("decode", [(newest.id, 3, 1, True)])
    assert s.schedule() is None and newest.state is DECODING and s.stats.preemptions == 0  # position 4: no block
    s.update(first, [token(c.sequence, c.draw) for c in first.chunks])
    s.finish(done)
    assert shape(s.schedule()) == ("decode", [(newest.id, 4, 1, True)]) and newest.blocks == [1, 0]


def test_parallel_samples_share_their_parents_full_prompt_blocks_and_compute_only_the_rest() -> None:
    """n = 4 samples of an 11-token prompt (blocks of 4): the parent runs the prompt; each child waits until
    the steps writing the parent's first 2 blocks are planned (a child may join the step that writes them:
    a step writes every row's keys and values before any row attends), takes them (refs 4), and runs only
    the last 3 prompt tokens in a block of its own: 11 + 3 * 3 prefill rows, not 4 * 11."""
    s = scheduler(64, 4, max_batch=4, budget=8)
    prompt = list(range(1, 12))
    parent = s.add(prompt, SamplingParams(max_tokens=2), seed=7)
    children = [s.add(prompt, SamplingParams(max_tokens=2), seed=7 + i, parent=parent) for i in (1, 2, 3)]
    b, c, d = children
    assert shape(s.schedule()) == ("mixed", [(parent.id, 0, 8, False)])
    assert [child.state for child in children] == [WAITING] * 3  # the step's budget is spent
    assert shape(s.schedule()) == ("mixed", [(parent.id, 8, 3, True), (b.id, 8, 3, True), (c.id, 8, 2, False)])
    assert [child.state for child in children] == [DECODING, PREFILLING, WAITING]
    assert shape(s.schedule()) == (
        "mixed",
        [(parent.id, 11, 1, True), (b.id, 11, 1, True), (c.id, 10, 1, True), (d.id, 8, 3, True)],
    )
    assert all(child.blocks[:2] == parent.blocks[:2] for child in children)
    assert [s.pool.refs(block) for block in parent.blocks] == [4, 4, 1]
    assert len({child.blocks[2] for child in children} | {parent.blocks[2]}) == 4  # the partial block: own
    assert s.stats.prompt_tokens_computed == 11 + 3 * 3 and s.stats.prefix_cache_hit_tokens == 3 * 8
    for sequence in (parent, *children):
        s.finish(sequence)
    assert s.pool.used == 0


def test_a_parallel_sample_runs_its_whole_prompt_where_it_cannot_share() -> None:
    """A child whose parent ended before it joined, or one whose penalties count every prompt token, runs
    its whole prompt (and does not wait for the parent)."""
    s = scheduler(64, 4, max_batch=4, budget=16)
    s.prefix_caching = False
    prompt = list(range(1, 12))
    parent = s.add(prompt, SamplingParams(max_tokens=2), seed=7)
    penalized = s.add(prompt, SamplingParams(max_tokens=2, presence_penalty=1.0), seed=8, parent=parent)
    assert shape(s.schedule()) == ("mixed", [(parent.id, 0, 11, True), (penalized.id, 0, 5, False)])
    orphan = s.add(prompt, SamplingParams(max_tokens=2), seed=9, parent=parent)
    s.finish(parent)
    assert shape(s.schedule()) == ("mixed", [(penalized.id, 5, 6, True), (orphan.id, 0, 10, False)])  # oldest first
    assert s.stats.prompt_tokens_computed == 11 + 11 + 10 and not set(orphan.blocks) & set(penalized.blocks)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_every_generation_runs_to_its_end_and_every_block_comes_back(data: st.DataObject) -> None:
    """Property: sequences of random sizes, some sharing prompt prefixes, arriving at random steps, some
    ending early, steps read 0-3 behind their plans, a pool from one whole generation's blocks to three
    (so sequences are preempted), prefix caching on or off. A model of the device's KV pool records what
    each planned step writes, in plan order (a device runs steps in submission order): every row a step
    attends holds its sequence's token at that position (written by its own steps, or by another's with
    the same prefix). Every decode-ready sequence has its row in the next step unless the pool lacks its
    next block; no step exceeds its budget. No block is held by more sequences than its count says; every
    sequence's output is its own tokens in order, up to max_tokens or where it ended; at the end the pool is
    whole again."""
    batch, block_size = data.draw(st.integers(1, 5), label="batch"), data.draw(st.integers(1, 5), label="block")
    budget = data.draw(st.integers(batch, 12), label="budget")
    whole = -(-24 // block_size)
    blocks = data.draw(st.integers(whole, 3 * whole), label="blocks")
    s = scheduler(blocks, block_size, max_batch=batch, max_context=24, budget=budget)
    s.scoring_rows = data.draw(st.integers(1, 12), label="scored rows")
    s.prefix_caching = data.draw(st.booleans(), label="prefix caching")
    ahead = data.draw(st.integers(0, 3), label="ahead")
    generation = st.tuples(st.integers(0, 20), st.integers(1, 12), st.integers(1, 12), st.integers(0, 3))
    arrivals = deque(sorted(data.draw(st.lists(generation, min_size=1, max_size=12), label="arrivals")))
    stops = {i: data.draw(st.integers(1, m), label=f"stop{i}") for i, (_, _, m, _) in enumerate(arrivals) if i % 3 == 0}
    sequences: list[Sequence] = []
    in_flight: deque[StepPlan] = deque()
    pool: dict[int, int] = {}  # the device's KV rows: the token each holds
    for step in range(2000):
        while arrivals and arrivals[0][0] <= step:
            _, prompt_tokens, max_tokens, family = arrivals.popleft()  # families 0 and 1 share prefixes
            if family == 3 and sequences:  # a parallel sample of the one before: its prompt blocks shared
                parent = sequences[-1].parent or sequences[-1]
                child = s.add(parent.prompt, SamplingParams(max_tokens=max_tokens), seed=7, parent=parent)
                sequences.append(child)
                continue
            first = 100 * family if family < 2 else 100 * (2 + len(sequences))  # others: a prompt of its own
            prompt = list(range(first + 1, first + prompt_tokens + 1))
            scored = 1 if prompt_tokens % 3 == 0 else None  # its prompt's logprobs: it runs every prompt row
            sequences.append(s.add(prompt, SamplingParams(max_tokens=max_tokens, prompt_logprobs=scored), seed=7))
        ready = [seq for seq in s.running() if seq.wants_token]
        plan = s.schedule() if len(in_flight) <= ahead else None
        if plan is not None:
            check_plan(s, plan, pool)
            decoded = {chunk.sequence for chunk in plan.chunks if chunk.decode}
            left_out = [seq for seq in ready if seq.state is DECODING and seq not in decoded]
            assert all(len(seq.blocks) * block_size == seq.computed for seq in left_out)  # only those lacking a block
            in_flight.append(plan)
        elif in_flight:
            done = in_flight.popleft()
            for seq, _ in s.update(done, [token(c.sequence, c.draw) for c in done.chunks]):
                if len(seq.output) in (seq.params.max_tokens, stops.get(seq.id)):
                    s.finish(seq)
        elif not arrivals:
            break
    assert not arrivals and not in_flight and not s.unfinished()
    assert s.pool.used == 0 and s.pool.free == s.pool.blocks and s.slots == [None] * s.max_batch
    for seq in sequences:
        expected = min(seq.params.max_tokens, stops.get(seq.id, seq.params.max_tokens))
        assert seq.state is FINISHED and seq.output == [token(seq, d) for d in range(expected)]


def true_token(seq: Sequence, position: int) -> int:
    """The token at ``position`` of ``seq``: its prompt's, then those the test device samples for it."""
    return seq.prompt[position] if position < len(seq.prompt) else token(seq, position - len(seq.prompt))


def check_plan(s: Scheduler, plan: StepPlan, pool: dict[int, int]) -> None:
    """The invariants of one plan and of the pool after it (see the property test); writes the plan's
    rows into the model ``pool`` (every row's, as a step writes every key and value before any row attends)
    and checks the rows each chunk attends."""
    running = s.running()
    holders = Counter(block for seq in running for block in seq.blocks)
    assert all(s.pool.refs(block) == count for block, count in holders.items())
    assert len(holders) == s.pool.used
    for seq in running:
        assert seq.state in (PREFILLING, DECODING) and len(seq.blocks) * s.pool.block_size >= seq.computed
    assert 1 <= plan.rows == sum(chunk.count for chunk in plan.chunks) <= s.max_step_tokens
    assert sum(chunk.count for chunk in plan.chunks if scores_prompt(chunk.sequence, chunk.start)) <= s.scoring_rows
    assert len({chunk.sequence for chunk in plan.chunks}) == len(plan.chunks)
    decode = [chunk.decode for chunk in plan.chunks]
    assert decode == sorted(decode, reverse=True)  # decode rows first
    assert (plan.kind.value == "decode") == all(decode)
    for chunk in plan.chunks:
        seq = chunk.sequence
        assert seq in running and chunk.count >= 1 and chunk.draw < seq.params.max_tokens
        assert chunk.epoch == seq.preemptions
        if chunk.decode:
            assert chunk.count == 1 and chunk.start == len(seq.prompt) + chunk.draw - 1 and chunk.sampled
        else:
            assert chunk.sampled == (chunk.start + chunk.count == seq.prefill_length)
            assert chunk.draw == seq.resumed
        for position in range(chunk.start, chunk.start + chunk.count):
            pool[s.pool.row(seq.blocks, position)] = true_token(seq, position)
    for chunk in plan.chunks:
        seq, end = chunk.sequence, chunk.start + chunk.count
        assert [pool.get(s.pool.row(seq.blocks, p)) for p in range(end)] == [true_token(seq, p) for p in range(end)]


@pytest.mark.parametrize("budget", [3, 0, 2.5, True, None])
def test_a_step_budget_below_max_batch_is_refused(budget) -> None:
    message = f"max_step_tokens must be an int of at least max_batch \\(4\\).*{budget!r}"
    with pytest.raises(ArgumentError, match=message):
        scheduler(max_batch=4, budget=budget)


def test_scored_prompt_rows_are_bounded_per_step_beside_the_rest_of_the_budget() -> None:
    """A step scores (computes the logprobs of) at most ``scoring_rows`` prompt rows, the head's rows x vocab
    logits, whatever its budget: a prompt that asks for its logprobs runs in pieces of at most that many
    rows, the rest of the budget going to prompts that do not ask; admission stays in arrival order (a
    scoring prompt waiting for scored rows holds those behind it)."""
    s = Scheduler(BlockPool(64, 4), max_batch=4, max_context=64, max_step_tokens=16, scoring_rows=5)
    scored = s.add(list(range(1, 13)), SamplingParams(max_tokens=2, prompt_logprobs=1), seed=7)
    also = s.add(list(range(1, 4)), SamplingParams(max_tokens=2, prompt_logprobs=0), seed=7)
    plain = add(s, 20, 2)
    plans = [shape(s.schedule()) for _ in range(3)]
    assert plans == [
        ("mixed", [(scored.id, 0, 5, False)]),
        ("mixed", [(scored.id, 5, 5, False)]),
        ("mixed", [(scored.id, 10, 2, True), (also.id, 0, 3, True), (plain.id, 0, 11, False)]),
    ]
    assert shape(s.schedule()) == ("mixed", [(scored.id, 12, 1, True), (also.id, 3, 1, True), (plain.id, 11, 9, True)])
