"""A model's text codec: its tokenizer, end tokens and chat template, from the model's own files (GGUF
metadata or a Hugging Face directory); chat prompts encoded with control tokens from the template alone
(:mod:`batchgpu.models.control`)."""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..arguments import brief
from ..errors import BatchError, ModelFileError, RequestError
from .control import ControlTokens
from .fields import Fields
from .files import optional_file, read_json, read_text
from .gguf_tokenizer import gguf_tokenizer, token_id
from .token_bytes import TokenBytes

if TYPE_CHECKING:
    from .gguf_reader import GGUFFile

LARGE_TEXT = 1 << 20
"""Characters of text after whose encoding the freed heap goes back to the operating system (the
tokenizer's working memory is about 150 bytes per character)."""


class TextCodec:
    """A model's tokenizer (a ``tokenizers`` Tokenizer: control tokens kept whole and left out of decoded
    text), its end-of-sequence tokens and its chat template (jinja2, as ``transformers`` renders it), from
    a GGUF file (:meth:`from_gguf`) or a Hugging Face directory (:meth:`from_hf`)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: Sequence[int] = (),
        bos_token: str = "",
        eos_token: str = "",
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template

    @classmethod
    def from_gguf(cls, file: GGUFFile) -> TextCodec:
        """The codec of a GGUF file's ``tokenizer.*`` metadata."""
        fields = file.fields()
        vocabulary = fields.under("tokenizer.ggml.")
        tokenizer = gguf_tokenizer(vocabulary)
        tokens = vocabulary.texts("tokens")
        eos, bos = token_id(vocabulary, "eos_token_id", tokens), token_id(vocabulary, "bos_token_id", tokens)
        return cls(
            tokenizer,
            eos_ids=[eos] if eos is not None else [],
            bos_token=tokens[bos] if bos is not None else "",
            eos_token=tokens[eos] if eos is not None else "",
            chat_template=fields.text("tokenizer.chat_template", None),
        )

    @classmethod
    def from_hf(cls, directory: Path) -> TextCodec:
        """The codec of a Hugging Face model directory: ``tokenizer.json``, ``tokenizer_config.json`` (special
        tokens, chat template; or ``chat_template.jinja``) and the end tokens of ``generation_config.json``
        or ``config.json``. Each file is read only inside the directory (links resolved) and checked as
        it is read (ModelFileError naming the file and the key)."""
        tokenizer_file = optional_file(directory, "tokenizer.json")
        if tokenizer_file is None:
            raise BatchError(f"{directory}: no tokenizer.json (the model's tokenizer) in the directory")
        tokenizer = _tokenizer(tokenizer_file)
        settings = _settings(directory, "tokenizer_config.json")
        template = _chat_template(settings)
        jinja = optional_file(directory, "chat_template.jinja")
        if jinja is not None:
            template = read_text(jinja)
        bos, eos = (_token_text(settings, name) for name in ("bos_token", "eos_token"))
        vocabulary = {"low": 0, "high": tokenizer.get_vocab_size() - 1, "single": True}
        ends = _settings(directory, "generation_config.json").integers("eos_token_id", None, **vocabulary)
        if ends is None:
            ends = _settings(directory, "config.json").integers("eos_token_id", None, **vocabulary)
        if ends is None:
            ends = [tokenizer.token_to_id(eos)] if eos and tokenizer.token_to_id(eos) is not None else []
        return cls(tokenizer, eos_ids=[int(end) for end in ends], bos_token=bos, eos_token=eos, chat_template=template)

    @cached_property
    def control(self) -> ControlTokens:
        """The tokenizer's control (special) tokens, kept apart from message text in :meth:`encode_chat`."""
        return ControlTokens(self.tokenizer)

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's bytes in decoded text (:mod:`batchgpu.models.token_bytes`), checked against
        :meth:`decode` when first asked."""
        return TokenBytes(self.tokenizer)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``, a control token wherever its text appears; ``special``: with the tokens
        the tokenizer adds around a text (a SentencePiece model's BOS), as transformers'
        ``add_special_tokens``. Safe to call from another thread: the tokenizer runs without holding
        Python's GIL."""
        check_text(text, "prompt")
        ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=special)[0].ids
        if len(text) >= LARGE_TEXT:
            release_freed_memory()
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; control tokens (``<|im_end|>``) are left out, as in a chat reply."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        """The prompt for ``messages`` (``[{"role": ..., "content": ...}, ...]``) through the model's own
        chat template, with the assistant's turn opened (``tools``: OpenAI's tool objects, the template's
        ``tools`` variable); a template that refuses the messages (``raise_exception``, or an error on
        them) raises RequestError."""
        if not self.chat_template:
            raise RequestError("chat: this model's files have no chat template; send a prompt instead", "messages")
        _check_messages(messages)
        try:
            template = _compiled_template(self.chat_template)
        except Exception as exc:  # the model file's template, not the request, is at fault
            raise BatchError(f"chat: the model's chat template does not compile: {exc}") from exc
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools is not None else None,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # raise_exception, or the template failing on these messages
            raise RequestError(f"chat: the chat template refused the messages: {exc}", "messages") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        trusted: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of :meth:`render_chat`'s prompt. Control tokens come from the template alone: text in
        the messages that spells a special token (``<|im_end|>``) is encoded as plain text, so a message
        cannot open a turn of another role (:mod:`batchgpu.models.control`); otherwise the ids equal those of
        the rendered prompt encoded as one string, as ``transformers`` and vLLM encode it. ``trusted``:
        special-token text in the messages is control too (that one-string encoding; for messages the
        application itself wrote). ``tools`` as in :meth:`render_chat`, their text kept apart alike."""
        _check_messages(messages)
        if trusted:
            return self.encode(self.render_chat(messages, tools), special=False)
        ids = self.control.encode(messages, self.render_chat, tools)
        if len(ids) >= LARGE_TEXT // 8:
            release_freed_memory()
        return ids


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the heap memory freed since to the operating system (glibc keeps freed memory for reuse: after a
    large text's encoding that is hundreds of MB the process would hold on to; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            shown = brief(message)
            raise RequestError(f"chat: messages[{i}] must be a mapping with a str 'role', got {shown}", "messages")
        if not isinstance(message.get("content"), str):
            raise RequestError(f"chat: messages[{i}]['content'] must be a str", "messages")
        for key, value in message.items():
            _check_texts(value, f"messages[{i}].{key}")


def _check_texts(value: Any, what: str) -> None:
    """Every string in ``value`` (a message's field: nested lists and mappings too) is valid text."""
    if isinstance(value, str):
        check_text(value, what, "messages")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_texts(item, f"{what}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_texts(item, f"{what}[{index}]")


def check_text(text: Any, what: str, param: str = "prompt") -> None:
    """Text the tokenizer can take: a str of Unicode scalar values (JSON's ``\\ud800`` escapes give a lone
    surrogate, which is not one)."""
    if not isinstance(text, str):
        raise RequestError(f"{what} must be a str, got {brief(text)}", param)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"a lone surrogate {text[exc.start]!r} at character {exc.start}"
            raise RequestError(f"{what} is not valid Unicode: {where}", param) from None


def _tokenizer(file: Path) -> Any:
    """A ``tokenizers`` Tokenizer from its JSON file; ModelFileError where the library refuses it."""
    from tokenizers import Tokenizer

    text = read_text(file)
    try:
        return Tokenizer.from_str(text)
    except Exception as error:  # the tokenizers library raises plain Exceptions
        raise ModelFileError(f"{file}: not a tokenizer the tokenizers library reads: {error}") from None


def _settings(directory: Path, name: str) -> Fields:
    """The fields of the directory's JSON object file ``name`` (none where there is no such file)."""
    file = optional_file(directory, name)
    return Fields(read_json(file) if file is not None else {}, file or directory / name)


def _chat_template(settings: Fields) -> str | None:
    """tokenizer_config.json's chat template: a string, or named templates (the one named default)."""
    template = settings.raw("chat_template", None)
    if template is None or isinstance(template, str):
        return template
    if not isinstance(template, list) or not all(isinstance(t, Mapping) for t in template):
        raise settings.refuse("chat_template", "a string or an array of {name, template} objects", template)
    named = {}
    for i, entry in enumerate(template):
        fields = Fields(entry, settings.source, f"chat_template[{i}].")
        named[fields.text("name")] = fields.text("template")
    return named.get("default")


def _token_text(settings: Fields, name: str) -> str:
    """A special token of tokenizer_config.json: a str, or an AddedToken's object (its ``content``)."""
    token = settings.raw(name, "")
    if isinstance(token, str):
        return token
    inner = settings.mapping(name) if isinstance(token, Mapping) else None
    if inner is None:
        raise settings.refuse(name, "a string or an object with a string content", token)
    return inner.text("content", "")


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """``source`` compiled in :func:`_chat_environment`, once per template text (a render is thread-safe)."""
    return _chat_environment().from_string(source)


def _chat_environment() -> Any:
    """A sandboxed jinja2 environment like the one ``transformers`` renders chat templates with."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = tojson  # transformers' (jinja's own escapes HTML: "<" as "\u003c")
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment
