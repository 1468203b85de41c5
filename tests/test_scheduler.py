"""The engine's scheduler on integers alone (no device, no model): admission under KV block pressure,
the order of chunked prefill, prefill and decode steps taking turns, a long prompt beside short ones,
the bookkeeping of steps planned ahead of their reads, and blocks returning to the pool."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchgpu.errors import RequestError, ShapeError
from batchgpu.llm import SamplingParams
from batchgpu.llm.blocks import BlockPool
from batchgpu.llm.scheduler import Scheduler, Sequence, SequenceState, StepPlan

WAITING, PREFILLING, DECODING, FINISHED = (
    SequenceState.WAITING,
    SequenceState.PREFILLING,
    SequenceState.DECODING,
    SequenceState.FINISHED,
)


def scheduler(blocks: int = 64, block_size: int = 4, *, max_batch: int = 4, max_context: int = 64, chunk: int = 8):
    return Scheduler(BlockPool(blocks, block_size), max_batch=max_batch, max_context=max_context, prefill_chunk=chunk)


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


def test_prompts_run_in_chunks_in_slot_order_then_decode_and_prefill_take_turns() -> None:
    s = scheduler(chunk=8)
    a, b, c = add(s, 19, 2), add(s, 3, 2), add(s, 5, 2)
    plans = [shape(s.schedule()) for _ in range(7)]
    assert plans == [
        ("prefill", [(a.id, 0, 8, False)]),
        ("prefill", [(a.id, 8, 8, False)]),  # nothing decodes yet: prefill again
        ("prefill", [(a.id, 16, 3, True), (b.id, 0, 3, True), (c.id, 0, 2, False)]),  # packed; c cut at 8 rows
        ("decode", [(a.id, 19, 1, True), (b.id, 3, 1, True)]),  # its turn
        ("prefill", [(c.id, 2, 3, True)]),
        ("decode", [(c.id, 5, 1, True)]),  # a and b sample max_tokens in the steps submitted: none for them
        None,  # every token of every sequence is on its way: nothing to run until reads end them
    ]
    assert [seq.state for seq in (a, b, c)] == [DECODING] * 3
    assert (a.sampled, a.prefilled, a.length) == (2, 19, 20)


def test_a_long_prompt_does_not_stall_decoding_and_short_prompts_join_its_last_chunk() -> None:
    s = scheduler(chunk=4)
    short = add(s, 2, 50)
    assert shape(s.schedule()) == ("prefill", [(short.id, 0, 2, True)])
    long = add(s, 17, 4)
    plans = [s.schedule() for _ in range(8)]
    late = add(s, 3, 4)  # arrives while the long prompt runs: packed beside its last piece
    plans += [s.schedule() for _ in range(3)]
    kinds = [plan.kind.value for plan in plans]
    assert kinds == ["decode", "prefill"] * 5 + ["decode"]  # the decoding sequence runs every other step
    assert [shape(p)[1] for p in plans if p.kind.value == "prefill"] == [
        [(long.id, 0, 4, False)],
        [(long.id, 4, 4, False)],
        [(long.id, 8, 4, False)],
        [(long.id, 12, 4, False)],
        [(long.id, 16, 1, True), (late.id, 0, 3, True)],
    ]
    assert shape(plans[-1]) == ("decode", [(short.id, 7, 1, True), (long.id, 17, 1, True), (late.id, 3, 1, True)])


def test_admission_waits_for_blocks_oldest_first() -> None:
    """4 blocks of 8 rows: a 5 + 12-token generation holds 3, so the next one waits, and a small one behind
    it waits too (first come, first served); finishing the first admits both."""
    s = scheduler(4, 8, max_batch=4, max_context=32)
    first, second, small = add(s, 5, 12), add(s, 5, 12), add(s, 1, 1)
    plan = s.schedule()
    assert shape(plan) == ("prefill", [(first.id, 0, 5, True)])
    assert [seq.state for seq in (first, second, small)] == [DECODING, WAITING, WAITING]
    assert (s.pool.used, s.pool.free, first.blocks) == (3, 1, [0, 1, 2])
    s.finish(first)
    assert (first.state, first.slot, first.blocks, s.pool.used) == (FINISHED, -1, [], 0)
    assert shape(s.schedule()) == ("prefill", [(second.id, 0, 5, True), (small.id, 0, 1, True)])
    assert (second.slot, small.slot, s.pool.used) == (0, 1, 4)


def test_slots_bound_the_running_sequences() -> None:
    s = scheduler(max_batch=2)
    sequences = [add(s, 3, 2) for _ in range(3)]
    s.schedule()
    assert [seq.state for seq in sequences] == [DECODING, DECODING, WAITING]
    assert s.slots == sequences[:2] and list(s.waiting) == sequences[2:]


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "param", "message"),
    [(0, 4, "prompt", "empty"), (20, 13, "prompt", "max_context"), (5, 20, "max_tokens", "needs 4 KV blocks")],
)
def test_a_generation_that_can_never_run_is_refused_and_nothing_queued(prompt_tokens, max_tokens, param, message):
    s = scheduler(3, 8, max_context=32)
    with pytest.raises(RequestError, match=message) as refused:
        add(s, prompt_tokens, max_tokens)
    assert refused.value.param == param
    assert not s.waiting and s.schedule() is None and s.pool.used == 0
    assert shape(s.schedule()) is None
    fits = add(s, 5, 19)  # 24 rows: the 3 blocks exactly
    assert shape(s.schedule()) == ("prefill", [(fits.id, 0, 5, True)])


def test_tokens_planned_ahead_go_to_their_sequence_and_stop_with_it() -> None:
    """Steps planned before the previous ones' tokens are read: positions and draws advance as if each
    were read; a sequence that finishes meanwhile gets none of the tokens still on their way, and its
    slot and blocks serve the next sequence at once."""
    s = scheduler(chunk=8)
    a, b = add(s, 3, 6), add(s, 2, 6)
    in_flight = [s.schedule() for _ in range(4)]  # a prefill and 3 decode steps, none read
    assert [shape(p) for p in in_flight] == [
        ("prefill", [(a.id, 0, 3, True), (b.id, 0, 2, True)]),
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
    assert shape(s.schedule()) == ("prefill", [(c.id, 0, 4, True)])
    assert c.slot == 1 and c.blocks == b_blocks  # b's slot and blocks
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
    assert not s.waiting and waiting.state is FINISHED and running.state is DECODING and s.pool.used == 2


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_generation_runs_to_its_end_and_every_block_comes_back(data: st.DataObject) -> None:
    """Property: sequences of random sizes arriving at random steps, some ending early, steps read 0-3
    behind their plans. At every step no block is held twice, each running sequence holds blocks for its
    whole generation and runs its prompt in order; every sequence's draws are 0, 1, 2, ... and its output
    is its own tokens in order, up to max_tokens or where it ended; at the end the pool is whole again."""
    chunk, block_size = data.draw(st.integers(1, 9), label="chunk"), data.draw(st.integers(1, 5), label="block")
    s = scheduler(40, block_size, max_batch=data.draw(st.integers(1, 5), label="batch"), max_context=24, chunk=chunk)
    ahead = data.draw(st.integers(0, 3), label="ahead")
    generation = st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(1, 12))  # arrival step, sizes
    arrivals = deque(sorted(data.draw(st.lists(generation, min_size=1, max_size=12), label="arrivals")))
    stops = {i: data.draw(st.integers(1, m), label=f"stop{i}") for i, (*_, m) in enumerate(arrivals) if i % 3 == 0}
    sequences: list[Sequence] = []
    in_flight: deque[StepPlan] = deque()
    covered: dict[int, int] = {}  # prompt rows planned per sequence, in order
    draws: dict[int, list[int]] = {}
    for step in range(1000):
        while arrivals and arrivals[0][0] <= step:
            _, prompt_tokens, max_tokens = arrivals.popleft()
            sequences.append(add(s, prompt_tokens, max_tokens))
        plan = s.schedule() if len(in_flight) <= ahead else None
        if plan is not None:
            check_plan(s, plan, covered, draws)
            in_flight.append(plan)
        elif in_flight:
            done = in_flight.popleft()
            for seq, _ in s.update(done, [token(c.sequence, c.draw) for c in done.chunks]):
                if len(seq.output) in (seq.params.max_tokens, stops.get(seq.id)):
                    s.finish(seq)
        elif not arrivals:
            break
    assert not arrivals and not in_flight and not s.unfinished()
    assert s.pool.used == 0 and s.slots == [None] * s.max_batch
    for seq in sequences:
        expected = min(seq.params.max_tokens, stops.get(seq.id, seq.params.max_tokens))
        assert seq.state is FINISHED and seq.output == [token(seq, d) for d in range(expected)]
        assert draws[seq.id] == list(range(len(draws[seq.id])))


def check_plan(s: Scheduler, plan: StepPlan, covered: dict[int, int], draws: dict[int, list[int]]) -> None:
    """The invariants of one plan and of the pool after it (see the property test)."""
    running = s.running()
    held = [block for seq in running for block in seq.blocks]
    assert len(held) == len(set(held)) == s.pool.used
    for seq in running:
        assert len(seq.blocks) * s.pool.block_size >= len(seq.prompt) + seq.params.max_tokens
    assert 1 <= plan.rows <= (s.prefill_chunk if plan.kind.value == "prefill" else s.max_batch)
    for chunk in plan.chunks:
        seq = chunk.sequence
        assert seq in running and chunk.count >= 1 and chunk.draw < seq.params.max_tokens
        if plan.kind.value == "prefill":
            assert chunk.start == covered.get(seq.id, 0)
            covered[seq.id] = chunk.start + chunk.count
            assert chunk.sampled == (covered[seq.id] == len(seq.prompt))
        else:
            assert chunk.count == 1 and chunk.start == len(seq.prompt) + chunk.draw - 1
        if chunk.sampled:
            draws.setdefault(seq.id, []).append(chunk.draw)
