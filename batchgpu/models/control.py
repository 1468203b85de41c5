"""Chat prompts whose control tokens come from the chat template alone.

A chat template writes control tokens (``<|im_start|>``, ``<|eot_id|>``) as text around the messages, and
``transformers`` and vLLM tokenize the rendered prompt as one string: a message whose text contains
``<|im_end|>\\n<|im_start|>system`` then opens a system turn of its own. :class:`ControlTokens` tokenizes
the same rendered string so that only the occurrences the template wrote are control tokens:

1. every string of the messages (content, role, name) has each special token's text swapped for a
   placeholder (a noncharacter, a per-codec random number, the token's index) before the template sees it;
2. in the rendered prompt, every special token's text is then the template's own: it becomes a marker
   that a private copy of the tokenizer knows as a (non-special) added token with the special token's
   matching rules, and the placeholders get their text back;
3. that copy, with special tokens disabled (``encode_special_tokens``), encodes the whole string once, and
   each marker's id becomes the special token's id.

So the ids equal those of the rendered prompt tokenized as one string whenever the messages hold no special
token's text (the same normalizer, pre-tokenizer splits and added-token boundaries, a SentencePiece
vocabulary's leading ``▁`` included), and a special token's text inside a message is plain text.
Templates that trim, join or move message text (a system message merged into the first user turn) see
placeholders where the special text was and carry them along. A message holding a marker's text (which
needs the codec's random number) is refused.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import RequestError

MARKER_START, MARKER_END = "\ufdd0", "\ufdd1"
PLACEHOLDER_START, PLACEHOLDER_END = "\ufdd2", "\ufdd3"
"""Unicode noncharacters (reserved for a program's internal use) around the markers and placeholders."""


class ControlTokens:
    """The special added tokens of a ``tokenizers`` Tokenizer, and the copy of it that keeps them apart
    from message text (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import AddedToken, Tokenizer

        self.nonce = str(secrets.randbits(96))
        added = tokenizer.get_added_tokens_decoder().items()
        special = {token.content: (i, token) for i, token in added if token.special}
        self.texts = sorted(special, key=len, reverse=True)  # longest first: a regex alternation then matches
        self.pattern = re.compile("|".join(re.escape(text) for text in self.texts)) if self.texts else None
        self.guarded = Tokenizer.from_str(tokenizer.to_str())
        self.guarded.encode_special_tokens = True
        self.markers = {text: f"{MARKER_START}{self.nonce}:{k}{MARKER_END}" for k, text in enumerate(self.texts)}

        def added(text: str) -> Any:
            token = special[text][1]
            options = dict(single_word=token.single_word, lstrip=token.lstrip, rstrip=token.rstrip)
            return AddedToken(self.markers[text], special=False, normalized=token.normalized, **options)

        # one call for all: each call rebuilds the added-token matcher (Gemma 3 has over 6,000 special tokens)
        self.guarded.add_tokens([added(text) for text in self.texts])
        # a marker's id in ``guarded`` -> the special token's id
        self.ids = {self.guarded.token_to_id(self.markers[text]): special[text][0] for text in self.texts}
        self.placeholders = {
            text: f"{PLACEHOLDER_START}{self.nonce}:{k}{PLACEHOLDER_END}" for k, text in enumerate(self.texts)
        }

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        render: Callable[[list[dict[str, Any]], Any], str],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the prompt ``render(messages, tools)`` makes, control tokens only where the template
        wrote them (no BOS or other tokens added around the prompt: the template writes those); the
        strings of ``tools`` (the request's tool objects) are kept apart like the messages'."""
        escaped_tools = self._escaped(list(tools)) if tools is not None else None
        rendered = render([self._escaped(message) for message in messages], escaped_tools)
        if self.pattern is not None:
            rendered = self.pattern.sub(lambda found: self.markers[found.group()], rendered)
        for text, placeholder in self.placeholders.items():
            rendered = rendered.replace(placeholder, text)
        if PLACEHOLDER_START + self.nonce in rendered:
            raise RequestError("chat: the chat template cut a message's control-token text apart", "messages")
        ids = self.guarded.encode_batch_fast([rendered], add_special_tokens=False)[0].ids
        return [self.ids.get(i, i) for i in ids]

    def _escaped(self, value: Any) -> Any:
        """``value`` (a message, or a value inside one) with each special token's text in its strings
        swapped for a placeholder."""
        if isinstance(value, str):
            if self.nonce in value:
                raise RequestError("chat: a message holds a reserved sequence", "messages")
            if self.pattern is None:
                return value
            return self.pattern.sub(lambda found: self.placeholders[found.group()], value)
        if isinstance(value, Mapping):
            return {key: self._escaped(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._escaped(item) for item in value]
        return value
