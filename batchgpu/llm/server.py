"""An OpenAI-compatible HTTP server over one :class:`~batchgpu.llm.Engine` (Starlette on uvicorn):
``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed over server-sent
events with ``"stream": true``. A client that disconnects mid-stream cancels its request (its slot is
freed at the next step). The engine is made in the server's event-loop thread (a Device belongs to one
thread)."""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from ..errors import RequestError
from .engine import Engine, Piece
from .params import SamplingParams

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
)
"""Request fields that become :class:`SamplingParams` (``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``: vLLM's extensions of the OpenAI API)."""

UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None}
"""Request fields accepted only at these values."""


def create_app(make_engine: Callable[[], Any], model_name: str) -> Any:
    """The ASGI app; ``make_engine`` runs once at startup, in the server's thread, and returns an
    :class:`Engine` or anything with its ``generate`` (async iterator of pieces) and ``status`` (a dict,
    or an awaitable of one): :class:`batchgpu.llm.ray_serve.RemoteEngine` serves replicas on Ray."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    state: dict[str, Engine] = {}

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        state["engine"] = make_engine()
        yield

    async def models(request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "batchgpu"}]}
        )

    async def engine_status(request: Request) -> Response:
        status = state["engine"].status()
        return JSONResponse(await status if inspect.isawaitable(status) else status)

    async def completions(request: Request) -> Response:
        return await _serve(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _serve(request, chat=True)

    async def _serve(request: Request, *, chat: bool) -> Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            prompt = _messages(body) if chat else _prompt(body)
            params = _sampling(body)
        except (RequestError, ValueError) as exc:
            return _error(400, str(exc))
        engine = state["engine"]
        kind = "chat.completion" if chat else "text_completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        pieces = engine.generate(prompt, params)
        try:
            first = await pieces.__anext__()  # refusals (too long, bad ids) become HTTP errors, not streams
        except RequestError as exc:
            return _error(400, str(exc))
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = _events(first, pieces, chat=chat, ident=ident, created=created, model=model_name, usage=usage)
            return StreamingResponse(events, media_type="text/event-stream")
        text, last = [first.text], first
        async for piece in pieces:
            text.append(piece.text)
            last = piece
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        return JSONResponse(
            {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": _usage(last),
            }
        )

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/engine", engine_status, methods=["GET"]),  # not OpenAI's: running/waiting requests, KV blocks
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _events(
    first: Piece, pieces: AsyncIterator[Piece], *, chat: bool, ident: str, created: int, model: str, usage: bool
) -> AsyncIterator[str]:
    """Server-sent events of a streamed generation; closing it (a client gone) cancels the request."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
        data = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice], **(extra or {})}
        return f"data: {json.dumps(data)}\n\n"

    def chunk(piece: Piece, role: bool) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if piece.text or not role:
                delta["content"] = piece.text
            return event({"index": 0, "delta": delta, "finish_reason": piece.finish_reason})
        return event({"index": 0, "text": piece.text, "logprobs": None, "finish_reason": piece.finish_reason})

    try:
        last = first
        yield chunk(first, role=True)
        try:
            async for piece in pieces:
                last = piece
                yield chunk(piece, role=False)
        except RequestError as exc:  # failed mid-stream (a replica lost): an error event, then the end
            yield f"data: {json.dumps(_error_body(str(exc), type(exc).__name__))}\n\n"
            return
        if usage:
            summary = {"id": ident, "object": kind, "created": created, "model": model, "choices": []}
            yield f"data: {json.dumps({**summary, 'usage': _usage(last)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()


def _usage(piece: Piece) -> dict[str, int]:
    return {
        "prompt_tokens": piece.prompt_tokens,
        "completion_tokens": piece.completion_tokens,
        "total_tokens": piece.prompt_tokens + piece.completion_tokens,
    }


def _error(status: int, message: str) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(_error_body(message, "invalid_request_error"), status)


def _error_body(message: str, kind: str) -> dict[str, Any]:
    """OpenAI's error object: the body of a refusal, and the last event of a stream that failed."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise RequestError("prompt must be a string or a list of token ids (one prompt per request)")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        out.append({"role": message.get("role") if isinstance(message, dict) else None, "content": content})
    return out


def _sampling(body: dict[str, Any]) -> SamplingParams:
    for name, allowed in UNSUPPORTED.items():
        if body.get(name, allowed) not in (allowed, None):
            raise RequestError(f"{name}={body[name]!r} is not supported (only {allowed!r})")
    values = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        values["max_tokens"] = body["max_completion_tokens"]
    try:
        return SamplingParams(**values)
    except TypeError as exc:
        raise RequestError(str(exc)) from None


def serve(make_engine: Callable[[], Engine], *, model_name: str, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server until interrupted (uvicorn, one worker: one engine owns the device)."""
    import uvicorn

    uvicorn.run(create_app(make_engine, model_name), host=host, port=port, log_level="info")
