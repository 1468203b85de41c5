"""``/v1/embeddings``: OpenAI's embeddings request checked and tokenized, the vectors of concurrent requests
computed together on one :class:`~batchgpu.models.encoder.Encoder`, and OpenAI's response.

``input`` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's four
forms); texts are truncated at the model's ``max_seq_length`` as sentence-transformers does, token-id
lists are the model's whole input and are refused when longer. A request has at most
:data:`MAX_INPUTS` inputs and :data:`MAX_TOKENS` tokens in all; ``encoding_format`` is ``float`` or
``base64`` (little-endian float32, as OpenAI sends it); ``dimensions`` is refused unless it is the model's
own. Every refusal is a RequestError naming the field (OpenAI's ``param``). An
:class:`EmbeddingService` with ``max_waiting`` holds at most ``max_batch + max_waiting`` texts (embedding,
waiting or being tokenized) and refuses a request past that with OverloadedError before its texts are
tokenized."""

from __future__ import annotations

import asyncio
import base64
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..arguments import brief
from ..errors import RequestError
from ..models.codec import check_text
from ..models.encoder import Encoder
from .admission import Places, check_max_waiting
from .schema import EMBEDDINGS, check_fields, parse_json

MAX_INPUTS = 2048
"""Inputs one request may have (OpenAI's limit)."""
MAX_TOKENS = 300_000
"""Tokens (after truncation, special tokens included) one request may have in all (OpenAI's limit)."""


Inputs = Sequence[str] | Sequence[np.ndarray]
"""A request's inputs: texts, or each input's checked token ids."""


@dataclass(frozen=True)
class EmbeddingsRequest:
    """A checked embeddings request: the model asked for (None: not given), its inputs (not tokenized yet),
    and whether vectors go back as base64."""

    model: str | None
    inputs: Inputs
    base64: bool


def read_embeddings_request(body: bytes, encoder: Encoder) -> EmbeddingsRequest:
    """The embeddings request the JSON ``body`` makes of ``encoder``'s model, its texts not tokenized yet
    (:meth:`EmbeddingService.embed` tokenizes them; proportional to the body's size: run it off the event
    loop)."""
    values = check_fields(parse_json(body), EMBEDDINGS)
    dimensions = values.get("dimensions")
    if dimensions is not None and dimensions != encoder.dimensions:
        raise RequestError(
            f"dimensions={dimensions} is not supported: this model's vectors have {encoder.dimensions}", "dimensions"
        )
    return EmbeddingsRequest(
        values.get("model"), input_items(values.get("input"), encoder), values.get("encoding_format") == "base64"
    )


def tokenized(inputs: Inputs, encoder: Encoder) -> list[np.ndarray]:
    """The token ids of each of ``inputs`` (texts tokenized, at most :data:`MAX_TOKENS` in all)."""
    if inputs and isinstance(inputs[0], str):  # one form for every input (input_items)
        for index, item in enumerate(inputs):
            check_text(item, f"input[{index}]", "input")  # a lone surrogate is no text (as in a prompt)
        ids = [np.asarray(row, np.int32) for row in encoder.tokenize([str(item) for item in inputs])]
    else:
        ids = [np.asarray(item, np.int32) for item in inputs]
    tokens = sum(len(row) for row in ids)
    if tokens > MAX_TOKENS:
        raise RequestError(f"input has {tokens} tokens in all; at most {MAX_TOKENS} per request", "input")
    return ids


def input_items(value: Any, encoder: Encoder) -> Inputs:
    """The inputs of ``input`` (OpenAI's four forms), checked: its texts, or each input's token ids."""
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
        return value
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


def embeddings_response(vectors: np.ndarray, tokens: int, request: EmbeddingsRequest, model: str) -> dict[str, Any]:
    """OpenAI's embeddings response body for ``vectors`` (one row per input, of ``tokens`` in all)."""

    def encoded(row: np.ndarray) -> Any:
        if request.base64:
            return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
        return row.tolist()

    data = [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(vectors)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


@dataclass
class Job:
    """One request's inputs and the future of its vectors."""

    ids: Sequence[np.ndarray]
    future: asyncio.Future[np.ndarray]


class EmbeddingService:
    """Embeds the inputs of concurrent requests together: what arrives while a round runs waits, then
    runs as the next round, all its requests' inputs split into device batches by the encoder. Made and
    awaited in one event loop (the device's thread).

    ``max_waiting`` bounds the texts held: at most ``encoder.max_batch + max_waiting`` (embedding, waiting
    or being tokenized; a request of k inputs counts k), a request past that refused at once with
    :class:`~batchgpu.errors.OverloadedError` before its texts are tokenized (the server answers 429), one
    of more inputs than that ever with RequestError; a request that ends gives its places back. None (the
    default): unbounded."""

    def __init__(self, encoder: Encoder, max_waiting: int | None = None) -> None:
        check_max_waiting("EmbeddingService", max_waiting)
        self.encoder = encoder
        self.max_waiting = max_waiting
        self.room = Places(
            encoder.max_batch, max_waiting, owner="the embedding service", unit="texts",
            states="embedding, waiting or being tokenized", verb="has",
            too_many=lambda count, most, bound: RequestError(
                f"input has {count} items; this server holds at most {most} texts {bound}", "input"),
        )  # fmt: skip
        self.waiting: deque[Job] = deque()
        self.driver: asyncio.Task[None] | None = None

    def status(self) -> dict[str, int]:
        """Requests waiting for the next round, and the texts held."""
        return {"waiting": len(self.waiting), "held": self.held}

    @property
    def held(self) -> int:
        """Texts of the requests taken and not ended: embedding, waiting or being tokenized."""
        return self.room.held

    def check_room(self, inputs: int = 1) -> None:
        """Refuse a request of ``inputs`` texts the service has no room for now (OverloadedError) or ever
        (RequestError naming ``input``); nothing where ``max_waiting`` is None. A server asks before it
        reads a body."""
        self.room.check(inputs)

    @contextmanager
    def places(self, inputs: int) -> Iterator[None]:
        """Hold a place per text of a request while the block runs (:attr:`held`), refused by
        :meth:`check_room`."""
        self.check_room(inputs)
        with self.room.hold(inputs):
            yield

    async def embed(self, inputs: Inputs) -> tuple[np.ndarray, int]:
        """The vectors of ``inputs`` (texts, tokenized here off the event loop, or checked token ids), one
        row each, and the tokens they had in all."""
        with self.places(len(inputs)):  # OverloadedError before anything is done for the request
            ids = await asyncio.to_thread(tokenized, inputs, self.encoder)
            job = Job(ids, asyncio.get_running_loop().create_future())
            self.waiting.append(job)
            if self.driver is None or self.driver.done():
                self.driver = asyncio.create_task(self.drive())
            return await job.future, sum(len(row) for row in ids)

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
