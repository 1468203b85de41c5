"""Request floods. The engine holds at most ``max_batch + max_waiting`` sequences (running, waiting, or
being tokenized; a request of ``n`` samples counts ``n``) and refuses a request past that at once with
``OverloadedError``, before its prompt is tokenized; a request that ends (finished or cancelled) gives its
place back, and the engine goes on. The server answers such a refusal with 429 and OpenAI's rate-limit
error body (streamed requests too, before the stream starts), and uvicorn answers 503 once
``--max-connections`` connections are open; the accepted requests give the text they give alone. A tiny
random-weight Llama on the reference executor (a few milliseconds a step), driven through the official
``openai`` client on 127.0.0.1. An embedding service (a tiny random-weight BERT) bounds the texts it holds
the same way, and its server answers the same 429."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm import Engine, SamplingParams
from batchgpu.llm.embeddings import EmbeddingService
from batchgpu.models.encoder import Encoder

from .servers import batchgpu_server
from .test_cli import batchgpu_cli
from .test_encoder import write_bert
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


def overloaded_total(server: str) -> float:
    """The server's ``batchgpu_requests_overloaded_total`` (Prometheus' text format)."""
    with urllib.request.urlopen(f"{server}/metrics", timeout=60) as response:
        lines = response.read().decode().splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("batchgpu_requests_overloaded_total "))


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

    refusals_before = overloaded_total(server)
    texts, refused, head = asyncio.run(flood())
    assert overloaded_total(server) - refusals_before == len(refused) + 1  # counted once each, for /metrics
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


# the embedding service -------------------------------------------------------------------------------
# Its bound counts texts: an encoder's --max-batch is texts embedded together, and a request of k inputs
# holds k (as a request of n samples holds n sequences of an engine).

EMBEDDING_TEXTS = ["Abc de", "fa ce", "bead", "cab bed", "dace", "ace of bad"]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert(tmp_path_factory.mktemp("bert") / "tiny-bert", np.random.default_rng(3))


def embedding_service(tiny_bert: Path, max_waiting: int | None = 2) -> EmbeddingService:
    """Two texts embedded together and two waiting places: at most 4 texts."""
    return EmbeddingService(Encoder(bg.Device("reference"), tiny_bert, max_batch=2), max_waiting)


def test_the_embedding_service_refuses_texts_past_max_batch_plus_max_waiting_before_tokenizing(
    tiny_bert: Path,
) -> None:
    service = embedding_service(tiny_bert)
    alone = [service.encoder.embed([text]) for text in EMBEDDING_TEXTS]

    async def flood() -> tuple[list[np.ndarray], list[str]]:
        tasks = [asyncio.create_task(service.embed(texts)) for texts in (EMBEDDING_TEXTS[:3], EMBEDDING_TEXTS[3:4])]
        await asyncio.sleep(0)  # each holds its places, being tokenized
        refusals = []
        for inputs in (EMBEDDING_TEXTS[4:5], [object()]):  # an input of the wrong kind: never looked at
            with pytest.raises(bg.OverloadedError) as refused:
                await service.embed(inputs)
            refusals.append(str(refused.value))
        with pytest.raises(bg.RequestError, match=r"input has 5 items; this server holds at most 4 texts") as big:
            await service.embed(EMBEDDING_TEXTS[:5])
        assert big.value.param == "input" and not isinstance(big.value, bg.OverloadedError)
        vectors = [vector for vector, _ in await asyncio.gather(*tasks)]
        cancelled = asyncio.create_task(service.embed(EMBEDDING_TEXTS[2:]))  # the places are back: taken
        await asyncio.sleep(0)
        assert service.held == 4
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return vectors, refusals

    (three, one), refusals = asyncio.run(flood())
    full = (
        "the embedding service is full: it holds 4 texts (embedding, waiting or being tokenized) and takes at most "
        "4 (max_batch 2 + max_waiting 2); this request has 1: retry later"
    )
    assert refusals == [full, full]
    batched = 1e-5  # a text's vector alone vs padded in a batch: the summation order only
    np.testing.assert_allclose(np.concatenate([three, one]), np.concatenate(alone[:4]), rtol=0, atol=batched)
    assert service.held == 0  # every place is given back: ended, refused and cancelled requests alike
    vectors, tokens = asyncio.run(service.embed(EMBEDDING_TEXTS[:4]))
    assert vectors.shape == (4, service.encoder.dimensions) and tokens == sum(
        len(row) for row in service.encoder.tokenize(EMBEDDING_TEXTS[:4])
    )


async def asgi_post(app: Any, body: bytes | None) -> tuple[int, dict]:
    """The status and JSON body of ``app``'s answer to a POST of ``body`` to /v1/embeddings, handed to it
    on this event loop as uvicorn hands it one (None: a 64-byte body announced that never comes)."""
    size = 64 if body is None else len(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(size).encode())]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "query_string": b"", "root_path": "",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    pending, sent = [body] if body is not None else [], []

    async def receive() -> dict:
        if not pending:
            await asyncio.Event().wait()  # the body never comes (or comes once)
        return {"type": "http.request", "body": pending.pop(), "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return sent[0]["status"], json.loads(b"".join(message.get("body", b"") for message in sent[1:]))


def embeddings_body(texts: list[str]) -> bytes:
    return json.dumps({"model": "tiny-bert", "input": texts, "encoding_format": "float"}).encode()


def test_embeddings_past_the_bound_get_429_before_tokenizing_and_the_server_goes_on(tiny_bert: Path) -> None:
    """The server's answers while the service holds 3 of its 4 texts (and all 4: refused before the body
    is read), to a request of more texts than it ever holds, and once the places are back."""
    from batchgpu.llm.server import create_app

    service = embedding_service(tiny_bert)
    app = create_app(lambda: service, "tiny-bert", embeddings=True)

    async def answers() -> list[tuple[int, dict]]:
        async with app.router.lifespan_context(app):
            with service.places(3):
                replies = [await asgi_post(app, embeddings_body(EMBEDDING_TEXTS[:2]))]
                replies.append(await asgi_post(app, embeddings_body(EMBEDDING_TEXTS[:1])))  # the last place
            with service.places(4):
                replies.append(await asgi_post(app, None))
            replies.append(await asgi_post(app, embeddings_body(EMBEDDING_TEXTS[:5])))
            return [*replies, await asgi_post(app, embeddings_body(EMBEDDING_TEXTS[:4]))]

    (over, status_one, unread, too_many, after) = asyncio.run(answers())
    for (status, body), held in ((over, 3), (unread, 4)):
        assert status == 429, body
        needs = 2 if held == 3 else 1
        message = (
            f"the embedding service is full: it holds {held} texts (embedding, waiting or being tokenized) and "
            f"takes at most 4 (max_batch 2 + max_waiting 2); this request has {needs}: retry later"
        )
        assert body == {"error": {"message": message, "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
    assert status_one[0] == 200 and len(status_one[1]["data"]) == 1
    assert too_many[0] == 400 and too_many[1]["error"]["param"] == "input", too_many
    assert "input has 5 items; this server holds at most 4 texts" in too_many[1]["error"]["message"]
    assert after[0] == 200 and [item["index"] for item in after[1]["data"]] == [0, 1, 2, 3]
    assert service.held == 0


def test_serve_max_waiting_bounds_an_encoders_texts(tiny_bert: Path) -> None:
    """``--max-waiting`` reaches an encoder's service: with one text embedded at a time and none waiting, a
    request of two is more than it ever holds (400), one of one is served; by default a request of OpenAI's
    most inputs (2048) fits."""
    options = ["--model", str(tiny_bert), "--device", "reference"]
    with batchgpu_server(*options, "--max-batch", "1", "--max-waiting", "0", startup=120) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"input has 2 items; .* at most 1 texts") as refused:
            client.embeddings.create(model="tiny-bert", input=EMBEDDING_TEXTS[:2])
        assert refused.value.body["param"] == "input"
        assert len(client.embeddings.create(model="tiny-bert", input=EMBEDDING_TEXTS[:1]).data) == 1
    with batchgpu_server(*options, startup=120) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
        assert len(client.embeddings.create(model="tiny-bert", input=EMBEDDING_TEXTS[:1] * 2048).data) == 2048
