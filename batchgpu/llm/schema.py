"""The OpenAI request bodies the server takes, checked before anything runs: the JSON text (nesting depth,
no NaN, Infinity or number out of range, no lone surrogate in any string) and then every field against one
table, :data:`FIELDS` (its JSON type, the endpoints that have it, and the values served where the server
has only some of OpenAI's), and every object nested in a field against its own table of keys and their
JSON types (:data:`MESSAGE_FIELDS`, :data:`TOOL_FIELDS`, ...). A refusal is a RequestError naming the
field (OpenAI's error ``param``). The ranges of the sampling fields are :class:`SamplingParams`' own
checks; fields outside the tables are refused, as OpenAI refuses them."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RequestError
from .params import MAX_LOGPROBS, SamplingParams, brief
from .structured import StructuredOutput
from .tools import Function, ToolCalling

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""The largest request body the server reads by default (``serve --max-request-bytes``): 4 MiB, hundreds
of times the text of a long context's prompt; a larger body is refused (413) before it is read."""

DEFAULT_HEADER_TIMEOUT = 10.0
"""Seconds a request's line and headers may take to arrive by default (``serve --header-timeout``); later,
the server answers 408 and closes the connection (a client trickling its headers holds nothing for long)."""

DEFAULT_BODY_TIMEOUT = 30.0
"""Seconds a request's body may take to arrive after its headers by default (``serve --body-timeout``: 4 MiB
at 140 kB/s); later, the server answers 408 and closes the connection."""

MAX_DEPTH = 32
"""JSON nesting a body may have (a chat request with content parts needs 5); deeper is refused before it
is parsed."""

MAX_STOP_STRINGS = 16
"""Stop strings one request may have (each one is searched for in every new piece of text)."""

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles of OpenAI's chat API (the model's chat template decides what it makes of them)."""

JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}

CHAT, COMPLETIONS, EMBEDDINGS = "chat", "completions", "embeddings"
TOKENIZE, DETOKENIZE = "tokenize", "detokenize"  # vLLM's tokenizer endpoints (batchgpu.llm.tokenization)
BOTH = (CHAT, COMPLETIONS)
EVERY = (CHAT, COMPLETIONS, EMBEDDINGS, TOKENIZE, DETOKENIZE)


@dataclass(frozen=True)
class Field:
    """One request field: its JSON ``types``, the ``endpoints`` that have it, where it goes (``sampling``:
    the :class:`SamplingParams` field it sets) and, for OpenAI fields served at some values only, ``only``
    (the values accepted; null is always accepted, as the field left out)."""

    types: tuple[str, ...]
    endpoints: tuple[str, ...] = BOTH
    sampling: str | None = None
    only: tuple[Any, ...] | None = None


FIELDS: dict[str, Field] = {
    "model": Field(("string",), EVERY),
    "prompt": Field(("string", "array"), (COMPLETIONS, TOKENIZE)),  # tokenize: a string (batchgpu.llm.tokenization)
    "messages": Field(("array",), (CHAT, TOKENIZE)),
    "stream": Field(("boolean",)),
    "stream_options": Field(("object",)),
    "max_tokens": Field(("integer",), sampling="max_tokens"),
    "max_completion_tokens": Field(("integer",), (CHAT,), sampling="max_tokens"),
    "temperature": Field(("number",), sampling="temperature"),
    "top_p": Field(("number",), sampling="top_p"),
    "top_k": Field(("integer",), sampling="top_k"),  # vLLM's
    "min_p": Field(("number",), sampling="min_p"),  # vLLM's
    "repetition_penalty": Field(("number",), sampling="repetition_penalty"),  # vLLM's
    "presence_penalty": Field(("number",), sampling="presence_penalty"),
    "frequency_penalty": Field(("number",), sampling="frequency_penalty"),
    "seed": Field(("integer",), sampling="seed"),
    "stop": Field(("string", "array"), sampling="stop"),
    "stop_token_ids": Field(("array",), sampling="stop_token_ids"),  # vLLM's
    "ignore_eos": Field(("boolean",), sampling="ignore_eos"),  # vLLM's
    "user": Field(("string",), EVERY),  # an end-user id: accepted, not used
    "n": Field(("integer",), sampling="n"),  # 1 to MAX_SAMPLES; not with echo (:func:`_check_samples`)
    "best_of": Field(("integer",), (COMPLETIONS,), sampling="best_of"),  # n to MAX_SAMPLES; not streamed above n
    "echo": Field(("boolean",), (COMPLETIONS,)),  # with logprobs: the prompt's too (:func:`_logprobs`)
    "suffix": Field(("string",), (COMPLETIONS,), only=()),
    "logprobs": Field(("integer", "boolean")),  # completions: an integer; chat: a boolean (:func:`_logprobs`)
    "top_logprobs": Field(("integer",), (CHAT,)),
    "logit_bias": Field(("object",), only=({},)),
    "response_format": Field(("object",)),  # text, json_object, json_schema (:func:`_response_format`)
    "tools": Field(("array",), (CHAT,)),  # functions (:func:`_tools`)
    "tool_choice": Field(("string", "object"), (CHAT,)),  # none, auto, required, a function
    "parallel_tool_calls": Field(("boolean",), (CHAT,)),  # false: at most one call
    "input": Field(("string", "array"), (EMBEDDINGS,)),  # checked by batchgpu.llm.embeddings
    "encoding_format": Field(("string",), (EMBEDDINGS,), only=("float", "base64")),
    "dimensions": Field(("integer",), (EMBEDDINGS,)),  # only the model's own (batchgpu.llm.embeddings)
    "add_special_tokens": Field(("boolean",), (TOKENIZE,)),  # vLLM's: BOS etc. around a text prompt
    "add_generation_prompt": Field(("boolean",), (TOKENIZE,), only=(True,)),  # the assistant's turn opened
    "return_token_strs": Field(("boolean",), (TOKENIZE,)),  # vLLM's: each token's text too
    "tokens": Field(("array",), (DETOKENIZE,)),
}
"""The request fields of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/tokenize`` and
``/detokenize``."""

# The objects nested in the fields: each one's keys and their JSON types ("a or b": either; null is the key
# left out); other keys are refused (:func:`_check_keys`).
STREAM_OPTIONS = {"include_usage": "boolean"}
MESSAGE_FIELDS = {
    "role": "string", "content": "string or array", "name": "string", "tool_calls": "array", "tool_call_id": "string",
}  # fmt: skip
TEXT_PART_FIELDS = {"type": "string", "text": "string"}  # a message's content part
CALL_FIELDS = {"id": "string", "type": "string", "function": "object"}  # an assistant message's tool call
CALLED_FIELDS = {"name": "string", "arguments": "string"}  # its function
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name": "string", "description": "string", "schema": "object", "strict": "boolean"}
TOOL_FIELDS = {"type": "string", "function": "object"}
FUNCTION_FIELDS = {"name": "string", "description": "string", "parameters": "object", "strict": "boolean"}
TOOL_CHOICE_FIELDS = {"type": "string", "function": "object"}
CHOSEN_FIELDS = {"name": "string"}  # tool_choice's function


@dataclass
class ParsedRequest:
    """What a valid request asks for: the model name (None: not given), the prompt (text, token ids or
    chat messages), the sampling parameters, and how to answer (streamed; with a usage event; the prompt
    echoed before the output, or alone with ``max_tokens`` 0)."""

    model: str | None
    prompt: str | list[int] | list[dict[str, Any]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    names: dict[str, str] = field(default_factory=dict)  # the request's name of an engine refusal's param

    def request_field(self, param: str | None) -> str | None:
        """The request field an engine's refusal naming ``param`` is about (chat: ``prompt`` is
        ``messages``; ``max_tokens`` is ``max_completion_tokens`` where the request gave that)."""
        return self.names.get(param, param) if param is not None else None


def read_request(body: bytes, endpoint: str) -> ParsedRequest:
    """The request that the JSON ``body`` makes to ``endpoint``: :func:`parse_json`, then
    :func:`parse_request` (both proportional to the body's size: run them off the event loop)."""
    return parse_request(parse_json(body), endpoint)


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object: UTF-8, at most :data:`MAX_DEPTH` levels deep (measured before
    parsing, so no depth reaches the parser's recursion), without NaN, Infinity or a number past float's
    range, and without a lone surrogate in any string or key (:func:`check_unicode`)."""
    depth = json_depth(body)
    if depth > MAX_DEPTH:
        raise RequestError(f"the request body is JSON nested {depth} levels deep; the limit is {MAX_DEPTH}")
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:  # not UTF-8, not JSON, an integer too long to convert, a number out of range
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(value)}")
    if SURROGATE_ESCAPE.search(body):  # only JSON's \u escapes make one (UTF-8 cannot)
        check_unicode(value)
    return value


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (half of a pair, or a lone one)."""


def check_unicode(body: dict[str, Any]) -> None:
    """RequestError naming the field where a string or key holds a lone surrogate (JSON's ``\\ud800`` escape
    without its pair): it is no text (no tokenizer, template, grammar or response encodes it), so it is
    refused wherever it is, as in the prompt."""
    for name, value in body.items():
        for text, where in _texts(value, _shown(name), name):
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    found = f"a lone surrogate {text[exc.start]!r} at character {exc.start}"
                    raise RequestError(f"{where} is not valid Unicode: {found}", _shown(name)) from None


def _texts(value: Any, where: str, key: str | None = None) -> Iterator[tuple[str, str]]:
    """Every string in ``value`` (at ``where`` in the request; ``key``: its own key) and every key in it,
    with where each is."""
    if key is not None:
        yield key, f"the name of {where}"
    if isinstance(value, str):
        yield value, where
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _texts(item, f"{where}.{_shown(name)}", name)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _texts(item, f"{where}[{index}]")


def _shown(key: str) -> str:
    """A key as a message names it: a lone surrogate escaped (a response cannot encode it)."""
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_json_text(text: str, where: str, param: str) -> Any:
    """The value of ``text``, JSON inside a string field (a tool call's ``arguments``), checked as a body
    is (RequestError naming ``param``): at most :data:`MAX_DEPTH` deep, no NaN or number out of range."""
    depth = json_depth(text.encode("utf-8", "surrogatepass"))
    if depth > MAX_DEPTH:
        raise RequestError(f"{where} is JSON nested {depth} levels deep; the limit is {MAX_DEPTH}", param)
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as exc:
        raise RequestError(f"{where} must be JSON text: {exc}", param) from None


JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: no alternation per character
NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
BRACKET_STEPS = np.zeros(256, np.int8)
BRACKET_STEPS[[ord("["), ord("{")]], BRACKET_STEPS[[ord("]"), ord("}")]] = 1, -1


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``body`` (exact for valid JSON): its
    strings taken out, then the running count of opening less closing brackets, vectorized."""
    brackets = np.frombuffer(JSON_STRING.sub(b"", body).translate(None, NOT_BRACKETS), np.uint8)
    return int(np.cumsum(BRACKET_STEPS[brackets], dtype=np.int64).max(initial=0))


def parse_request(body: dict[str, Any], endpoint: str) -> ParsedRequest:
    """Check every field of ``body`` (a request to ``endpoint``: :data:`CHAT` or :data:`COMPLETIONS`)
    against :data:`FIELDS` and make the request of it."""
    values = check_fields(body, endpoint)
    stream = values.get("stream", False)
    options = values.get("stream_options", {})
    if "stream_options" in values and not stream:
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    _check_keys(options, STREAM_OPTIONS, "stream_options")
    prompt = chat_messages(values.get("messages")) if endpoint == CHAT else _prompt(values.get("prompt"))
    echo = values.get("echo", False)
    if values.get("max_tokens") == 0 and not echo:
        raise RequestError(
            "max_tokens=0 is only served with echo (the prompt scored); otherwise at least 1", "max_tokens"
        )
    if values.get("max_completion_tokens") == 0:  # chat: no echo, so at least one token
        raise RequestError(f"max_completion_tokens must be an int >= 1, got {brief(0)}", "max_completion_tokens")
    constraints = {"structured": _response_format(values.get("response_format")), "tools": _tools(values)}
    params = _sampling(values, {**_logprobs(values, endpoint), **constraints})
    _check_samples(params, stream, echo)
    names = {"prompt": "messages"} if endpoint == CHAT else {}
    if "max_completion_tokens" in values:
        names["max_tokens"] = "max_completion_tokens"
    return ParsedRequest(
        model=values.get("model"),
        prompt=prompt,
        params=params,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        echo=echo,
        names=names,
    )


def check_fields(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The fields of ``body`` that are not null, each checked against :data:`FIELDS` for ``endpoint`` (one
    of :data:`EVERY`): known there, of its JSON type, and of its served values."""
    values = {name: value for name, value in body.items() if value is not None}
    for name, value in values.items():
        field = FIELDS.get(name)
        if field is None or endpoint not in field.endpoints:
            raise RequestError(f"unrecognized request argument supplied: {name}", name)
        if not any(JSON_TYPES[kind](value) for kind in field.types):
            expected = " or ".join(field.types)
            raise RequestError(f"{name} must be {_article(expected)}, got {_json_type(value)}", name)
        if field.only is not None and not any(_same(value, served) for served in field.only):
            served = " or ".join(json.dumps(v) for v in field.only) or "null"
            raise RequestError(f"{name}={json.dumps(value)[:80]} is not supported (only {served})", name)
    return values


def _logprobs(values: dict[str, Any], endpoint: str) -> dict[str, int]:
    """The logprob settings of a request: completions' ``logprobs`` (an integer, top ids per token; with
    ``echo``, the prompt's tokens too), chat's ``logprobs`` (a boolean) with ``top_logprobs`` (an integer,
    only with ``logprobs``), each top count in [0, MAX_LOGPROBS]."""
    logprobs = values.get("logprobs")
    if endpoint == COMPLETIONS:
        if logprobs is None:
            return {}
        _top_count("logprobs", logprobs)
        return {"logprobs": logprobs, **({"prompt_logprobs": logprobs} if values.get("echo") else {})}
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError(f"logprobs must be a boolean, got {_json_type(logprobs)}", "logprobs")
    top = values.get("top_logprobs")
    if top is not None:
        if not logprobs:
            raise RequestError("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        _top_count("top_logprobs", top)
    return {"logprobs": top or 0} if logprobs else {}


def _check_samples(params: SamplingParams, stream: bool, echo: bool) -> None:
    """Several samples are served but not streamed when ``best_of`` > ``n`` (the best are known at the
    end; OpenAI refuses it too), and not with ``echo``."""
    if stream and params.best_of is not None and params.best_of > params.n:
        message = f"best_of ({params.best_of}) > n ({params.n}) cannot be streamed: the best are known at the end"
        raise RequestError(message, "best_of")
    if echo and params.samples > 1:
        raise RequestError(f"echo is served with one sample only, got n={params.n}, best_of={params.best_of}", "echo")


def _top_count(name: str, value: Any) -> None:
    if not JSON_TYPES["integer"](value) or not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {_json_type(value)}", name)


def _response_format(value: Any) -> StructuredOutput | None:
    """``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name", "schema"[, "description", "strict"]}}``."""
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise RequestError(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {brief(kind)}", "response_format"
        )
    _check_keys(
        value, {"type": "string", **({"json_schema": "object"} if kind == "json_schema" else {})}, "response_format"
    )
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    spec = value.get("json_schema")
    if spec is None or not isinstance(spec.get("schema"), dict):
        raise RequestError("response_format.json_schema.schema must be an object (the JSON schema)", "response_format")
    _check_keys(spec, JSON_SCHEMA_FIELDS, "response_format.json_schema", param="response_format")
    return StructuredOutput(json_schema=spec["schema"])


def _tools(values: dict[str, Any]) -> ToolCalling | None:
    """``tools`` (OpenAI's function objects), ``tool_choice`` and ``parallel_tool_calls``; None without tools
    or with ``tool_choice`` "none" (the tools are then left out of the prompt)."""
    tools, choice = values.get("tools"), values.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = _named_choice(choice)
    elif choice not in ("none", "auto", "required"):
        raise RequestError(
            f"tool_choice must be none, auto, required or a function, got {brief(choice)}", "tool_choice"
        )
    if not tools:
        if "tool_choice" in values and choice != "none":
            raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))  # checked, used or not
    calling = ToolCalling(functions, "auto" if choice == "none" else choice, values.get("parallel_tool_calls", True))
    return None if choice == "none" else calling


def _named_choice(choice: dict[str, Any]) -> str:
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    _check_keys(choice, TOOL_CHOICE_FIELDS, "tool_choice")
    _check_keys(function, CHOSEN_FIELDS, "tool_choice.function", param="tool_choice")
    return function["name"]


def _function(tool: Any, where: str) -> Function:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    _check_keys(tool, TOOL_FIELDS, where, param="tools")
    function = tool["function"]
    _check_keys(function, FUNCTION_FIELDS, f"{where}.function", param="tools")
    parameters = function.get("parameters") or {"type": "object"}
    return Function(function.get("name"), function.get("description"), parameters)


def _sampling(values: dict[str, Any], settings: dict[str, Any]) -> SamplingParams:
    settings = {**{FIELDS[name].sampling: value for name, value in values.items() if FIELDS[name].sampling}, **settings}
    if "max_completion_tokens" in values:  # chat: OpenAI's newer name wins
        settings["max_tokens"] = values["max_completion_tokens"]
    stop = settings.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    try:
        return SamplingParams(**settings)
    except RequestError as exc:
        if exc.param == "max_tokens" and "max_completion_tokens" in values:
            exc.param = "max_completion_tokens"
        raise


def _prompt(prompt: Any) -> str | list[int]:
    """A string or token ids, alone or as a batch of one (OpenAI's ``["text"]``, ``[[1, 2]]``)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(JSON_TYPES["integer"](t) for t in prompt)):
        return prompt
    got = "nothing" if prompt is None else _json_type(prompt)
    raise RequestError(f"prompt must be a string or a list of token ids (one prompt per request), got {got}", "prompt")


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The chat messages, each ``{"role", "content"[, "name"]}`` with text content (content parts: their
    texts joined); an assistant's ``tool_calls`` (its content may then be null) with their arguments
    parsed (chat templates read them as objects, as vLLM gives them) and a tool message's
    ``tool_call_id``; other message fields only as null."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty array of messages", "messages")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object, got {_json_type(message)}", "messages")
    _check_keys(message, MESSAGE_FIELDS, where, param="messages")
    fields = {key: value for key, value in message.items() if value is not None}
    role, content = fields.get("role"), fields.get("content")
    if role not in ROLES:
        raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}, got {brief(role)}", "messages")
    if "tool_calls" in fields:
        if role != "assistant":
            raise RequestError(f"{where}.tool_calls is only allowed in an assistant message", "messages")
        fields["tool_calls"] = [_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(fields["tool_calls"])]
        content = "" if content is None else content
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
    if not isinstance(content, str):
        got = "nothing" if content is None else _json_type(content)
        raise RequestError(f"{where}.content must be a string or an array of text parts, got {got}", "messages")
    return {**fields, "role": role, "content": content}


def _call(call: Any, where: str) -> dict[str, Any]:
    """An earlier tool call in a message: ``{"id", "type": "function", "function": {"name", "arguments"}}``,
    its arguments (JSON text) parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(
            f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', "messages"
        )
    _check_keys(call, CALL_FIELDS, where, param="messages")
    _check_keys(function, CALLED_FIELDS, f"{where}.function", param="messages")
    arguments = parse_json_text(function.get("arguments") or "{}", f"{where}.function.arguments", "messages")
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _text_part(part: Any, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = brief(part.get("type")) if isinstance(part, dict) else _json_type(part)
        raise RequestError(f"{where} must be a text part ({{'type': 'text', 'text': ...}}), got {kind}", "messages")
    _check_keys(part, TEXT_PART_FIELDS, where, param="messages")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string, got {_json_type(part.get('text'))}", "messages")
    return part["text"]


def _check_keys(value: dict[str, Any], types: dict[str, str], where: str, param: str | None = None) -> None:
    """The keys of the object ``value`` are among ``types`` and their values of those JSON types ("a or b":
    either) or null."""
    for key, item in value.items():
        if key not in types:
            raise RequestError(f"{where}.{key} is not supported", param or where)
        if item is not None and not any(JSON_TYPES[kind](item) for kind in types[key].split(" or ")):
            raise RequestError(f"{where}.{key} must be {_article(types[key])}, got {_json_type(item)}", param or where)


def _same(value: Any, served: Any) -> bool:
    """``value`` is ``served`` as JSON sees it (``0`` is not ``false``)."""
    return type(value) is type(served) and value == served


def _json_type(value: Any) -> str:
    """The JSON type of a parsed value, and a scalar's value."""
    if value is None:
        return "null"
    kind = next((name for name, check in JSON_TYPES.items() if check(value)), type(value).__name__)
    return _article(kind) if kind in ("array", "object") else f"{_article(kind)} ({brief(value)})"


def _article(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    """A JSON number with a fraction or exponent, as a float within float's range."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value
