"""The engine with its core in a process of its own (:class:`~batchgpu.llm.engine_process.EngineProcess`, a
synthetic tiny Llama on the reference executor): every request gets the pieces the same engine in one
process gives it (text, ids, finish reasons, usage, logprobs and their bytes; the same seeds: the same
sampled ids), whatever ends it there (length, end-of-sequence, stop ids, stop strings found in the client,
a grammar's end found in the core); a request the core refuses raises its RequestError and counts as
refused; a caller that stops frees its slot in the core; the core's counts reach the metrics; and a core
that dies fails what waits on it with a BatchError, not a hang."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgpu.errors import BatchError, RequestError
from batchgpu.llm import Engine, SamplingParams
from batchgpu.llm.engine_process import EngineProcess
from batchgpu.llm.options import EngineOptions

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")

SLOTS, CONTEXT = 4, 128
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from batchgpu.models.synth import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("core") / "tiny.gguf", "tiny-llama", "q8_0", show=False).path


def options(model: Path) -> EngineOptions:
    return EngineOptions(model=str(model), device="reference", max_batch=SLOTS, max_context=CONTEXT)


@pytest.fixture(scope="module")
def split(model: Path) -> Iterator[EngineProcess]:
    with EngineProcess(options(model)) as engine:
        yield engine


@pytest.fixture(scope="module")
def whole(model: Path) -> Engine:
    return options(model).make()


def pieces(engine: Any, prompt: Any, params: SamplingParams) -> list[Any]:
    async def run() -> list[Any]:
        return [piece async for piece in engine.generate(prompt, params)]

    return asyncio.run(run())


CASES = {
    "length": SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
    "sampled": SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=5),
    "samples and logprobs": SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=3, logprobs=2, prompt_logprobs=1),
    "best of": SamplingParams(max_tokens=5, n=2, best_of=3, temperature=1.0, seed=11),
    "stop string": SamplingParams(max_tokens=30, temperature=0.0, stop=["e", "a"]),
    "prompt alone": SamplingParams(max_tokens=0, prompt_logprobs=2),
    "penalties": SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_split_engine_gives_the_pieces_of_the_whole_one(split: EngineProcess, whole: Engine, case: str) -> None:
    params = CASES[case]
    assert pieces(split, PROMPT, params) == pieces(whole, PROMPT, params)


def test_a_stop_token_ends_a_request_in_both_processes(split: EngineProcess, whole: Engine) -> None:
    greedy = pieces(whole, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    ids = [token for piece in greedy for token in piece.token_ids]
    params = SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[ids[-1]])
    got = pieces(split, PROMPT, params)
    assert got == pieces(whole, PROMPT, params)
    assert got[-1].finish_reason == "stop" and got[-1].usage.completion_tokens == ids.index(ids[-1]) + 1


def test_a_grammar_found_in_the_core_ends_the_text_in_the_client(split: EngineProcess, whole: Engine) -> None:
    pytest.importorskip("llguidance", reason="structured outputs use llguidance")
    from batchgpu.llm.structured import StructuredOutput

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=2, structured=StructuredOutput(json_schema=schema))
    got = pieces(split, PROMPT, params)
    assert got == pieces(whole, PROMPT, params)
    assert got[-1].finish_reason == "stop" and "".join(piece.text for piece in got).startswith("{")


def test_a_request_the_core_refuses_raises_and_counts_as_refused(split: EngineProcess) -> None:
    refused = split.stats.refused
    with pytest.raises(RequestError, match="max_context") as error:
        pieces(split, PROMPT, SamplingParams(max_tokens=CONTEXT))
    assert error.value.param == "max_tokens" and split.stats.refused == refused + 1
    assert pieces(split, PROMPT, SamplingParams(max_tokens=2))[-1].usage.completion_tokens == 2  # it goes on


def test_a_burst_that_fills_the_pipe_many_times_passes_under_uvloop_too(split: EngineProcess) -> None:
    """200 requests at once, each with 5,000 stop ids the model never samples (about 5 MB on their way to the
    core while it reads what it can between steps): each gets its token, and the engine goes on; on uvloop
    where installed (which makes a file descriptor it watches non-blocking)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=list(range(10**6, 10**6 + 5000)))

    async def burst() -> list[int]:
        async def one() -> int:
            return len([token async for piece in split.generate(PROMPT, params) for token in piece.token_ids])

        return await asyncio.gather(*(one() for _ in range(200)))

    try:
        import uvloop
    except ImportError:  # not a dependency; uvicorn takes it where it is installed
        uvloop = None
    assert (uvloop.run(burst()) if uvloop is not None else asyncio.run(burst())) == [1] * 200
    assert pieces(split, PROMPT, SamplingParams(max_tokens=2))[-1].usage.completion_tokens == 2


def test_a_caller_that_stops_frees_its_slot_in_the_core(split: EngineProcess) -> None:
    async def run() -> dict[str, Any]:
        aborted = split.stats.aborted
        stream = split.generate(PROMPT, SamplingParams(max_tokens=CONTEXT - 32, temperature=0.0, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        assert split.stats.aborted == aborted + 1
        for _ in range(1000):  # the core drops it before its next step; its answer comes after that
            status = await split.status()
            if status["running"] == 0:
                return status
        raise AssertionError(f"the core still runs the request: {status}")

    status = asyncio.run(run())
    assert status["memory"]["blocks_used"] == 0 and split.held == 0


def test_the_core_counts_reach_the_metrics(split: EngineProcess) -> None:
    pytest.importorskip("prometheus_client")
    from batchgpu.llm.metrics import exposition, metrics_registry

    pieces(split, PROMPT, SamplingParams(max_tokens=4))
    text = exposition(metrics_registry(split))[0].decode()
    steps = sum(split.stats.steps.values())
    assert steps > 0 and split.stats.iteration_tokens.sum > 0
    assert f'batchgpu_steps_total{{kind="decode"}} {float(split.stats.steps["decode"])}' in text
    assert "batchgpu_requests_running 0.0" in text


def test_a_core_that_dies_fails_its_requests_and_later_ones(model: Path) -> None:
    engine = EngineProcess(options(model))

    async def run() -> None:
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=CONTEXT - 32, temperature=0.0, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(BatchError, match="core process ended"):
            async for _ in stream:
                pass
        with pytest.raises(BatchError, match="core process ended"):
            await engine.generate(PROMPT, SamplingParams(max_tokens=2)).__anext__()

    try:
        asyncio.run(run())
        assert engine.failure is not None and engine.stats.failed == 2
    finally:
        engine.close()


def test_an_engine_that_cannot_be_made_raises_its_error_here(tmp_path: Path) -> None:
    with pytest.raises(BatchError, match="no such file"):
        EngineProcess(EngineOptions(model=str(tmp_path / "missing.gguf"), device="reference"))


def test_a_call_the_core_cannot_unpickle_fails_alone(split: EngineProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    here_only = types.ModuleType("batchgpu_test_here_only")  # importable in this process, not in the core's
    exec("def running(engine):\n    return engine.status()['running']\n", here_only.__dict__)
    monkeypatch.setitem(sys.modules, here_only.__name__, here_only)

    async def run() -> None:
        with pytest.raises(ModuleNotFoundError, match="batchgpu_test_here_only"):
            await split.call(here_only.running)
        assert (await split.status())["running"] == 0

    asyncio.run(run())
