"""Text in and out of a model: the tokenizer and chat template from the model's own files, and streaming
detokenization that never splits a UTF-8 character and holds back text that may begin a stop string."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BatchError, ModelFileError, RequestError
from ..models.fields import Fields
from ..models.files import optional_file, read_json, read_text

if TYPE_CHECKING:
    from ..models.gguf_reader import GGUFFile

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


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
        from ..models.gguf_tokenizer import gguf_tokenizer, token_id

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

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special``: with the tokens the tokenizer adds around a text (a
        SentencePiece model's BOS), as transformers' ``add_special_tokens``."""
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; control tokens (``<|im_end|>``) are left out, as in a chat reply."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt for ``messages`` (``[{"role": ..., "content": ...}, ...]``) through the model's own
        chat template, with the assistant's turn opened."""
        if not self.chat_template:
            raise RequestError("chat: this model's files have no chat template; send a prompt instead")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise RequestError(f"chat: messages[{i}] must be a mapping with a str 'role', got {message!r:.80}")
            if not isinstance(message.get("content"), str):
                raise RequestError(f"chat: messages[{i}]['content'] must be a str")
        return (
            _chat_environment()
            .from_string(self.chat_template)
            .render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )


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


def _chat_environment() -> Any:
    """A sandboxed jinja2 environment like the one ``transformers`` renders chat templates with."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment


@dataclass
class Delta:
    """New text of a stream, and whether a stop string ended it."""

    text: str
    stopped: bool = False


class TextStream:
    """Incremental detokenization of one generation: :meth:`push` takes each new token id and returns the
    text that is now final. Each token is decoded with the few before it (a window from the last point
    where the text was whole), so a stream costs about the same per token however long it gets. Text is
    held back while the newest tokens end in an incomplete UTF-8 character (their decoding ends in
    U+FFFD) or while it could still be the start of a stop string; a stop string ends the stream, its text
    and anything after it left out (as OpenAI's API does)."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) - 1 for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix = 0  # the decoding window starts here ...
        self.read = 0  # ... and its text up to here is already in ``text``
        self.text = ""  # the generation's text so far (whole characters only)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False

    def push(self, token: int) -> Delta:
        if self.stopped:
            return Delta("", True)
        self.ids.append(token)
        known = self.codec.decode(self.ids[self.prefix : self.read])
        window = self.codec.decode(self.ids[self.prefix :])
        if window.endswith(REPLACEMENT) or len(window) <= len(known):
            return Delta("")  # a character split over tokens (or nothing visible yet): wait
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += window[len(known) :]
        self.prefix, self.read = self.read, len(self.ids)
        found = [at for at in (self.text.find(stop, searched_from) for stop in self.stop) if at >= 0]
        if found:
            self.stopped = True
            return self._release(min(found), stopped=True)
        return self._release(len(self.text) - self.holdback)

    def finish(self) -> Delta:
        """The text still held back when the generation ends for another reason (EOS, max_tokens)."""
        if self.stopped:
            return Delta("", True)
        return self._release(len(self.text))

    def _release(self, end: int, *, stopped: bool = False) -> Delta:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return Delta(piece, stopped)
