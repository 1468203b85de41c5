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
a partial UTF-8 character), ``stopIds``, ``bosId``, ``eosId`` and ``hasChatTemplate``. Where the vendored
packages differ from Python's ``tokenizers`` and jinja2, the written JSON (:func:`portable_json`),
``tokenizer.js`` or ``chat_template.js`` (the templates' renderer) does as Python does: byte-fallback tokens
that are not UTF-8 as a whole decode to one U+FFFD per byte, characters a BPE vocabulary lacks are dropped
before merging, a loop iteration's text before its ``{% break %}`` or ``{% continue %}`` is kept, and a
template's ``strip``/``lstrip``/``rstrip`` (with their argument), ``trim``, ``split()`` and ``length`` of a
string follow Python's whitespace and count characters. Left different: a string indexed by position in a
template (``text[0]``) counts UTF-16 code units in JavaScript, and a loop over a string's characters is
refused there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models.codec import TextCodec

CHAT_FORMAT = 1
"""Version of ``chat.json``'s layout (``tokenizer.js`` refuses another)."""

BYTE_LEVEL_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
r"""The regex of ``tokenizers``' ByteLevel pre-tokenizer (GPT-2's split; ``use_regex``), which it matches
with Oniguruma. ``@huggingface/tokenizers`` 0.2.0 matches its own copy of it as a JavaScript regex, whose
``\s`` differs (U+FEFF is a space there, not in Oniguruma), so the JSON written for the app spells it out
as a Split step, whose pattern the JS package translates to Oniguruma's meaning."""


def write_text_assets(codec: TextCodec, out: Path) -> None:
    """Write ``out/tokenizer.json`` and ``out/chat.json`` for ``codec`` (``out`` made where missing)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(portable_json(codec.tokenizer), encoding="utf-8")
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


def portable_json(tokenizer: Any) -> str:
    """A ``tokenizers`` Tokenizer's JSON with each ByteLevel pre-tokenizer that splits by its own regex
    (``use_regex``, no prefix space) as the same two steps: a Split by :data:`BYTE_LEVEL_SPLIT` (isolated),
    then ByteLevel without the regex, as ``tokenizers`` itself runs it; the same ids in Python, and in
    JavaScript the same as Python's. (Other tokenizers' JSON, 12 MB for Gemma 3's, is left as it is.)"""
    text = tokenizer.to_str()
    pre = tokenizer.pre_tokenizer
    if pre is None:
        return text
    state = json.loads(pre.__getstate__())
    spelled = _split_spelled_out(state)
    if spelled == state:
        return text
    return json.dumps({**json.loads(text), "pre_tokenizer": spelled}, ensure_ascii=False)


def _split_spelled_out(step: Any) -> Any:
    if not isinstance(step, dict):
        return step
    if step.get("type") == "Sequence":
        return {**step, "pretokenizers": [_split_spelled_out(inner) for inner in step["pretokenizers"]]}
    if step.get("type") != "ByteLevel" or not step.get("use_regex", True) or step.get("add_prefix_space", True):
        return step
    split = {"type": "Split", "pattern": {"Regex": BYTE_LEVEL_SPLIT}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, {**step, "use_regex": False}]}


def _token_id(codec: TextCodec, text: str) -> int | None:
    return codec.tokenizer.token_to_id(text) if text else None
