"""``/v1/embeddings``: OpenAI's embeddings request checked and tokenized, the vectors of concurrent requests
computed together on one :class:`~batchgpu.models.encoder.Encoder`, and OpenAI's response.

``input`` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four
forms); texts are truncated at the model's ``max_seq_length`` as sentence-transformers does, token-id
lists are the model's whole input and are refused when longer. A request has at most
:data:`MAX_INPUTS` inputs and :data:`MAX_TOKENS` tokens in all; ``encoding_format`` is ``float`` or
``base64`` (little-endian float32, as OpenAI sends it); ``dimensions`` is refused unless it is the model's
own. Every refusal is a RequestError naming the field (OpenAI's ``param``)."""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arguments import brief
from ..errors import RequestError
from ..models.encoder import Encoder
from .schema import EMBEDDINGS, check_fields, parse_json

MAX_INPUTS = 2048
"""Inputs one request may have (OpenAI's limit)."""
MAX_TOKENS = 300_000
"""Tokens (after truncation, special tokens included) one request may have in all (OpenAI's limit)."""


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A checked embeddings request: the model asked for (None: not given), each input's token ids, and
    whether vectors go back as base64."""

    model: str | None
    ids: list[np.ndarray]
    base64: bool

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.ids)


def read_embeddings_request(body: bytes, encoder: Encoder) -> EmbeddingsRequest:
    """The embeddings request the JSON ``body`` makes of ``encoder``'s model, its texts tokenized
    (proportional to the body's size: run it off the event loop)."""
    values = check_fields(parse_json(body), EMBEDDINGS)
    dimensions = values.get("dimensions")
    if dimensions is not None and dimensions != encoder.dimensions:
        raise RequestError(
            f"dimensions={dimensions} is not supported: this model's vectors have {encoder.dimensions}", "dimensions"
        )
    ids = input_ids(values.get("input"), encoder)
    request = EmbeddingsRequest(values.get("model"), ids, values.get("encoding_format") == "base64")
    if request.tokens > MAX_TOKENS:
        raise RequestError(f"input has {request.tokens} tokens in all; at most {MAX_TOKENS} per request", "input")
    return request


def input_ids(value: Any, encoder: Encoder) -> list[np.ndarray]:
    """The token ids of each input of ``input`` (OpenAI's four forms), checked."""
    if value is None:
        raise RequestError("input is missing: a string, an array of strings or of token-id arrays", "input")
    if isinstance(value, str) or (isinstance(value, list) and value and is_token_ids(value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise RequestError("input must be a non-empty string or array (of strings or token-id arrays)", "input")
    if len(value) > MAX_INPUTS:
        raise RequestError(f"input has {len(value)} items; at most {MAX_INPUTS} per request", "input")
    if all(isinstance(item, str) for item in value):
        empty = next((i for i, item in enumerate(value) if not item), None)
        if empty is not None:
            raise RequestError(f"input[{empty}] is an empty string; every input must have text", "input")
        return [np.asarray(row, np.int32) for row in encoder.tokenize(value)]
    return [token_ids(item, index, encoder) for index, item in enumerate(value)]


def is_token_ids(value: list[Any]) -> bool:
    return all(isinstance(item, int) and not isinstance(item, bool) for item in value)


def token_ids(item: Any, index: int, encoder: Encoder) -> np.ndarray:
    """One token-id input: 1 to ``max_length`` ids, each a row of the model's vocabulary."""
    if not isinstance(item, list) or not is_token_ids(item):
        raise RequestError(
            f"input[{index}] must be an array of token ids (one form for every input), got {brief(item)}", "input"
        )
    if not 1 <= len(item) <= encoder.max_length:
        raise RequestError(
            f"input[{index}] has {len(item)} token ids; this model takes 1 to {encoder.max_length}", "input"
        )
    bad = next((token for token in item if not 0 <= token < encoder.config.vocab), None)
    if bad is not None:
        raise RequestError(
            f"input[{index}] has token id {brief(bad)}; ids must be in [0, {encoder.config.vocab})", "input"
        )
    return np.asarray(item, np.int32)


def embeddings_response(vectors: np.ndarray, request: EmbeddingsRequest, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response body for ``vectors`` (one row per input)."""

    def encoded(row: np.ndarray) -> Any:
        if request.base64:
            return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        return row.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(vectors)]
    usage = {"prompt_tokens": request.tokens, "total_tokens": request.tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


@dataclass
class Job:
    """One request's inputs and the future of its vectors."""

    ids: Sequence[np.ndarray]
    future: asyncio.Future[np.ndarray]


class EmbeddingService:
    """Embeds the inputs of concurrent requests together: what arrives while a round runs waits, then
    runs as the next round, all its requests' inputs split into device batches by the encoder. Made and
    awaited in one event loop (the device's thread)."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.waiting: deque[Job] = deque()
        self.driver: asyncio.Task[None] | None = None

    def status(self) -> dict[str, int]:
        """Requests waiting for the next round."""
        return {"waiting": len(self.waiting)}

    async def embed(self, ids: Sequence[np.ndarray]) -> np.ndarray:
        """The vectors of the inputs ``ids`` (checked token ids), one row each."""
        job = Job(ids, asyncio.get_running_loop().create_future())
        self.waiting.append(job)
        if self.driver is None or self.driver.done():
            self.driver = asyncio.create_task(self.drive())
        return await job.future

    async def drive(self) -> None:
        """Run rounds while requests wait."""
        while self.waiting:
            jobs = [job for job in self.waiting if not job.future.done()]  # done: the client left
            self.waiting.clear()
            if jobs:
                await self.round(jobs)

    async def round(self, jobs: list[Job]) -> None:
        """Embed every input of ``jobs`` in one call and hand each job its rows (or the failure)."""
        try:
            vectors = await self.encoder.embed_async([row for job in jobs for row in job.ids])
        except Exception as exc:
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        start = 0
        for job in jobs:
            if not job.future.done():
                job.future.set_result(vectors[start : start + len(job.ids)])
            start += len(job.ids)
