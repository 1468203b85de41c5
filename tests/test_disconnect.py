"""Clients that leave: ``python -m batchgpu serve`` (a tiny random-weight Llama on the reference executor,
started here on 127.0.0.1) aborts a request as soon as its client disconnects, streamed or not, running or
still waiting for a slot: the engine drops it (its slot and KV blocks free), long before its ``max_tokens``
could have been generated, and ``batchgpu_requests_aborted_total`` counts it once; requests that end
normally (a prompt-only echo too) are not counted, and the server goes on serving; all of it with the
whole engine in the server's process (``--no-engine-process``) and with its core in one of its own (the
default). The clients are raw
sockets, closed at the moment each case wants. In-process, a stream whose send fails (an ASGI 2.4 server's
word for a client gone) is aborted the same way."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import batchgpu as bg
from batchgpu.llm import Engine

from .servers import batchgpu_server, first_event, opened
from .test_llama_variants import VARIANTS, random_weights, tiny_sizes, write_tiny_gguf

pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'batchgpu[serve]'")

CONTEXT = 8192  # the tiny file's trained length
TOKENS = 8000  # a request's max_tokens: thousands of steps (many seconds) if it ran to the end
SLOTS = 4
DEADLINE = 10.0  # seconds for the engine to drop what was aborted (it takes milliseconds)
PROMPTS = ["ABCDE", "BADGE", "FACED", "CAGED", "DEBAG", "BEADED"]  # one character: one token
MODEL = "disconnect"  # the served name: the file's stem


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = VARIANTS["llama"]
    path = tmp_path_factory.mktemp("disconnect") / f"{MODEL}.gguf"
    write_tiny_gguf(path, "llama", d, random_weights(d, 7), "F32", {**tiny_sizes(d), "context_length": CONTEXT}, seed=1)
    return path


@pytest.fixture(scope="module", params=["--no-engine-process", "--engine-process"])
def server(tiny_model: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """``SLOTS`` slots and KV blocks for all of them at full length (nothing is preempted); the engine in the
    server's process, or its core in one of its own."""
    sizes = ["--max-batch", str(SLOTS), "--max-context", str(CONTEXT), "--kv-blocks", str(SLOTS * CONTEXT // 16)]
    settings = ["--model", str(tiny_model), "--device", "reference", *sizes, request.param]
    with batchgpu_server(*settings, startup=120) as url:
        yield url


def completion(prompt: str, *, stream: bool, tokens: int = TOKENS, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}  # fmt: skip


def sent(server: str, prompt: str, *, stream: bool) -> socket.socket:
    """A connection that has sent a long completion of ``prompt``."""
    return opened(server, "/v1/completions", completion(prompt, stream=stream))


def status(server: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server}/v1/engine", timeout=60) as response:
        return json.loads(response.read())


def counts(server: str) -> tuple[float, float]:
    """The server's ``batchgpu_requests_aborted_total`` and ``batchgpu_generation_tokens_total``."""
    with urllib.request.urlopen(f"{server}/metrics", timeout=60) as response:
        samples = dict(line.split() for line in response.read().decode().splitlines() if not line.startswith("#"))
    return float(samples["batchgpu_requests_aborted_total"]), float(samples["batchgpu_generation_tokens_total"])


def wait_for(server: str, running: int, waiting: int) -> dict[str, Any]:
    """The engine's status once it has ``running`` and ``waiting`` requests (AssertionError after DEADLINE)."""
    deadline = time.monotonic() + DEADLINE
    while (now := status(server))["running"] != running or now["waiting"] != waiting:
        assert time.monotonic() < deadline, f"still {now['running']} running and {now['waiting']} waiting: {now}"
        time.sleep(0.02)
    return now


def close(connections: list[socket.socket]) -> None:
    for connection in connections:
        connection.close()


def assert_dropped(server: str, before: tuple[float, float], dropped: int) -> None:
    """The engine holds nothing (within DEADLINE), ``dropped`` more requests were counted as aborted, and
    they got a small part of the tokens they asked for; then normal requests are served and not counted."""
    idle = wait_for(server, 0, 0)
    assert idle["memory"]["blocks_used"] == 0, idle
    aborted, tokens = counts(server)
    assert aborted - before[0] == dropped
    assert tokens - before[1] < dropped * TOKENS / 8, f"{tokens - before[1]} tokens generated for {dropped} aborted"
    served_normally(server)
    assert counts(server)[0] == aborted  # normal ends are no aborts


def served_normally(server: str) -> None:
    """A completion not streamed, a streamed one, and a prompt-only echo (its one piece the whole answer)."""
    assert posted(server, completion(PROMPTS[0], stream=False, tokens=6))["usage"]["completion_tokens"] == 6
    events = posted(server, completion(PROMPTS[0], stream=True, tokens=6))
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length", events
    echoed = posted(server, completion(PROMPTS[1], stream=False, tokens=0, echo=True))
    assert echoed["choices"][0]["text"] == PROMPTS[1]
    assert wait_for(server, 0, 0)["memory"]["blocks_used"] == 0


def posted(server: str, body: dict[str, Any]) -> Any:
    """The answer to a POST of ``body`` to /v1/completions: its JSON, or a stream's events' data."""
    request = urllib.request.Request(f"{server}/v1/completions", json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    if not body["stream"]:
        return json.loads(text)
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event]


def test_streams_closed_after_their_first_event_are_aborted(server: str) -> None:
    before = counts(server)
    connections = [sent(server, prompt, stream=True) for prompt in PROMPTS[:SLOTS]]
    for connection in connections:
        first_event(connection)
    close(connections)
    assert_dropped(server, before, SLOTS)


def test_requests_not_streamed_closed_while_they_run_are_aborted(server: str) -> None:
    """Their clients leave once the engine runs them; their answer would come only at the end."""
    before = counts(server)
    connections = [sent(server, prompt, stream=False) for prompt in PROMPTS[:SLOTS]]
    try:
        wait_for(server, SLOTS, 0)
    finally:
        close(connections)
    assert_dropped(server, before, SLOTS)


def test_requests_closed_while_they_wait_for_a_slot_are_aborted(server: str) -> None:
    """Two requests (one streamed) waiting behind ``SLOTS`` running streams: their clients leave, and the
    engine drops them while the others go on; then the running ones' clients leave too."""
    before = counts(server)
    running = [sent(server, prompt, stream=True) for prompt in PROMPTS[:SLOTS]]
    try:
        for connection in running:
            first_event(connection)
        waiting = [sent(server, prompt, stream=i == 0) for i, prompt in enumerate(PROMPTS[SLOTS:])]
        try:
            wait_for(server, SLOTS, len(waiting))
        finally:
            close(waiting)
        wait_for(server, SLOTS, 0)
        assert counts(server)[0] - before[0] == len(waiting)
    finally:
        close(running)
    assert_dropped(server, before, SLOTS + len(waiting))


# in-process: a send that fails ----------------------------------------------------------------------


async def lifespan_started(app: Any) -> tuple[asyncio.Task, asyncio.Queue]:
    """``app``'s lifespan, started (its engine made); the task and the queue its shutdown message goes to."""
    messages: asyncio.Queue = asyncio.Queue()
    answers: asyncio.Queue = asyncio.Queue()
    messages.put_nowait({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, messages.get, answers.put))
    assert (await answers.get())["type"] == "lifespan.startup.complete"
    return task, messages


async def stream_until_a_send_fails(app: Any, body: dict[str, Any], events: int) -> list[dict[str, Any]]:
    """POST ``body`` to ``app`` as an ASGI 2.4 server hands it one whose client is gone after ``events``
    events: the next send raises OSError, and receive never says the client disconnected. What was sent."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    pending, sent = [data], []

    async def receive() -> dict[str, Any]:
        if not pending:
            await asyncio.Event().wait()  # no disconnect message: only the failed send tells
        return {"type": "http.request", "body": pending.pop(), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(sent) > events:
            raise OSError("the client is gone")
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=60)
    return sent


def test_a_stream_whose_send_fails_is_aborted(tiny_model: Path) -> None:
    from batchgpu.llm.server import create_app

    engine = Engine(tiny_model, bg.Device("reference"), max_batch=2, max_context=CONTEXT)
    app = create_app(lambda: engine, MODEL)

    async def run() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        lifespan, messages = await lifespan_started(app)
        sent = await stream_until_a_send_fails(app, completion(PROMPTS[0], stream=True), events=2)
        now = engine.status()  # at once: the app has returned
        messages.put_nowait({"type": "lifespan.shutdown"})
        await lifespan
        return sent, now

    sent, now = asyncio.run(run())
    assert sent[0]["status"] == 200 and [message["body"][:6] for message in sent[1:]] == [b"data: "] * 2
    assert now["running"] == now["waiting"] == 0 and now["memory"]["blocks_used"] == 0, now
    assert engine.stats.aborted == 1 and engine.stats.generation_tokens < TOKENS / 8
