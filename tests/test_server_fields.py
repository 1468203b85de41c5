"""Hostile requests by class, against ``python -m batchgpu serve`` started here on 127.0.0.1 (a synthetic
tiny Llama with a byte vocabulary, and a tiny random BERT for ``/v1/embeddings``, on the reference executor):

- type confusion: every field of ``schema.FIELDS`` on every endpoint that has it, and every position of
  every nested structure (messages of each role and their keys, content parts, tool calls and their
  function, tools and their schemas, tool_choice, response_format, stream_options, stop, embeddings
  inputs in OpenAI's four forms, the tokenizer endpoints' bodies), each given a value of every JSON type
  (null, booleans, numbers from -1 to 10**30, strings empty, long, with NUL or a lone surrogate, arrays
  and objects empty, mixed or 20 deep) and an unknown key in every object: the answer is a 200 or a 4xx
  with OpenAI's error body whose ``param`` names a field of the request, never a 5xx, never a hang;
- JSON schemas that refer to themselves: those without a finite value (``{"$ref": "#"}``, a ``$ref``
  cycle, a required or optional property holding the schema again, a non-empty array of itself, ...) are
  400 naming ``response_format`` (``tools`` for a function's parameters) before anything runs, while
  recursive schemas with an end (a tree with optional children, a linked list ended by null, an
  expression tree) are served and every output that stops is valid JSON for them (``jsonschema``);
- slow clients: connections that trickle their headers or body a byte at a time, or send nothing, beside
  normal requests that complete promptly; each slow one is answered 408 (or closed) after
  ``--header-timeout`` / ``--body-timeout``, and the server's memory does not grow with them.

Every request is bounded by a timeout; the servers are stopped at the end."""

from __future__ import annotations

import copy
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchgpu.errors import GrammarError, RequestError
from batchgpu.llm.schema import CHAT, COMPLETIONS, DETOKENIZE, EMBEDDINGS, FIELDS, TOKENIZE
from batchgpu.llm.structured import StructuredOutput, infinite_schema

from .servers import batchgpu_server, free_port, server_pid
from .test_encoder import write_bert

pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")
pytest.importorskip("llguidance", reason="structured outputs use llguidance (pip install 'batchgpu[llm]')")
jsonschema = pytest.importorskip("jsonschema", reason="the outputs are checked against their schemas (test extra)")
psutil = pytest.importorskip("psutil", reason="the slow-client test reads the server's memory")

MODEL = "tiny"  # the served name: the synthetic file's stem
HEADER_TIMEOUT, BODY_TIMEOUT = 1.5, 2.0  # the generation server's --header-timeout / --body-timeout
PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    TOKENIZE: "/tokenize",
    DETOKENIZE: "/detokenize",
    EMBEDDINGS: "/v1/embeddings",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from batchgpu.models.synth import write_synthetic

    path = write_synthetic(tmp_path_factory.mktemp("fields") / f"{MODEL}.gguf", "tiny-llama", "q8_0", show=False).path
    sizes = ["--max-batch", "4", "--max-context", "256"]
    timeouts = ["--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT)]
    with batchgpu_server("--model", str(path), "--device", "reference", *sizes, *timeouts, startup=120) as url:
        yield url


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory = write_bert(tmp_path_factory.mktemp("bert") / "tiny-bert", np.random.default_rng(3))
    with batchgpu_server("--model", str(directory), "--device", "reference", startup=120) as url:
        yield url


class Client:
    """One keep-alive connection to a server (opened again after an answer that closes it)."""

    def __init__(self, url: str) -> None:
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.connection = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def post(self, path: str, body: Any) -> tuple[int, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.connection.request("POST", path, data, {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        raw = response.read()
        if response.status >= 500 or (response.getheader("connection") or "").lower() == "close":
            self.connection.close()
            self.connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        return response.status, raw


# type confusion -----------------------------------------------------------------------------------------


def deep(levels: int, kind: type) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value] if kind is list else {"k": value}
    return value


VALUES: list[Any] = [
    None, True, False, 0, -1, 1.5, 10**30, -(10**30), "", "x", "\ud800", "a\udfffb", "\x00", "x\x00y",
    "é" * 3000, [], {}, [None], [1, "x"], [[]], [{}], ["\udfff"], {"a": None}, {"\ud800": 1}, {"": ""},
    deep(20, list), deep(20, dict),
]  # fmt: skip
"""A value of every JSON type and of every kind of text, put at every position of every request."""

TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {"a": {}}}},
}
BASES: dict[str, list[dict[str, Any]]] = {
    CHAT: [
        {
            "messages": [
                {"role": "system", "content": "s", "name": "n"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
                {"role": "tool", "content": "r", "tool_call_id": "c"},
            ],
            "tools": [TOOL],
            "tool_choice": "none",
            "parallel_tool_calls": False,
            "max_tokens": 1,
        },
        {
            "messages": [{"role": "user", "content": "hi"}],
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "stop": ["x", "y"],
            "stop_token_ids": [1],
            "logprobs": True,
            "top_logprobs": 1,
            "logit_bias": {},
            "n": 1,
            "seed": 1,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 3,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "ignore_eos": False,
            "user": "u",
            "max_completion_tokens": 1,
        },
        {
            "messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "description": "d",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                    "strict": True,
                },
            },
        },
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "response_format": {"type": "json_object"}},
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
    ],
    COMPLETIONS: [
        {"prompt": "Hi", "max_tokens": 1, "echo": True, "logprobs": 1, "best_of": 1, "stop": "x", "suffix": None},
        {"prompt": [1, 2], "max_tokens": 1},
        {"prompt": [[1, 2]], "max_tokens": 1, "stream": True, "stream_options": {"include_usage": False}},
        {"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [1, 2], "logit_bias": {}},
        {"prompt": ["Hi"], "max_tokens": 1, "response_format": {"type": "text"}},
    ],
    TOKENIZE: [
        {"prompt": "Hi", "add_special_tokens": True, "return_token_strs": True, "model": MODEL},
        {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
    ],
    DETOKENIZE: [{"tokens": [72, 105], "model": MODEL}],
}
EMBEDDING_BASES = [
    {"input": "Hi", "model": "tiny-bert", "encoding_format": "float", "dimensions": 20, "user": "u"},
    {"input": ["Hi", "there"], "encoding_format": "base64"},
    {"input": [1, 2, 3]},
    {"input": [[1, 2], [3]]},
]
MINIMAL = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 1},
    TOKENIZE: {"prompt": "Hi"},
    DETOKENIZE: {"tokens": [72]},
    EMBEDDINGS: {"input": "Hi"},
}
"""The smallest valid body of each endpoint: every field of FIELDS is put on it with each value."""


def positions(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every value nested in ``value`` (keys and indices), outermost first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from positions(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from positions(item, (*prefix, index))


def put(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of ``body`` with ``value`` at ``path``."""
    body = copy.deepcopy(body)
    node: Any = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return body


def variants(base: dict[str, Any], endpoint: str) -> Iterator[dict[str, Any]]:
    """``base`` with each value of VALUES at each of its positions, and with an unknown key in each of its
    objects; the endpoint's smallest body with each value in each of its FIELDS."""
    for path in positions(base):
        if path:
            for value in VALUES:
                yield put(base, path, value)
        node: Any = base
        for step in path:
            node = node[step]
        if isinstance(node, dict):
            yield put(base, (*path, "unknown_key"), 1)
    for name, field in FIELDS.items():
        if endpoint in field.endpoints:
            for value in VALUES:
                yield put(MINIMAL[endpoint], (name,), value)


def problem(status: int, raw: bytes, body: dict[str, Any], endpoint: str) -> str | None:
    """What is wrong with the answer ``(status, raw)`` to ``body`` (sent to ``endpoint``): a 5xx, a 2xx that
    is not JSON or an event stream, or a refusal without OpenAI's error body naming a field of the request
    (or one of the endpoint's it lacks)."""
    if status == 200:
        text = raw.decode()
        if body.get("stream") is True:
            return None if text.endswith("data: [DONE]\n\n") or '"error"' in text else f"a stream cut: {text[-80:]}"
        return None if isinstance(json.loads(text), dict) else "not a JSON object"
    if status not in (400, 404):
        return f"status {status}: {raw[:200]!r}"
    error = json.loads(raw).get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not OpenAI's error body: {raw[:200]!r}"
    if error["type"] != "invalid_request_error" or not isinstance(error["message"], str):
        return f"not a request error: {error}"
    param = error["param"]
    if param not in body and not (param in FIELDS and endpoint in FIELDS[param].endpoints and body.get(param) is None):
        return f"param {param!r} is no field of the request (nor one it misses): {error['message'][:160]}"
    return None


def confusion(url: str, endpoint: str, bases: list[dict[str, Any]]) -> list[str]:
    """Every variant of ``bases`` sent to ``endpoint``; the problems found (none expected)."""
    client, found = Client(url), []
    for base in bases:
        status, raw = client.post(PATHS[endpoint], base)  # valid: each variant changes one thing
        assert status == 200 or b"exceed the engine's max_context" in raw, (base, raw)  # (tools: a long prompt)
        for body in variants(base, endpoint):
            status, raw = client.post(PATHS[endpoint], body)
            issue = problem(status, raw, body, endpoint)
            if issue is not None:
                found.append(f"{json.dumps(body)[:240]}\n    -> {issue}")
    return found


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE])
def test_every_field_and_nested_value_of_every_type_is_answered_or_refused(server: str, endpoint: str) -> None:
    found = confusion(server, endpoint, BASES[endpoint])
    assert not found, f"{len(found)} bad answers:\n" + "\n".join(found[:30])
    assert Client(server).post(PATHS[COMPLETIONS], MINIMAL[COMPLETIONS])[0] == 200  # the server goes on


def test_every_embeddings_field_and_input_form_is_answered_or_refused(embedding_server: str) -> None:
    found = confusion(embedding_server, EMBEDDINGS, EMBEDDING_BASES)
    assert not found, f"{len(found)} bad answers:\n" + "\n".join(found[:30])
    assert Client(embedding_server).post(PATHS[EMBEDDINGS], MINIMAL[EMBEDDINGS])[0] == 200


def test_the_bases_hold_every_field_that_nests() -> None:
    """Every array or object field of FIELDS is in a base of each of its endpoints, so that each position
    nested in it is varied (the other fields are varied on the endpoint's smallest body)."""
    for name, field in FIELDS.items():
        for endpoint in field.endpoints if {"array", "object"} & set(field.types) else ():
            bases = EMBEDDING_BASES if endpoint == EMBEDDINGS else BASES[endpoint]
            assert any(name in base for base in bases), (name, endpoint)


HOSTILE = [  # (id, endpoint, body, status, param, part of the message): one per class found in the audit
    ("tool_calls-a-number", CHAT, {"messages": [{"role": "assistant", "content": "a", "tool_calls": 5}]}, 400,
     "messages", "tool_calls must be an array"),
    ("tool_calls-an-object", CHAT, {"messages": [{"role": "assistant", "tool_calls": {"id": "c"}}]}, 400,
     "messages", "tool_calls must be an array"),
    ("tool_call-arguments-nested-100000-deep", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]}, 400, "messages", "levels deep"),
    ("tool_call-arguments-not-json", CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{"}}]}]}, 400, "messages", "must be JSON text"),
    ("message-name-a-number", CHAT, {"messages": [{"role": "user", "content": "a", "name": 5}]}, 400, "messages",
     "name must be a string"),
    ("input-lone-surrogate", EMBEDDINGS, {"input": "a\ud800"}, 400, "input", "lone surrogate"),
    ("input-lone-surrogate-listed", EMBEDDINGS, {"input": ["ok", "\udfff"]}, 400, "input", "input[1]"),
    ("model-lone-surrogate", CHAT, {"model": "\ud800", "messages": []}, 400, "model", "lone surrogate"),
    ("stop-lone-surrogate", COMPLETIONS, {"prompt": "a", "stop": ["\ud800"]}, 400, "stop", "stop[0] is not valid"),
    ("tokenize-lone-surrogate", TOKENIZE, {"prompt": "\ud800"}, 400, "prompt", "lone surrogate"),
    ("tool-description-lone-surrogate", CHAT, {"messages": [{"role": "user", "content": "a"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "\udfff"}}]}, 400, "tools", "description"),
    ("schema-key-lone-surrogate", CHAT, {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"properties": {"\ud800": {}}}}}}, 400,
     "response_format", "the name of response_format.json_schema.schema.properties.\\ud800"),
    ("user-lone-surrogate", COMPLETIONS, {"prompt": "a", "user": "\ud800"}, 400, "user", "lone surrogate"),
    ("tools-invalid-with-choice-none", CHAT, {"messages": [{"role": "user", "content": "a"}], "tools": [5],
                                             "tool_choice": "none"}, 400, "tools", "must be"),
    ("max_tokens-past-the-context-alone", COMPLETIONS, {"prompt": "a", "max_tokens": 10**30}, 400, "max_tokens",
     "exceed the engine's max_context"),
    ("chat-prompt-past-the-context", CHAT, {"messages": [{"role": "user", "content": "x" * 1000}]}, 400,
     "messages", "exceed the engine's max_context"),
    ("max_completion_tokens-past-the-context", CHAT, {"messages": [{"role": "user", "content": "a"}],
                                                     "max_completion_tokens": 300}, 400, "max_completion_tokens",
     "exceed the engine's max_context"),
    ("schema-the-grammar-engine-panics-on", CHAT, {"messages": [{"role": "user", "content": "a"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "required": "é" * 200}}}},
     400, "response_format", "the grammar engine failed on the response_format"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("endpoint", "body", "status", "param", "message"), [pytest.param(*c[1:], id=c[0]) for c in HOSTILE]
)
def test_hostile_bodies_are_refused_naming_their_field(
    server: str, embedding_server: str, endpoint: str, body: Any, status: int, param: str, message: str
) -> None:
    url = embedding_server if endpoint == EMBEDDINGS else server
    got, raw = Client(url).post(PATHS[endpoint], body)
    error = json.loads(raw)["error"]
    assert (got, error["param"]) == (status, param) and message in error["message"], error


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a", "temperature": 1e999}', "the number 1e999 is out of range"),
        ('{"prompt": "a", "temperature": -Infinity}', "-Infinity is not a JSON value"),
        ('{"prompt": "a\\ud83d\\ude00", "max_tokens": 1}', None),  # a surrogate pair is text
    ],
)
def test_numbers_out_of_range_are_refused_and_surrogate_pairs_served(server: str, text: str, message: Any) -> None:
    status, raw = Client(server).post(PATHS[COMPLETIONS], text.encode())
    if message is None:
        assert status == 200, raw
    else:
        assert status == 400 and message in json.loads(raw)["error"]["message"], raw


# JSON schemas ---------------------------------------------------------------------------------------------

TREE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["v"],
    "additionalProperties": False,
}
LINKED = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]},
            },
            "required": ["v", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
EXPRESSION = {
    "$defs": {
        "e": {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 9},
                {
                    "type": "object",
                    "properties": {
                        "op": {"enum": ["+", "*"]},
                        "args": {"type": "array", "items": {"$ref": "#/$defs/e"}, "minItems": 2, "maxItems": 2},
                    },
                    "required": ["op", "args"],
                    "additionalProperties": False,
                },
            ]
        }
    },
    "$ref": "#/$defs/e",
}
FINITE = {"tree": TREE, "linked-list": LINKED, "expression": EXPRESSION}
INFINITE = {  # each with the subschema named as the one that cannot be completed
    "ref-to-itself": ({"$ref": "#"}, "#"),
    "ref-cycle": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a"),
    "ref-cycle-of-three": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/c"}, "c": {"$ref": "#/$defs/a"}},
         "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}},
        "#/properties/x",
    ),
    "required-property-of-itself": (
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#/properties/a"),
    "optional-property-that-is-its-own-ref": (
        {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}}, "#/properties/a"),
    "non-empty-array-of-itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#/items"),
    "allOf-itself": ({"type": "object", "allOf": [{"$ref": "#"}]}, "#/allOf/0"),
    "oneOf-only-itself": ({"oneOf": [{"$ref": "#"}]}, "#/oneOf/0"),
    "mutual-object-and-array": (
        {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                   "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}, "$ref": "#/$defs/a"},
        "#/$defs/a",
    ),
    "anyOf-branch-without-end": (
        {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"a": {"$ref": "#/anyOf/1"}},
                                      "required": ["a"]}]},
        "#/anyOf/1",
    ),
    "additional-properties-of-itself": (
        {"type": "object", "minProperties": 1, "additionalProperties": {"$ref": "#"}}, "#/additionalProperties"),
    "anchor-to-itself": (
        {"$anchor": "me", "type": "object", "properties": {"a": {"$ref": "#me"}}, "required": ["a"]}, "#/properties/a"),
}  # fmt: skip


def schema_request(schema: Any, **fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        **fields,
    }


@pytest.mark.parametrize(("schema", "where"), INFINITE.values(), ids=INFINITE)
def test_schemas_without_a_finite_value_are_found(schema: dict[str, Any], where: str) -> None:
    assert infinite_schema(schema) == where
    with pytest.raises(RequestError, match="has no finite value") as refused:
        StructuredOutput(json_schema=schema)
    assert refused.value.param == "response_format"


@pytest.mark.parametrize("schema", [*FINITE.values(), {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                    {"type": "object", "properties": {"a": {"$ref": "#"}}},
                                    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # a string is one
                                    {"$defs": {"unused": {"$ref": "#/$defs/unused"}}, "type": "string"},
                                    {"$ref": "#/$defs/missing"}, {"type": "array", "items": {"$ref": "#"}}],
                         ids=[*FINITE, "anyOf-null", "optional-self", "untyped", "unused-cycle", "unresolved",
                              "array-may-be-empty"])  # fmt: skip
def test_schemas_with_an_end_are_finite(schema: dict[str, Any]) -> None:
    assert infinite_schema(schema) is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("schema", "where"), INFINITE.values(), ids=INFINITE)
def test_self_referencing_schemas_are_400_before_anything_runs(
    server: str, schema: dict[str, Any], where: str, stream: bool
) -> None:
    status, raw = Client(server).post(PATHS[CHAT], schema_request(schema, stream=stream))
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "response_format", raw
    assert f"has no finite value: {where} cannot be completed" in error["message"]


@pytest.mark.parametrize("choice", ["auto", "none", "required"])
def test_self_referencing_tool_parameters_are_400_naming_tools(server: str, choice: str) -> None:
    tool = {"type": "function", "function": {"name": "loop", "parameters": INFINITE["ref-cycle"][0]}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": choice}
    status, raw = Client(server).post(PATHS[CHAT], body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tools" and "function loop" in error["message"], raw


@pytest.mark.parametrize("schema", FINITE.values(), ids=FINITE)
def test_recursive_schemas_with_an_end_give_valid_json(server: str, schema: dict[str, Any]) -> None:
    """Sampled at temperature 1 with several seeds: every output that stops is valid for its schema (one cut
    by max_tokens may not be, as OpenAI's), and most stop."""
    client, stopped = Client(server), 0
    for seed in range(6):
        status, raw = client.post(PATHS[CHAT], schema_request(schema, temperature=1.0, seed=seed))
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
            stopped += 1
        else:
            assert choice["finish_reason"] == "length", choice
    assert stopped >= 3


def test_a_grammar_with_no_output_or_that_gets_stuck_is_refused(tmp_path: Path) -> None:
    """The grammar engine's own findings, beyond what a schema shows: a grammar with no output at all is
    refused before its request runs (RequestError naming its field); one that gets stuck (only the end can
    follow text it does not accept) fails at that token (GrammarError), never ends as if whole."""
    from batchgpu.llm.grammar import GrammarEngine, mask_words
    from batchgpu.models.codec import TextCodec
    from batchgpu.models.gguf_reader import GGUFFile
    from batchgpu.models.synth import write_synthetic

    codec = TextCodec.from_gguf(GGUFFile(write_synthetic(tmp_path / "t.gguf", "tiny-llama", "q8_0", show=False).path))
    engine = GrammarEngine(codec, 512)
    with pytest.raises(RequestError, match="finds no output it allows") as refused:
        engine.guides(engine.compile(StructuredOutput(lark='start: x\nx: x "b"', param="tools")), 1, "tools")
    assert refused.value.param == "tools"
    guide = engine.guides(engine.compile(StructuredOutput(lark='start: "a" x\nx: x "b"')), 1)[0]
    row = np.zeros(mask_words(512), np.uint32)
    guide.fill(row)
    guide.accept(codec.encode("a", special=False)[0])
    guide.fill(row)
    allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()
    assert allowed == sorted(codec.eos_ids)  # stuck: only the end
    with pytest.raises(GrammarError, match="ended short of a whole output") as failed:
        guide.accept(allowed[0])
    assert failed.value.param == "response_format"


# slow clients -------------------------------------------------------------------------------------------


def server_process(url: str) -> Any:
    """The server's process (a child of this one, listening on ``url``'s port)."""
    return psutil.Process(server_pid(url))


def slow_client(url: str, kind: str, answers: dict[int, bytes], index: int, stop: threading.Event) -> None:
    """A client that trickles one byte every 0.2 s: its ``"head"``, or a whole head then its ``"body"``, or
    ``"nothing"`` at all; what the server answered before closing goes to ``answers[index]``."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(MINIMAL[COMPLETIONS]).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        if kind == "body":
            connection.sendall(head)
        trickle = {"head": head + body, "body": body, "nothing": b""}[kind]
        connection.settimeout(0.2)
        answer = b""
        for byte in [trickle[i : i + 1] for i in range(len(trickle))] or [b""] * 1000:
            if stop.is_set():
                break
            try:
                if byte:
                    connection.sendall(byte)
                data = connection.recv(65536)
                answer += data
                if not data:
                    break
            except TimeoutError:
                continue
            except OSError:  # closed by the server while sending
                break
        answers[index] = answer


def test_slow_clients_are_cut_off_and_hold_nothing(server: str) -> None:
    """30 slow clients (trickling their headers or body a byte every 0.2 s, or silent) beside a client
    that keeps sending normal requests: each normal request is answered within a second, each slow client
    gets a 408 with OpenAI's error body (or its connection closed) soon after the limit, and a second wave
    of them leaves the server's memory where the first left it."""
    process, client = server_process(server), Client(server)
    kinds = ["head", "body", "nothing"]

    def wave() -> tuple[dict[int, bytes], list[float], float]:
        answers: dict[int, bytes] = {}
        stop = threading.Event()
        threads = [
            threading.Thread(target=slow_client, args=(server, kinds[i % 3], answers, i, stop)) for i in range(30)
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        latencies = []
        while any(thread.is_alive() for thread in threads) and time.monotonic() - start < 20:
            begun = time.monotonic()
            assert client.post(PATHS[COMPLETIONS], MINIMAL[COMPLETIONS])[0] == 200
            latencies.append(time.monotonic() - begun)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        return answers, latencies, time.monotonic() - start

    answers, latencies, took = wave()
    before = process.memory_info().rss
    assert took < HEADER_TIMEOUT + BODY_TIMEOUT + 5, took  # every slow client was cut off, none ran to its end
    assert len(latencies) >= 5 and max(latencies) < HEADER_TIMEOUT - 0.5, latencies  # none waited for a slow one
    for index, answer in answers.items():
        if answer:  # a 408 with OpenAI's body, then the connection closed
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error", error
            limit = "headers" if kinds[index % 3] != "body" else "body"
            assert limit in error["message"], error
    assert sum(answer.startswith(b"HTTP/1.1 408 ") for answer in answers.values()) >= 20
    wave()
    assert process.memory_info().rss - before < 20 * 2**20  # the second wave kept nothing


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An ASGI app that reads the body and answers 200."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_the_head_deadline_holds_with_either_of_uvicorns_parsers(parser: str) -> None:
    """``timed_protocol`` over uvicorn's httptools and h11 protocols: a whole request is served; a head that
    trickles, a silent connection and a keep-alive connection's next head that trickles are each answered
    408 and closed once the deadline passes."""
    import uvicorn
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    from batchgpu.llm.server import timed_protocol

    pytest.importorskip(parser)
    port = free_port()
    http = timed_protocol(import_from_string(HTTP_PROTOCOLS[parser]), 0.5)
    config = uvicorn.Config(hello, host="127.0.0.1", port=port, http=http, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        for first, sent in ((b"", b"GET / HTT"), (b"", b""), (request, b"GET / HT")):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
                if first:  # a whole request answered, then the next one's head trickles on the same connection
                    connection.sendall(first)
                    answer = b""
                    while b"ok" not in answer:
                        answer += connection.recv(65536)
                    assert answer.startswith(b"HTTP/1.1 200 "), answer
                begun = time.monotonic()
                connection.sendall(sent)
                answer = b""
                while data := connection.recv(65536):
                    answer += data
                took = time.monotonic() - begun
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code": "request_timeout"' in answer, answer
            assert 0.4 < took < 3, took
    finally:
        server.should_exit = True
        thread.join(timeout=30)
