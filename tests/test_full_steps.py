"""Full steps through the whole engine (a synthetic tiny Llama on the reference executor): every step carries
every sequence ready to decode beside the prompt pieces its budget holds, so a crowd that arrives together
finishes in the steps its tokens need (issue 39's bound: max_tokens + ceil(prompt tokens / (budget - crowd))
+ 4), each decode-ready sequence has its row in every step, the step counts and their rows reach the
engine's stats, and each request's greedy ids equal its ids alone."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")

CROWD, TOKENS, BUDGET = 64, 48, 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    from batchgpu.models.synth import write_synthetic

    path: Path = write_synthetic(tmp_path_factory.mktemp("full") / "tiny.gguf", "tiny-llama", "q8_0", show=False).path
    return Engine(path, bg.Device("reference"), max_batch=CROWD, max_context=160, max_step_tokens=BUDGET,
                  kv_blocks=CROWD * 10)  # fmt: skip


def prompts(seed: int, count: int = CROWD) -> list[list[int]]:
    """Distinct prompts of 50-100 token ids (no prefix cache hits between them)."""
    rng = random.Random(seed)
    return [[rng.randrange(16, 256) for _ in range(rng.randint(50, 100))] for _ in range(count)]


def greedy(tokens: int = TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


async def crowd(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    async def one(prompt: list[int]) -> list[int]:
        return [token async for piece in engine.generate(prompt, greedy()) for token in piece.token_ids]

    return list(await asyncio.gather(*(one(prompt) for prompt in batch)))


def test_a_crowd_finishes_in_the_steps_its_tokens_need(engine: Engine) -> None:
    batch = prompts(1)
    plans = []
    schedule = engine.scheduler.schedule

    def watched():  # every decode-ready sequence before the plan, and the plan
        ready = {s for s in engine.scheduler.running() if s.wants_token}
        plan = schedule()
        plans.append((ready, plan))
        return plan

    engine.scheduler.schedule = watched
    try:
        before, tokens = dict(engine.steps), engine.stats.iteration_tokens.sum
        outputs = asyncio.run(crowd(engine, batch))
    finally:
        del engine.scheduler.schedule
    steps = [plan for _, plan in plans if plan is not None]
    bound = TOKENS + math.ceil(sum(map(len, batch)) / (BUDGET - CROWD)) + 4
    assert len(steps) <= bound, (len(steps), bound)
    assert all(len(ids) == TOKENS for ids in outputs)
    for ready, plan in plans:  # no step leaves a decode-ready sequence out (the pool holds every one)
        assert plan is None or ready == {chunk.sequence for chunk in plan.chunks if chunk.decode}
    assert sum(engine.steps.values()) - sum(before.values()) == len(steps)
    assert engine.steps["mixed"] - before["mixed"] == sum(plan.kind.value == "mixed" for plan in steps)
    assert engine.stats.iteration_tokens.sum - tokens == sum(plan.rows for plan in steps)
    assert max(plan.rows for plan in steps) == BUDGET and engine.memory()["blocks_used"] == 0


def test_greedy_ids_in_the_crowd_equal_ids_alone(engine: Engine) -> None:
    batch = prompts(2, 24)
    together = asyncio.run(crowd(engine, batch))
    alone = [engine.complete(prompt, greedy()).token_ids for prompt in batch[::6]]
    assert together[::6] == alone
