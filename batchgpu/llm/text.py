"""Text in and out of a model: the tokenizer and chat template from the GGUF file itself, and streaming
detokenization that never splits a UTF-8 character and holds back text that may begin a stop string."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError

CONTROL_TOKEN = 3  # GGUF tokenizer.ggml.token_type of control tokens (<|im_start|>, <|endoftext|>, ...)
REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class TextCodec:
    """A GGUF model's tokenizer (byte-level BPE from its own vocabulary and merges, control tokens kept
    whole), its end-of-sequence token and its chat template (jinja2, as ``transformers`` renders it)."""

    def __init__(self, reader: Any) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        fields = reader.fields
        tokens = list(fields["tokenizer.ggml.tokens"].contents())
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
        tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else []
        control = [tokens[i] for i, kind in enumerate(types) if kind == CONTROL_TOKEN]
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
        self.tokenizer = tokenizer
        self.vocab_size = len(tokens)
        self.eos_id = _field(fields, "tokenizer.ggml.eos_token_id")
        self.bos_id = _field(fields, "tokenizer.ggml.bos_token_id")
        self.chat_template: str | None = _field(fields, "tokenizer.chat_template")
        self.bos_token = tokens[self.bos_id] if self.bos_id is not None else ""
        self.eos_token = tokens[self.eos_id] if self.eos_id is not None else ""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; control tokens (``<|im_end|>``) are left out, as in a chat reply."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt for ``messages`` (``[{"role": ..., "content": ...}, ...]``) through the model's own
        chat template, with the assistant's turn opened."""
        if not self.chat_template:
            raise RequestError("chat: this model's GGUF file has no tokenizer.chat_template; send a prompt instead")
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


def _field(fields: Mapping[str, Any], name: str) -> Any:
    return fields[name].contents() if name in fields else None


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
