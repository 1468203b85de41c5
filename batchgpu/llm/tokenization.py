"""vLLM's tokenizer endpoints over the served model's own vocabulary: ``POST /tokenize`` (a text prompt, or
chat messages through the model's chat template, into the ids a completion of it would run),
``POST /detokenize`` (ids into text) and ``GET /tokenizer_info`` (the special tokens and the chat template).
Clients that count or split tokens as the server does call them: lm-evaluation-harness's
``local-completions`` model uses them as its tokenizer (``tokenizer_backend`` auto or remote), so it scores
loglikelihoods without a tokenizer of its own. Bodies are checked like the OpenAI ones
(:func:`~batchgpu.llm.schema.check_fields`): unknown fields, wrong types and ids outside the vocabulary are
RequestErrors naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from .prompt import Prompt, prompt_ids
from .schema import DETOKENIZE, JSON_TYPES, TOKENIZE, chat_messages, check_fields, parse_json
from .text import TextCodec

MAX_DETOKENIZE_IDS = 1 << 20
"""Token ids one ``/detokenize`` request may hold (the body limit allows about as many)."""


@dataclass(frozen=True)
class TokenizeRequest:
    """A ``/tokenize`` request: a text ``prompt`` (``special``: with the tokens the tokenizer adds around a
    text, vLLM's ``add_special_tokens``) or chat messages, and whether each token's text is wanted."""

    model: str | None
    prompt: Prompt
    special: bool
    token_strs: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    """A ``/detokenize`` request: the ids to turn into text."""

    model: str | None
    tokens: list[int]


def read_tokenize_request(body: bytes) -> TokenizeRequest:
    """The ``/tokenize`` request of the JSON ``body``: ``prompt`` (a string) or ``messages``, not both."""
    values = check_fields(parse_json(body), TOKENIZE)
    if ("prompt" in values) == ("messages" in values):
        raise RequestError("give either prompt (a string) or messages (chat messages)", "prompt")
    prompt = values.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise RequestError("prompt must be a string here (token ids are already tokens)", "prompt")
    chat = prompt is None
    if chat and values.get("add_special_tokens"):
        message = "add_special_tokens applies to a text prompt; messages get the chat template's tokens"
        raise RequestError(message, "add_special_tokens")
    return TokenizeRequest(
        model=values.get("model"),
        prompt=chat_messages(values["messages"]) if chat else prompt,
        special=values.get("add_special_tokens", True),
        token_strs=values.get("return_token_strs", False),
    )


def read_detokenize_request(body: bytes, vocab: int) -> DetokenizeRequest:
    """The ``/detokenize`` request of the JSON ``body``: ``tokens``, ids in ``[0, vocab)``."""
    values = check_fields(parse_json(body), DETOKENIZE)
    tokens = values.get("tokens")
    if tokens is None:
        raise RequestError("tokens is missing: the token ids to detokenize", "tokens")
    if len(tokens) > MAX_DETOKENIZE_IDS:
        raise RequestError(f"tokens has {len(tokens)} ids; at most {MAX_DETOKENIZE_IDS} per request", "tokens")
    bad = [t for t in tokens if not (JSON_TYPES["integer"](t) and 0 <= t < vocab)]
    if bad:
        raise RequestError(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", "tokens")
    return DetokenizeRequest(values.get("model"), tokens)


def tokenize(
    codec: TextCodec, vocab: int, request: TokenizeRequest, max_context: int, *, trusted: bool = False
) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer: ``tokens`` (the ids a completion of this prompt runs: a text prompt as
    :func:`~batchgpu.llm.prompt.prompt_ids` encodes it, chat messages through the template, their text
    never control tokens unless ``trusted``), ``count`` and ``max_model_len`` (the server's context), and
    with ``return_token_strs`` each token's text. Safe to call from another thread."""
    if isinstance(request.prompt, str):
        ids = codec.encode(request.prompt, special=request.special)
    else:
        ids = prompt_ids(codec, vocab, request.prompt, trusted)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": max_context, "tokens": ids, "token_strs": None}
    if request.token_strs:
        answer["token_strs"] = [codec.tokenizer.id_to_token(i) for i in ids]
    return answer


def detokenize(codec: TextCodec, request: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's ``/detokenize`` answer: ``prompt``, the text of the ids, control tokens included (as a
    tokenizer decodes them; a chat reply leaves them out)."""
    return {"prompt": codec.tokenizer.decode(request.tokens, skip_special_tokens=False)}


def tokenizer_info(codec: TextCodec, max_context: int) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the special tokens' text, the chat template and the context length."""
    return {
        "tokenizer_class": "TextCodec",
        "bos_token": codec.bos_token,
        "eos_token": codec.eos_token,
        "pad_token": None,
        "chat_template": codec.chat_template,
        "model_max_length": max_context,
    }
