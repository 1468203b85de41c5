"""Request floods. The engine holds at most ``max_batch + max_waiting`` sequences (running, waiting, or
being tokenized; a request of ``n`` samples counts ``n``) and refuses a request past that at once with
``OverloadedError``, before its prompt is tokenized; a request that ends (finished or cancelled) gives its
place back, and the engine goes on. The server answers such a refusal with 429 and OpenAI's rate-limit
error body (streamed requests too, before the stream starts), and uvicorn answers 503 once
``--max-connections`` connections are open; the accepted requests give the text they give alone. A tiny
random-weight Llama on the reference executor (a few milliseconds a step), driven through the official
``openai`` client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams

from .servers import batchgpu_server
from .test_cli import batchgpu_cli
from .test_llama_variants import VARIANTS, random_weights, tiny_sizes, write_tiny_gguf

CONTEXT = 512  # the tiny file's trained length: long generations keep the engine busy for a while
PROMPTS = ["ABCDE", "BADGE", "FACED", "CAGED", "DEBAG", "BEADED", "ACCEDE", "DECADE"]  # one character: one token


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = VARIANTS["llama"]
    path = tmp_path_factory.mktemp("overload") / "tiny-llama.gguf"
    sizes = {**tiny_sizes(d), "context_length": CONTEXT}
    write_tiny_gguf(path, "llama", d, random_weights(d, 7), "F32", sizes, seed=1)
    return path


def greedy(tokens: int, **extra: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, **extra)


# the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    """Two slots and two waiting places: at most 4 sequences."""
    return Engine(tiny_model, bg.Device("reference"), max_batch=2, max_context=64, block_size=4, max_waiting=2)


async def text_of(pieces: AsyncIterator) -> str:
    return "".join([piece.text async for piece in pieces])


async def taken(engine: Engine, prompts: list[str], params: SamplingParams) -> list[asyncio.Task[str]]:
    """Tasks generating ``prompts``, each holding its place in the engine once this returns: a small prompt
    is tokenized and queued before the request's first wait, and each task runs to it before the engine's
    driver (made by the first) runs a step."""
    tasks = [asyncio.create_task(text_of(engine.generate(prompt, params))) for prompt in prompts]
    await asyncio.sleep(0)
    return tasks


def test_max_waiting_refuses_past_max_batch_plus_max_waiting_before_tokenizing(engine: Engine) -> None:
    alone = [engine.complete(prompt, greedy(6)).text for prompt in PROMPTS[:4]]

    async def flood() -> tuple[list[str], list[str]]:
        tasks = await taken(engine, PROMPTS[:4], greedy(6))
        refusals = []
        for prompt in ["ABC", object()]:  # a prompt of the wrong kind: refused for the load, never looked at
            with pytest.raises(bg.OverloadedError) as refused:
                await engine.generate(prompt, greedy(6)).__anext__()
            refusals.append(str(refused.value))
        assert refused.value.param is None and isinstance(refused.value, bg.RequestError)
        return list(await asyncio.gather(*tasks)), refusals

    together, refusals = asyncio.run(flood())
    assert together == alone
    full = (
        "the engine is full: it holds 4 sequences (running, waiting or being tokenized) and takes at most 4 "
        "(max_batch 2 + max_waiting 2); this request needs 1: retry later"
    )
    assert refusals == [full, full]
    assert engine.complete(PROMPTS[0], greedy(6)).text == alone[0]  # the places are given back
    assert engine.status()["running"] == engine.status()["waiting"] == 0 and engine.memory()["blocks_used"] == 0


def test_n_samples_take_n_places_and_more_than_the_engine_holds_is_a_bad_request(engine: Engine) -> None:
    async def flood() -> list[str]:
        tasks = await taken(engine, PROMPTS[:3], greedy(4))
        with pytest.raises(bg.OverloadedError, match=r"it holds 3 sequences .* this request needs 2: retry later"):
            await engine.generate("ABC", greedy(4, n=2)).__anext__()
        with pytest.raises(bg.OverloadedError, match=r"holds 3 sequences .* this request needs 3"):
            await engine.generate("ABC", greedy(4, n=2, best_of=3)).__anext__()
        tasks.append(asyncio.create_task(text_of(engine.generate("ABC", greedy(4)))))  # the last place
        return list(await asyncio.gather(*tasks))

    assert len(asyncio.run(flood())) == 4
    samples = engine.complete_choices("ABC", greedy(4, n=4))  # an idle engine holds 4 at once
    assert [piece.index for piece in samples] == [0, 1, 2, 3]
    for settings, param in (({"n": 5}, "n"), ({"n": 1, "best_of": 5}, "best_of")):
        with pytest.raises(bg.RequestError, match=r"5 samples; this engine holds at most 4 sequences") as refused:
            engine.complete_choices("ABC", greedy(4, **settings))
        assert not isinstance(refused.value, bg.OverloadedError) and refused.value.param == param


def test_a_cancelled_request_gives_its_place_back(engine: Engine) -> None:
    """A waiting request and a running one cancelled, and one refused for its length: the next requests take
    their places at once."""

    async def flood() -> list[str]:
        tasks = await taken(engine, PROMPTS[:4], greedy(40))
        while engine.status()["running"] < 2:  # the first two hold the slots
            await asyncio.sleep(0)
        for task in (tasks[3], tasks[0]):  # the last waiting, then one running
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        with pytest.raises(bg.RequestError, match="max_context"):  # refused for its length: its place is free
            await engine.generate("AB" * 40, greedy(6)).__anext__()
        later = await taken(engine, PROMPTS[4:6], greedy(6))
        with pytest.raises(bg.OverloadedError, match="it holds 4 sequences"):
            await engine.generate("ABC", greedy(6)).__anext__()
        return list(await asyncio.gather(*tasks[1:3], *later))

    texts = asyncio.run(flood())
    assert texts[2:] == [engine.complete(prompt, greedy(6)).text for prompt in PROMPTS[4:6]]
    assert engine.memory()["blocks_used"] == 0 and engine.held == 0


@pytest.mark.parametrize("value", [-1, 1.5, "2", True])
def test_max_waiting_must_be_an_int_at_least_0(tiny_model: Path, value) -> None:
    with pytest.raises(bg.BatchError, match=f"max_waiting must be None or an int >= 0, got {value!r}"):
        Engine(tiny_model, bg.Device("reference"), max_context=64, max_waiting=value)


def test_max_waiting_none_is_unbounded(tiny_model: Path) -> None:
    """The default: an offline batch may queue every prompt it has (as vLLM's ``LLM.generate`` takes a list)."""
    unbounded = Engine(tiny_model, bg.Device("reference"), max_batch=1, max_context=64, block_size=4)

    async def flood() -> list[str]:
        return list(await asyncio.gather(*await taken(unbounded, PROMPTS, greedy(2))))

    assert len(asyncio.run(flood())) == len(PROMPTS)


# the server ------------------------------------------------------------------------------------------

openai = pytest.importorskip("openai", reason="the server tests use the official openai client (test extra)")
pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")

CONNECTIONS = 12


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[str]:
    options = ["--model", str(tiny_model), "--device", "reference", "--max-batch", "2", "--max-context", str(CONTEXT)]
    with batchgpu_server(*options, "--max-waiting", "2", "--max-connections", str(CONNECTIONS), startup=120) as url:
        yield url


def status(server: str) -> dict:
    with urllib.request.urlopen(f"{server}/v1/engine", timeout=60) as response:
        return json.loads(response.read())


async def complete(client, prompt: str, tokens: int, *, stream: bool = False) -> str:
    """The text of a greedy completion (openai.RateLimitError where the server refuses it)."""
    settings = {"model": "tiny-llama", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    answer = await client.completions.create(**settings, stream=stream, extra_body={"ignore_eos": True})
    if not stream:
        return answer.choices[0].text
    return "".join([chunk.choices[0].text async for chunk in answer if chunk.choices])


def unread_body_answer(server: str) -> bytes:
    """The answer to a request whose 64-byte body is never sent (only one refused before its body is read
    gets one before the timeout)."""
    host, port = server.removeprefix("http://").split(":")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):  # the head, then the JSON body
            data = connection.recv(65536)
            if not data:
                break
            answer += data
        return answer


def test_a_flood_past_max_batch_plus_max_waiting_gets_429_and_the_server_goes_on(server: str) -> None:
    """Four long requests fill the server's two slots and two waiting places; four more, two of them
    streamed, are refused with 429 and OpenAI's rate-limit body while those run, and one whose body never
    comes before its body is read; the four give the text they give alone, and the server then serves
    new requests."""
    tokens = 400  # about a second of steps for each pair: the refused ones come long before the first ends

    async def flood() -> tuple[list[str], list[BaseException | str], bytes]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0) as client:
            accepted = [asyncio.create_task(complete(client, prompt, tokens)) for prompt in PROMPTS[:4]]
            while (held := await asyncio.to_thread(status, server))["running"] + held["waiting"] < 4:
                await asyncio.sleep(0.005)
            extra = [complete(client, prompt, 8, stream=i % 2 == 1) for i, prompt in enumerate(PROMPTS[4:])]
            refused = await asyncio.gather(*extra, return_exceptions=True)
            head = await asyncio.to_thread(unread_body_answer, server)
            return list(await asyncio.gather(*accepted)), list(refused), head

    texts, refused, head = asyncio.run(flood())
    assert head.startswith(b"HTTP/1.1 429 ") and b"rate_limit_exceeded" in head, head
    for error in refused:
        assert isinstance(error, openai.RateLimitError) and error.status_code == 429, error
        assert error.body["type"] == "requests" and error.body["code"] == "rate_limit_exceeded", error.body
        assert "takes at most 4 (max_batch 2 + max_waiting 2)" in error.body["message"] and error.body["param"] is None

    async def alone() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", timeout=120, max_retries=0) as client:
            return [await complete(client, prompt, tokens, stream=True) for prompt in PROMPTS[:4]]

    assert texts == asyncio.run(alone())
    assert status(server)["running"] == status(server)["waiting"] == 0


def test_past_max_connections_uvicorn_answers_503(server: str) -> None:
    """With ``--max-connections`` connections open, a request is answered 503 (uvicorn's limit); once one
    closes, requests are served again."""
    host, port = server.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=60) for _ in range(CONNECTIONS - 1)]
    try:
        with socket.create_connection((host, int(port)), timeout=60) as connection:
            connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert connection.recv(65536).startswith(b"HTTP/1.1 503 ")
    finally:
        for connection in idle:
            connection.close()
    while True:  # until the server has seen them close (a 503 until then)
        try:
            urllib.request.urlopen(f"{server}/v1/models", timeout=60).close()
            break
        except urllib.error.HTTPError as error:
            assert error.code == 503
    with openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=60, max_retries=0) as client:
        answer = client.completions.create(
            model="tiny-llama", prompt="ABC", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert answer.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-waiting", "-1", "serve: --max-waiting must be at least 0, got -1"),
        ("--max-connections", "0", "serve: --max-connections must be at least 1, got 0"),
        ("--max-waiting", "2.5", "argument --max-waiting: invalid int value: '2.5'"),
        ("--max-connections", "many", "argument --max-connections: invalid int value: 'many'"),
    ],
)
def test_serve_refuses_bad_flood_limits_before_loading_a_model(flag: str, value: str, message: str) -> None:
    done = batchgpu_cli("serve", flag, value, "--model", "no-such-model.gguf", timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
