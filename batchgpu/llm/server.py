"""An OpenAI-compatible HTTP server over one :class:`~batchgpu.llm.Engine` (Starlette on uvicorn):
``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed over server-sent
events with ``"stream": true``, ``GET /metrics`` for Prometheus (:mod:`batchgpu.llm.metrics`) and vLLM's
``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (:mod:`batchgpu.llm.tokenization`); or, for an
encoder model, ``POST /v1/embeddings`` over an :class:`~batchgpu.llm.embeddings.EmbeddingService`. A client
that leaves aborts its request at once, streamed or not, running or waiting: a task watches each generation
request's connection for ASGI's ``http.disconnect`` and cancels the generation, which the engine drops before
its next step (its slot and KV blocks free); a failed send does the same. The engine is made in
the server's event-loop thread (a Device belongs to one thread); request bodies are parsed, and prompts
tokenized, on other threads, so a large request does not stall the streams of the others."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ..errors import GrammarError, OverloadedError, RequestError
from .embeddings import embeddings_response, read_embeddings_request
from .logprobs import CompletionTokens, chat_logprobs, merge_completion_logprobs
from .metrics import EngineStats, exposition, metrics_registry
from .output import Piece, Usage, choices
from .schema import (
    CHAT,
    COMPLETIONS,
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_REQUEST_BYTES,
    ParsedRequest,
    read_request,
)
from .tokenization import detokenize, read_detokenize_request, read_tokenize_request, tokenize, tokenizer_info

_T = TypeVar("_T")


def create_app(
    make_engine: Callable[[], Any],
    model_name: str,
    *,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trusted_messages: bool = False,
    embeddings: bool = False,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
) -> Any:
    """The ASGI app; ``make_engine`` runs once at startup, in the server's thread, and returns an
    :class:`~batchgpu.llm.Engine` or anything with its ``generate`` (async iterator of pieces) and ``status`` (a dict,
    or an awaitable of one): :class:`batchgpu.llm.ray_serve.RemoteEngine` serves replicas on Ray. With
    ``embeddings``, it returns an :class:`~batchgpu.llm.embeddings.EmbeddingService` instead, and the app
    serves ``/v1/embeddings`` and ``/v1/models`` only (the other paths are 404, as for a path that does not
    exist).

    Every request is checked before it runs (:mod:`batchgpu.llm.schema`): a body over ``max_request_bytes``
    is refused with 413 as soon as its Content-Length (or what was read of it) says so, one that has not
    all come ``body_timeout`` seconds after its headers (None: no limit) with 408 (``request_timeout``,
    the connection closed: a client that trickles its body holds its request no longer), a bad field with
    400 naming it, a ``model`` other than ``model_name`` with 404 (``model_not_found``; a request without
    one gets this model); unknown paths and methods get 404 and 405; a request the engine refuses for its
    load (:class:`~batchgpu.errors.OverloadedError`: it holds ``max_batch + max_waiting`` sequences) 429
    (``rate_limit_exceeded``, as OpenAI's rate limits), streamed or not, and before its body is read where
    the engine has no room for even one sequence (an embedding service's load likewise: it holds
    ``max_batch + max_waiting`` texts). Every refusal carries OpenAI's error body.
    ``trusted_messages``: control-token text in chat messages is control (only where every client
    is trusted; by default it is plain text, :meth:`~batchgpu.llm.Engine.generate`). ``GET /metrics`` answers Prometheus
    with the engine's metrics (:mod:`batchgpu.llm.metrics`; 501 for an engine without ``stats``, such as
    :class:`~batchgpu.llm.ray_serve.RemoteEngine`).

    A generation request whose client leaves before its answer is whole (``http.disconnect``, or a send that
    fails) is aborted at once, streamed or not, running or waiting: the task iterating its ``generate`` is
    cancelled and the iterator closed (an :class:`~batchgpu.llm.Engine` frees its slot and KV blocks before its
    next step, a :class:`~batchgpu.llm.ray_serve.RemoteEngine` cancels the replica's call) and, where the engine
    counts it as aborted (``batchgpu_requests_aborted_total``, where the engine keeps ``stats``).

    The ``usage`` of an answer is the one its last piece carries (:class:`~batchgpu.llm.output.Usage`), which
    the engine's metrics count as that piece goes out; the engine counts each request's outcome, and this
    server the requests it refuses itself (400, 404, 413: ``batchgpu_requests_refused_total``) and those whose
    client left while their body was read (aborted)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    state: dict[str, Any] = {}

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

    async def metrics(request: Request) -> Response:
        """Prometheus' scrape: the engine's metrics in the text format, read at once on the event loop (a
        few dozen numbers, a registry of this app's own); 501 for an engine that keeps none here."""
        engine = state["engine"]
        if not isinstance(getattr(engine, "stats", None), EngineStats):
            message = f"this server's engine ({type(engine).__name__}) keeps no metrics here"
            return _error(501, message, kind="server_error", code="metrics_unavailable")
        if "metrics" not in state:
            try:
                state["metrics"] = metrics_registry(engine)
            except ImportError:
                message = "/metrics needs prometheus-client: pip install 'batchgpu[serve]'"
                return _error(501, message, kind="server_error", code="metrics_unavailable")
        body, content_type = exposition(state["metrics"])
        return Response(body, headers={"Content-Type": content_type})

    async def completions(request: Request) -> Response:
        return await _serve(request, COMPLETIONS)

    async def chat_completions(request: Request) -> Response:
        return await _serve(request, CHAT)

    async def _parsed(request: Request, parse: Callable[[bytes], Any]) -> Any:
        """The request ``parse`` makes of the body (off the event loop), or the Response refusing it (499: the
        client left while its body was read)."""
        try:
            body = await asyncio.wait_for(_read_body(request, max_request_bytes), body_timeout)
        except RequestError as exc:  # over the limit
            return _error(413, str(exc), code="request_too_large")
        except ClientDisconnect:
            return Response(status_code=499)  # nobody to answer
        except asyncio.TimeoutError:  # a body trickled in: the rest is not waited for, the connection closed
            message = f"the request body did not all arrive within {body_timeout:g} s"
            return _error(408, message, code="request_timeout", headers={"Connection": "close"})
        try:
            call = await asyncio.to_thread(parse, body)
        except RequestError as exc:
            return _error(400, str(exc), param=exc.param)
        if call.model is not None and call.model != model_name:
            message = f"The model `{call.model[:100]}` does not exist (this server serves `{model_name}`)"
            return _error(404, message, param="model", code="model_not_found")
        return call

    async def embed(request: Request) -> Response:
        service = state["engine"]
        full = _full(service)  # no room for even one text: refused before its body is read
        if full is not None:
            return full
        call = await _parsed(request, lambda body: read_embeddings_request(body, service.encoder))
        if isinstance(call, Response):
            return call
        try:
            vectors, tokens = await service.embed(call.inputs)  # refused for the load before it is tokenized
        except OverloadedError as exc:
            return _overloaded(exc)
        except RequestError as exc:
            return _error(400, str(exc), param=exc.param)
        return JSONResponse(await asyncio.to_thread(embeddings_response, vectors, tokens, call, model_name))

    async def _serve(request: Request, endpoint: str) -> Any:
        engine = state["engine"]
        full = _full(engine)
        if full is not None:  # no room for even one sequence: refused before its body is read
            return full
        call = await _parsed(request, lambda body: read_request(body, endpoint))
        if isinstance(call, Response):
            _count(engine, "aborted" if call.status_code == 499 else "refused")
            return call
        codec = getattr(engine, "codec", None)
        if call.echo and not isinstance(call.prompt, str) and codec is None and call.params.prompt_logprobs is None:
            _count(engine, "refused")
            message = "echo of a token-id prompt needs logprobs on this server (no tokenizer here)"
            return _error(400, message, param="echo")
        pieces = engine.generate(call.prompt, call.params, trusted=trusted_messages)
        client = _Client(request.receive)  # watched from here on
        answer: Any = None
        try:
            answer = await _answer(call, pieces, client, endpoint == CHAT, codec)
        except _ClientGone:  # nobody to answer: the generation is cancelled
            answer = Response(status_code=499)
        finally:
            if not isinstance(answer, _EventStream):  # a stream closes both once it is sent
                client.close()
                await pieces.aclose()
        return answer

    async def _answer(
        call: ParsedRequest, pieces: AsyncIterator[Piece], client: _Client, chat: bool, codec: Any
    ) -> Any:
        """The response to a generation request: its stream, its whole answer, or the error refusing it.
        Waiting for ``client``'s pieces ends at once where the client leaves (:class:`_ClientGone`)."""
        kind = "chat.completion" if chat else "text_completion"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        try:
            first = await client.run(anext(pieces))  # refusals (too long, bad ids) become HTTP errors, not streams
        except OverloadedError as exc:  # the engine is full: OpenAI's answer to too many requests
            return _overloaded(exc)
        except RequestError as exc:
            return _error(400, str(exc), param=call.request_field(exc.param))
        echo = _Echo(call, first, codec) if call.echo else None
        if call.stream:
            events = _events(
                first, pieces, chat=chat, ident=ident, created=created, model=model_name, usage=call.include_usage,
                echo=echo, held=call.params.tools is not None,
            )  # fmt: skip
            return _EventStream(events, pieces, client)
        collected = [first]
        if first.usage is None:  # more to come (the last piece carries the request's usage)
            try:
                collected += await client.run(_rest(pieces))
            except GrammarError as exc:  # its grammar could not go on (the grammar engine's limits)
                return _error(400, str(exc), param=call.request_field(exc.param))
        answers = [_choice(whole, chat, echo) for whole in choices(collected)]
        return JSONResponse(
            {
                "id": ident,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": answers,
                "usage": _usage(collected[-1]),
            }
        )

    def _vocabulary() -> Any:
        """The engine, or the 501 Response where its tokenizer is not here (replicas on Ray)."""
        engine = state["engine"]
        if getattr(engine, "codec", None) is None:
            message = f"this server's engine ({type(engine).__name__}) has no tokenizer here"
            return _error(501, message, kind="server_error", code="tokenizer_unavailable")
        return engine

    async def tokenize_prompt(request: Request) -> Response:
        engine = _vocabulary()
        if isinstance(engine, Response):
            return engine
        call = await _parsed(request, read_tokenize_request)
        if isinstance(call, Response):
            return call
        vocab, context = engine.config.vocab, engine.max_context
        try:
            answer = await asyncio.to_thread(tokenize, engine.codec, vocab, call, context, trusted=trusted_messages)
        except RequestError as exc:  # the chat template refused the messages
            chat = not isinstance(call.prompt, str) and exc.param == "prompt"
            return _error(400, str(exc), param="messages" if chat else exc.param)
        return JSONResponse(answer)

    async def detokenize_ids(request: Request) -> Response:
        engine = _vocabulary()
        if isinstance(engine, Response):
            return engine
        call = await _parsed(request, lambda body: read_detokenize_request(body, engine.config.vocab))
        if isinstance(call, Response):
            return call
        return JSONResponse(await asyncio.to_thread(detokenize, engine.codec, call))

    async def tokenizer_settings(request: Request) -> Response:
        engine = _vocabulary()
        if isinstance(engine, Response):
            return engine
        return JSONResponse(tokenizer_info(engine.codec, engine.max_context))

    async def http_error(request: Request, exc: Exception) -> Response:
        """404 (no such path) and 405 (a method the path does not take), with OpenAI's error body."""
        assert isinstance(exc, HTTPException)
        where = f"{request.method} {request.url.path[:200]}"
        message = f"Invalid URL ({where})" if exc.status_code == 404 else f"{exc.detail} ({where})"
        return _error(exc.status_code, message, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        return _error(500, "the server failed on this request", kind="server_error")

    routes = [Route("/v1/models", models, methods=["GET"])]
    if embeddings:
        routes.append(Route("/v1/embeddings", embed, methods=["POST"]))
    else:
        routes += [
            Route("/v1/engine", engine_status, methods=["GET"]),  # not OpenAI's: running/waiting requests, KV blocks
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),  # Prometheus
            Route("/tokenize", tokenize_prompt, methods=["POST"]),  # vLLM's tokenizer endpoints
            Route("/detokenize", detokenize_ids, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_settings, methods=["GET"]),
        ]
    handlers = {HTTPException: http_error, Exception: server_error}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


def _full(engine: Any) -> Any:
    """The 429 for a request that finds ``engine`` with no room for one more sequence
    (:meth:`~batchgpu.llm.Engine.check_room`; an engine without it is asked nothing here), else None."""
    check_room = getattr(engine, "check_room", None)
    try:
        if check_room is not None:
            check_room()
    except OverloadedError as exc:
        return _overloaded(exc)
    return None


def _overloaded(exc: OverloadedError) -> Any:
    """A request refused for the engine's load: 429, as OpenAI answers a rate limit."""
    return _error(429, str(exc), kind="requests", code="rate_limit_exceeded")


async def _read_body(request: Any, limit: int) -> bytes:
    """The request body, refused (RequestError) as soon as its Content-Length or the bytes read so far
    exceed ``limit``: a larger body is never held whole."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body is {int(declared)} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body is over {limit} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


class _ClientGone(Exception):
    """The client of a generation request left (it disconnected, or a send to it failed)."""


class _Client:
    """The client of a generation request, watched from when its body has been read: a task waits for its
    ``http.disconnect`` (whatever else the server does meanwhile), so that :meth:`run` cancels the request's
    work at once when it leaves (the engine counts the request aborted)."""

    def __init__(self, receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
        self.left = asyncio.ensure_future(_disconnected(receive))

    async def run(self, work: Awaitable[_T]) -> _T:
        """``work``'s result; run as a task, cancelled (and waited for: its clean-up runs) when the client
        leaves first (then :class:`_ClientGone`) or this call is."""
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, self.left), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled: so is the work
            await _cancel(task)
            raise
        if not task.done():  # the client left first
            await _cancel(task)
            raise _ClientGone
        try:
            return task.result()
        finally:  # an error raised here keeps this frame: without the task, which keeps the error (no cycle)
            del task

    def close(self) -> None:
        """Stop watching: the request is answered or over."""
        self.left.cancel()


async def _disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
    """Return once ``receive`` (an ASGI request's, its body read) says the client disconnected, or fails."""
    with contextlib.suppress(Exception):  # a receive that fails has no client behind it either
        while (await receive())["type"] != "http.disconnect":
            pass


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has ended (its ``finally`` blocks run); its error is dropped."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved: an error it ended with meanwhile is not logged as unretrieved


async def _rest(pieces: AsyncIterator[Piece]) -> list[Piece]:
    """The pieces left of a generation."""
    return [piece async for piece in pieces]


def _count(engine: Any, outcome: str) -> None:
    """One more request that ended so before it reached the engine (``refused``: a body this server would not
    take; ``aborted``: a client that left while its body was read), counted where ``engine`` keeps
    :class:`EngineStats` (a :class:`~batchgpu.llm.ray_serve.RemoteEngine` keeps none here)."""
    stats = getattr(engine, "stats", None)
    if isinstance(stats, EngineStats):
        stats.end(outcome)


class _EventStream:
    """The ASGI response of a streamed generation: ``events`` (server-sent events of ``pieces``) sent while
    ``client`` is watched; a client that leaves (a disconnect, or a send that fails) aborts the generation at
    once. ``events`` and ``pieces`` are closed at the end, whether or not the stream began."""

    def __init__(self, events: AsyncGenerator[str, None], pieces: AsyncGenerator[Piece, None], client: _Client) -> None:
        self.events, self.pieces, self.client = events, pieces, client

    async def __call__(self, scope: Any, receive: Any, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        try:
            await self.client.run(self._send_events(send))
            with contextlib.suppress(OSError):  # the client left after the whole answer: nothing to abort
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except _ClientGone:
            pass  # the generation is cancelled as it closes: the engine counts it aborted
        finally:
            self.client.close()
            await self.events.aclose()
            await self.pieces.aclose()

    async def _send_events(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await _sent(send, {"type": "http.response.start", "status": 200, "headers": headers})
        async for event in self.events:
            await _sent(send, {"type": "http.response.body", "body": event.encode(), "more_body": True})


async def _sent(send: Callable[[dict[str, Any]], Awaitable[None]], message: dict[str, Any]) -> None:
    """``send(message)``; a send that fails (OSError: ASGI 2.4's word for a client gone) is :class:`_ClientGone`."""
    try:
        await send(message)
    except OSError as exc:
        raise _ClientGone from exc


class _Echo:
    """A completions request with ``echo``: the prompt's text (as given, or its ids decoded) and logprobs go
    before the output (with ``max_tokens`` 0, the whole answer: the engine's one piece has no token)."""

    def __init__(self, call: ParsedRequest, first: Piece, codec: Any) -> None:
        given = call.prompt if isinstance(call.prompt, str) else None
        self.logprobs = None
        if first.prompt_logprobs is not None:
            tokens = CompletionTokens(given=given)
            self.logprobs = tokens.logprobs(first.prompt_logprobs, first.token_texts or {}, end=True)
        if given is not None:
            self.text = given
        elif codec is not None:
            self.text = codec.decode(call.prompt)
        else:
            self.text = "".join(self.logprobs["tokens"]) if self.logprobs is not None else ""


def _choice(whole: Piece, chat: bool, echo: _Echo | None) -> dict[str, Any]:
    """The choice of one whole sample in a response that is not streamed."""
    choice: dict[str, Any] = {"index": whole.index, "finish_reason": whole.finish_reason}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": whole.text}
        if whole.tool_calls:  # the calls, and the text before them where there is any
            message.update(content=whole.text or None, tool_calls=[call.openai() for call in whole.tool_calls])
        choice["message"] = message
        choice["logprobs"] = chat_logprobs(whole.logprobs) if whole.logprobs else None
    else:
        choice.update(_completion_choice(whole, echo, _output_tokens(echo)))
    return choice


def _output_tokens(echo: _Echo | None) -> CompletionTokens:
    """The completions tokens of a choice's output, which starts after the echoed prompt where there is one."""
    return CompletionTokens(len(echo.text) if echo is not None else 0)


def _completion_choice(
    piece: Piece, echo: _Echo | None, tokens: CompletionTokens, *, first: bool = True
) -> dict[str, Any]:
    """A completions choice's ``text`` and ``logprobs`` for ``piece`` (with the echoed prompt before it on
    the ``first`` piece); ``tokens``: the choice's output tokens so far."""
    prefix = echo.text if echo is not None and first else ""
    logprobs = None
    if piece.logprobs is not None:
        logprobs = tokens.logprobs(piece.logprobs, piece.token_texts or {}, end=piece.finish_reason is not None)
    if echo is not None and first and echo.logprobs is not None:
        logprobs = merge_completion_logprobs(echo.logprobs, logprobs) if logprobs is not None else echo.logprobs
    return {"text": prefix + piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}


async def _events(
    first: Piece,
    pieces: AsyncIterator[Piece],
    *,
    chat: bool,
    ident: str,
    created: int,
    model: str,
    usage: bool,
    echo: _Echo | None = None,
    held: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events of a streamed generation; closing it (a client gone) cancels the request. ``held``:
    a tool request, whose text comes whole on its last piece (:class:`~batchgpu.llm.output.Piece`): the pieces
    before it make no chunk (but for their logprobs), and the last one's delta has the content only where
    there is some or no call (as the answer not streamed), then each call once, as OpenAI streams one."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choice: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
        data = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice], **(extra or {})}
        return f"data: {json.dumps(data)}\n\n"

    outputs: dict[int, CompletionTokens] = {}  # each sample's output tokens so far (completions)

    def chunk(piece: Piece) -> str:
        role = piece.index not in outputs
        tokens = outputs.setdefault(piece.index, _output_tokens(echo))
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if piece.text or not (role or held) or (held and piece.finish_reason and not piece.tool_calls):
                delta["content"] = piece.text
            if piece.tool_calls:  # the calls come whole, with the last piece
                delta["tool_calls"] = [{"index": i, **call.openai()} for i, call in enumerate(piece.tool_calls)]
            logprobs = chat_logprobs(piece.logprobs) if piece.logprobs else None
            if not (delta or logprobs or piece.finish_reason):  # a tool request's text, held: no event
                return ""
            choice = {"index": piece.index, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish_reason}
            return event(choice)
        return event({"index": piece.index, **_completion_choice(piece, echo, tokens, first=role)})

    try:
        last = first  # the request's last piece carries its usage
        yield chunk(first)
        try:
            async for piece in pieces:
                last = piece
                if data := chunk(piece):
                    yield data
        except RequestError as exc:  # failed mid-stream (a replica lost): an error event, then the end
            yield f"data: {json.dumps(_error_body(str(exc), type(exc).__name__))}\n\n"
            return
        if usage:
            summary = {"id": ident, "object": kind, "created": created, "model": model, "choices": []}
            yield f"data: {json.dumps({**summary, 'usage': _usage(last)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await pieces.aclose()


def _usage(last: Piece) -> dict[str, int]:
    """The usage of a request: the one its last piece carries (the engine counted it in its metrics)."""
    usage = last.usage if last.usage is not None else Usage(last.prompt_tokens, last.completion_tokens)
    return usage.openai()


def _error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """A refusal: OpenAI's error body (``\\u`` escapes for what is not ASCII, so that text from the request
    is always encodable) with ``status``."""
    from starlette.responses import Response

    body = json.dumps(_error_body(message, kind, param=param, code=code)).encode("ascii")
    return Response(body, status, headers=headers, media_type="application/json")


def _error_body(message: str, kind: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: the body of a refusal, and the last event of a stream that failed."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def serve(
    make_engine: Callable[[], Any],
    *,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    trusted_messages: bool = False,
    embeddings: bool = False,
    max_connections: int | None = None,
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT,
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT,
) -> None:
    """Run the server until interrupted (uvicorn, one worker: one engine owns the device); see
    :func:`create_app` for ``max_request_bytes``, ``trusted_messages``, ``embeddings`` and ``body_timeout``.
    ``max_connections``: uvicorn's ``limit_concurrency`` (None: no limit); with that many connections (or
    requests) open, uvicorn answers 503 at once, so bodies being read hold at most ``max_connections *
    max_request_bytes``. ``header_timeout``: seconds a request's line and headers may take to arrive
    (:func:`timed_protocol`; None: no limit, as uvicorn's own). The engine is made first, before the port is
    bound, in this thread (where uvicorn then runs its event loop): an engine that cannot be made raises
    here, and nothing ever listened. What exists then is frozen out of the garbage collector's scans
    (``gc.freeze``): the collections a serving loop's many small objects set off then skip it."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    engine = make_engine()
    gc.collect()
    gc.freeze()  # the model's and engine's long-lived objects out of the collector's later scans (vLLM does so)
    app = create_app(
        lambda: engine,
        model_name,
        max_request_bytes=max_request_bytes,
        trusted_messages=trusted_messages,
        embeddings=embeddings,
        body_timeout=body_timeout,
    )
    http = AutoHTTPProtocol if header_timeout is None else timed_protocol(AutoHTTPProtocol, header_timeout)
    uvicorn.run(app, host=host, port=port, log_level="info", limit_concurrency=max_connections, http=http)


def timed_protocol(base: type[asyncio.Protocol], seconds: float) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's HTTP/1.1 protocol: httptools' or h11's) with a deadline on each request's head:
    a connection whose request line and headers have not all come ``seconds`` after it opened, or after
    the first byte of its next request, is answered 408 (OpenAI's error body, ``request_timeout``) and
    closed. uvicorn itself waits for a head forever (its keep-alive timeout ends only idle connections,
    and each byte restarts it), so a client that trickles its headers a byte at a time (slow loris) would
    hold its connection, and many such clients the server's connections, for as long as they like. (The
    start of a next head sent with the request before it, then nothing, is left to the keep-alive timeout,
    which no byte restarts then.) The body has its own limit, in the app (:func:`create_app`'s
    ``body_timeout``)."""

    class TimedProtocol(base):  # type: ignore[valid-type, misc]
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.start_head()

        def data_received(self, data: bytes) -> None:
            if self.head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self.start_head()  # the first bytes of the connection's next request
            current = self.cycle
            super().data_received(data)
            if self.cycle is not current:  # its head is whole: the request is the app's now
                self.stop_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_head()
            super().connection_lost(exc)

        def start_head(self) -> None:
            self.head_timer = self.loop.call_later(seconds, self.head_late)

        def stop_head(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_late(self) -> None:
            self.head_timer = None
            if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
                return
            message = f"the request line and headers did not all arrive within {seconds:g} s"
            self.transport.write(_raw_error(408, "Request Timeout", message, "request_timeout"))
            self.transport.close()

    TimedProtocol.__name__ = TimedProtocol.__qualname__ = f"Timed{base.__name__}"
    return TimedProtocol


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response carrying OpenAI's error body, for a connection then closed (no app ran)."""
    body = json.dumps(_error_body(message, "invalid_request_error", code=code)).encode("ascii")
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode("ascii") + b"connection: close\r\n\r\n" + body
