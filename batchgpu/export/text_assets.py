"""The text side of an exported chat app: a model's :class:`~batchgpu.models.codec.TextCodec` written as the
files the app's ``tokenizer.js`` reads.

:func:`write_text_assets` writes ``tokenizer.json`` (the codec's ``tokenizers`` Tokenizer as Hugging Face's
JSON: for a GGUF vocabulary the byte-level BPE or SentencePiece tokenizer that Python builds from it) and
``chat.json`` (the chat template, BOS/EOS texts and ids, whether a plain encode adds BOS, and the ids that
end a reply, which are the ones the Engine stops at: the codec's ``eos_ids``).

``tokenizer.js`` (an ES module of the app, beside a vendored ``@huggingface/tokenizers`` and
``@huggingface/jinja``) reads them with ``loadCodec(base)`` and gives the same ids and text as the Python
codec: ``encode(text, {special})`` (``TextCodec.encode``), ``encodeChat(messages, {trusted})``
(``encode_chat``: control tokens only where the template wrote them, as :mod:`batchgpu.models.control`
keeps them), ``renderChat(messages)`` (``render_chat``, the same jinja globals and filters), ``decode(ids)``
(control tokens left out), ``stream()`` (incremental text as :class:`~batchgpu.llm.text.TextStream`: never
a partial UTF-8 character), ``stopIds``, ``bosId``, ``eosId`` and ``hasChatTemplate``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models.codec import TextCodec

CHAT_FORMAT = 1
"""Version of ``chat.json``'s layout (``tokenizer.js`` refuses another)."""


def write_text_assets(codec: TextCodec, out: Path) -> None:
    """Write ``out/tokenizer.json`` and ``out/chat.json`` for ``codec`` (``out`` must exist)."""
    out = Path(out)
    (out / "tokenizer.json").write_text(codec.tokenizer.to_str(), encoding="utf-8")
    text = json.dumps(chat_settings(codec), ensure_ascii=False, indent=1)
    (out / "chat.json").write_text(text, encoding="utf-8")


def chat_settings(codec: TextCodec) -> dict[str, Any]:
    """What ``chat.json`` holds: the template (or None), BOS/EOS texts and ids (None where the model has
    none), ``add_bos`` (a plain ``encode(text)`` starts with tokens the tokenizer adds) and ``stop_ids``."""
    post = codec.tokenizer.post_processor
    return {
        "format": CHAT_FORMAT,
        "chat_template": codec.chat_template or None,
        "bos_token": codec.bos_token,
        "eos_token": codec.eos_token,
        "bos_id": _token_id(codec, codec.bos_token),
        "eos_id": _token_id(codec, codec.eos_token),
        "add_bos": post is not None and post.num_special_tokens_to_add(False) > 0,
        "stop_ids": sorted(codec.eos_ids),
    }


def _token_id(codec: TextCodec, text: str) -> int | None:
    return codec.tokenizer.token_to_id(text) if text else None
