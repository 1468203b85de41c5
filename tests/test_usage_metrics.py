"""Metrics that agree with the answers: ``python -m batchgpu serve`` on a synthetic tiny Llama (random weights, a
byte-level tokenizer of 256 byte tokens, so every character past ASCII splits over tokens) on the reference
executor gets a mix of requests: completions and chat, streamed (with their usage event) and not, ``n`` > 1,
``best_of``, echo with ``max_tokens`` 0 and with logprobs, stop strings, tool calls, refusals (a bad field,
an unknown model, a body over the limit, a prompt past the context, ``max_tokens`` 0 without echo), grammars
that fail after their first token (failed), a request refused for the load (429) and clients that leave
(aborted). Afterwards each counter rose by what the answers said: the prompt and generation tokens by the sums
of the finished answers' ``usage``, ``batchgpu_request_success_total`` by their choices' finish reasons, and
each ``batchgpu_requests_<outcome>_total`` by the requests that ended so.

Along the way the answers' logprobs hold each token's exact bytes: chat ``bytes`` join to the content's UTF-8
(read as UTF-8: random weights make invalid sequences too), completions ``tokens`` join to the text."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .servers import batchgpu_server, first_event, opened

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")
pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("prometheus_client", reason="pip install 'batchgpu[serve]'")

MODEL = "tiny"  # the served name: the file's stem
SLOTS = 4  # --max-batch; --max-waiting 0: a fifth sequence is refused with 429
LIMIT = 16384  # --max-request-bytes
CONTEXT = 1024
DEADLINE = 20.0
OUTCOMES = ("finished", "aborted", "overloaded", "refused", "failed")
REASONS = ("stop", "length", "tool_calls")
TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
FAILING = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
}
"""A schema that compiles and fails after its first token (the grammar engine's lexer grows past its limits)."""


def tiny_llama(path: Path) -> Path:
    """The synthetic tiny Llama with a trained length of CONTEXT (the preset's 256 is too short for a tool
    request's prompt)."""
    from batchgpu.models import synth

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(synth.PRESETS, "tiny-llama", dataclasses.replace(synth.PRESETS["tiny-llama"], context=CONTEXT))
        return synth.write_synthetic(path, "tiny-llama", "q8_0", show=False).path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tiny_llama(tmp_path_factory.mktemp("usage") / f"{MODEL}.gguf")
    sizes = ["--max-batch", str(SLOTS), "--max-waiting", "0", "--max-context", str(CONTEXT)]
    options = [*sizes, "--max-request-bytes", str(LIMIT)]
    with batchgpu_server("--model", str(path), "--device", "reference", *options, startup=120) as url:
        yield url


def metrics(server: str) -> dict[str, float]:
    """The counters of /metrics: ``<name>_total`` and, for request_success, ``[<finished_reason>]``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server}/metrics", timeout=60) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.type == "counter" and sample.name.endswith("_total"):
                reason = sample.labels.get("finished_reason")
                samples[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return samples


def post(server: str, path: str, body: Any) -> tuple[int, Any]:
    """(status, JSON body) of a POST, or for a stream (status, its events' data parsed)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{server}{path}", data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    if isinstance(body, dict) and body.get("stream"):
        events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
        assert events[-1] == "[DONE]", events
        return status, [json.loads(event) for event in events[:-1]]
    return status, json.loads(text)


class Answers:
    """What the answers said: usage summed over finished requests, their choices' finish reasons, requests by
    outcome."""

    def __init__(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0
        self.reasons: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()

    def finished(self, usage: dict[str, int], reasons: list[str]) -> None:
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.reasons.update(reasons)
        self.outcomes["finished"] += 1


def check_completion(body: dict[str, Any], echoed: str = "") -> None:
    """Each choice's logprobs tokens join to its text (up to a stop string that ended it), the echoed prompt's
    first; ``text_offset`` each token's start in the text."""
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        if logprobs is None:
            continue
        tokens = logprobs["tokens"]
        assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
        joined = "".join(tokens)
        assert joined.startswith(echoed) and choice["text"].startswith(echoed)
        if choice["finish_reason"] == "stop":
            assert joined.startswith(choice["text"]), (joined, choice["text"])
        else:
            assert joined == choice["text"], (joined, choice["text"])


def check_chat(choice: dict[str, Any], content: str) -> None:
    """The chat logprobs' bytes join to the content's UTF-8 (as UTF-8: U+FFFD for invalid sequences), each
    token those bytes as text (``\\xNN`` for bytes outside a whole character)."""
    entries = choice["logprobs"]["content"]
    data = b"".join(bytes(entry["bytes"]) for entry in entries)
    assert data.decode("utf-8", "replace") == content, (data, content)
    for entry in entries:
        assert entry["token"] == bytes(entry["bytes"]).decode("utf-8", "backslashreplace")
        for top in entry["top_logprobs"]:
            assert top["token"] == bytes(top["bytes"]).decode("utf-8", "backslashreplace")


def streamed(events: list[dict[str, Any]]) -> tuple[dict[str, int], dict[int, list[dict[str, Any]]]]:
    """A stream's usage (its last event) and each choice's chunks."""
    usage = events[-1]["usage"]
    chunks: dict[int, list[dict[str, Any]]] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            chunks.setdefault(choice["index"], []).append(choice)
    return usage, chunks


def test_counters_equal_what_the_answers_said(server: str) -> None:
    before = metrics(server)
    said = Answers()
    completions, chat = "/v1/completions", "/v1/chat/completions"
    usage_events = {"stream": True, "stream_options": {"include_usage": True}}

    def finished(path: str, body: dict[str, Any]) -> Any:
        status, answer = post(server, path, {"model": MODEL, "temperature": 0, **body})
        assert status == 200, answer
        if body.get("stream"):
            usage, chunks = streamed(answer)
            said.finished(usage, [next(c["finish_reason"] for c in cs if c["finish_reason"]) for cs in chunks.values()])
        else:
            said.finished(answer["usage"], [choice["finish_reason"] for choice in answer["choices"]])
        return answer

    def refused(path: str, body: Any, status: int, outcome: str = "refused") -> None:
        got, answer = post(server, path, body)
        assert got == status, answer
        said.outcomes[outcome] += 1

    # finished: completions
    finished(completions, {"prompt": "Hello", "max_tokens": 5, "logprobs": 2})
    finished(completions, {"prompt": "Hello", "max_tokens": 6, **usage_events})
    finished(completions, {"prompt": "Hi", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 3})
    finished(completions, {"prompt": "Hi", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 5, **usage_events})
    answer = finished(completions, {"prompt": "Hi", "max_tokens": 4, "best_of": 3, "temperature": 1.0, "seed": 7})
    assert answer["usage"]["completion_tokens"] <= 4  # the returned choice's tokens (vLLM's rule)
    text = "你好, 世界 😀 ½"
    for tokens in (0, 3):
        answer = finished(completions, {"prompt": text, "max_tokens": tokens, "echo": True, "logprobs": 2})
        assert answer["usage"]["completion_tokens"] <= tokens and answer["usage"]["prompt_tokens"] == len(text.encode())
        check_completion(answer, text)
    events = finished(completions, {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 1, **usage_events})
    assert streamed(events)[0]["completion_tokens"] == 0
    (chunks,) = streamed(events)[1].values()
    assert [chunk["text"] for chunk in chunks] == [text] and "".join(chunks[0]["logprobs"]["tokens"]) == text
    finished(completions, {"prompt": "Hello", "max_tokens": 3, "echo": True})
    answer = finished(completions, {"prompt": "Hello", "max_tokens": 24, "stop": ["a", "e", "o", " "], "logprobs": 0})
    check_completion(answer)
    answer = finished(completions, {"prompt": "日本", "max_tokens": 24, "logprobs": 3, "temperature": 1.0, "seed": 1})
    check_completion(answer)
    # finished: chat
    messages = [{"role": "user", "content": "你好 😀"}]
    answer = finished(chat, {"messages": messages, "max_tokens": 12, "logprobs": True, "top_logprobs": 3, "seed": 2})
    check_chat(answer["choices"][0], answer["choices"][0]["message"]["content"])
    events = finished(
        chat, {"messages": messages, "max_tokens": 8, "logprobs": True, "top_logprobs": 1, **usage_events}
    )
    (chunks,) = streamed(events)[1].values()
    whole = {
        "logprobs": {"content": [entry for chunk in chunks for entry in (chunk["logprobs"] or {}).get("content", [])]}
    }
    check_chat(whole, "".join(chunk["delta"].get("content", "") for chunk in chunks))
    finished(chat, {"messages": messages, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 4})
    tools = {
        "messages": messages,
        "tools": [TOOL],
        "tool_choice": "required",
        "max_tokens": 80,
        "parallel_tool_calls": False,
    }
    answer = finished(chat, tools)
    assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
    finished(chat, {**tools, **usage_events})
    # refused: by the server (before the engine) and by the engine (a prompt past the context)
    refused(completions, {"prompt": "Hi", "temperature": "hot"}, 400)
    refused(completions, {"model": "other", "prompt": "Hi"}, 404)
    refused(completions, {"prompt": "Hi", "max_tokens": 0}, 400)
    refused(completions, json.dumps({"prompt": "x" * LIMIT}).encode(), 413)
    refused(completions, {"prompt": "x" * CONTEXT, "max_tokens": 4}, 400)
    refused(chat, {"messages": messages, "max_tokens": 4, "n": 5}, 400)  # more samples than the engine holds
    # failed: a grammar that cannot go on (not streamed: 400; streamed: an error event)
    grammar = {"model": MODEL, "messages": messages, "max_tokens": 8, "response_format": FAILING}
    status, answer = post(server, chat, grammar)
    assert status == 400 and answer["error"]["param"] == "response_format", answer
    status, events = post(server, chat, {**grammar, "stream": True})
    said.outcomes["failed"] += 2
    # overloaded and aborted: a stream holding every slot, a request past it, then its client leaves
    hold = {"model": MODEL, "prompt": "Hold", "max_tokens": 200, "n": SLOTS, "ignore_eos": True, "stream": True}
    connection = opened(server, completions, hold)
    try:
        first_event(connection)
        refused(completions, {"prompt": "Hi", "max_tokens": 2}, 429, "overloaded")
    finally:
        connection.close()
    said.outcomes["aborted"] += 1
    wait_until(server, before, "batchgpu_requests_aborted_total", 1)
    # aborted: a request not streamed whose client leaves while it runs
    connection = opened(server, completions, {**hold, "stream": False, "n": 1})
    try:
        wait_running(server)
    finally:
        connection.close()
    said.outcomes["aborted"] += 1
    after = wait_until(server, before, "batchgpu_requests_aborted_total", 2)

    rose = {name: after[name] - before.get(name, 0.0) for name in after}
    assert rose["batchgpu_prompt_tokens_total"] == said.prompt_tokens
    assert rose["batchgpu_generation_tokens_total"] == said.completion_tokens
    assert {reason: rose[f"batchgpu_request_success_total[{reason}]"] for reason in REASONS} == {
        reason: said.reasons[reason] for reason in REASONS
    }
    assert {outcome: rose[f"batchgpu_requests_{outcome}_total"] for outcome in OUTCOMES} == {
        outcome: said.outcomes[outcome] for outcome in OUTCOMES
    }


def wait_running(server: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while True:
        with urllib.request.urlopen(f"{server}/v1/engine", timeout=60) as response:
            if json.loads(response.read())["running"]:
                return
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.01)


def wait_until(server: str, before: dict[str, float], name: str, rise: int) -> dict[str, float]:
    """The counters once ``name`` rose by ``rise`` (the engine counts an abort as it drops the request)."""
    deadline = time.monotonic() + DEADLINE
    while (now := metrics(server))[name] - before.get(name, 0.0) < rise:
        assert time.monotonic() < deadline, f"{name} rose by {now[name] - before.get(name, 0.0)}, not {rise}"
        time.sleep(0.02)
    return now


def test_tiny_model_file(tmp_path: Path) -> None:
    """The synthetic file's tokenizer is byte-level with 256 byte tokens: its table is exact and every
    character past ASCII splits over tokens."""
    from batchgpu.models.codec import TextCodec
    from batchgpu.models.gguf_reader import GGUFFile
    from batchgpu.models.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", show=False).path
    codec = TextCodec.from_gguf(GGUFFile(path))
    ids = codec.encode("你好", special=False)
    assert len(ids) == 6 and codec.token_bytes.exact
    assert codec.token_bytes.text(ids) == [bytes([b]) for b in "你好".encode()]
