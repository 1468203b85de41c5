"""Text out of a model: streaming detokenization that never splits a UTF-8 character and holds back text
that may begin a stop string. The codec it decodes with, :class:`~batchgpu.models.codec.TextCodec`, is the
model's (``from batchgpu.llm.text import TextCodec`` still works, for one release)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

from ..models.codec import TextCodec

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence

_TOKEN_TEXTS: weakref.WeakKeyDictionary[TextCodec, dict[int, str]] = weakref.WeakKeyDictionary()


def token_texts(codec: TextCodec) -> dict[int, str]:
    """The text of single token ids decoded so far with ``codec`` (``decode([id])``), shared by its streams."""
    texts = _TOKEN_TEXTS.get(codec)
    if texts is None:
        texts = _TOKEN_TEXTS[codec] = {}
    return texts


class Delta(NamedTuple):
    """New text of a stream, and whether a stop string ended it."""

    text: str
    stopped: bool = False


NOTHING, STOPPED = Delta(""), Delta("", True)


class TextStream:
    """Incremental detokenization of one generation: :meth:`push` takes each new token id and returns the
    text that is now final; :meth:`finish` returns the rest when the generation ends. Each token is decoded
    with the few before it (a window from the last point where the text was whole), so a stream costs about
    the same per token however long it gets (a one-token window's text, the usual case, is decoded once per
    codec and token id). Text is held back while the newest tokens end in an
    incomplete UTF-8 character (their decoding ends in U+FFFD) or while it could still be the start of a
    stop string; a stop string ends the stream, its text and anything after it left out (as OpenAI's API
    does). Nothing is lost: the pushed pieces and :meth:`finish` together are ``decode`` of all the ids, up
    to the stop string that ended the stream (U+FFFD included, where the ids end in invalid or unfinished
    UTF-8).

    Where the codec's decoding is the concatenation of its tokens' bytes
    (:attr:`~batchgpu.models.token_bytes.TokenBytes.exact`: the byte-level and SentencePiece decoders), the
    new text is read from the tokens' bytes instead (one table lookup for a token of whole characters),
    held and released where a window's would be; from invalid UTF-8 until the window's text is released,
    the stream decodes windows (whose U+FFFD are the decoder's own). ``bytewise`` False: windows always."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = (), *, bytewise: bool = True) -> None:
        self.codec = codec
        self.decode = codec.decode
        self.single = token_texts(codec)
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) - 1 for s in self.stop), default=0)
        self.ids: list[int] = []
        self.prefix = 0  # the decoding window starts here ...
        self.read = 0  # ... and its text up to here is already in ``text``
        self.text = ""  # with stop strings, the text not yet returned and what it follows (whole characters)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False
        table = codec.token_bytes if bytewise else None
        self.reader = table.reader() if table is not None and table.exact else None  # None: windows always
        self.held = b""  # read from bytes: the bytes of the tokens since the last release
        self.windowed = False  # decoding windows since invalid UTF-8, until a window's text is released

    def push(self, token: int) -> Delta:
        if self.stopped:
            return STOPPED
        self.ids.append(token)
        reader = self.reader
        if reader is None:
            return self._advance(final=False)
        text = None
        if reader.started and not reader.strip and not self.held and not self.windowed:  # one table lookup
            text = reader.table.later_text(token)  # the reader's place moves by nothing it keeps
            if not text or text[-1] == REPLACEMENT:
                text = None
        if text is None:
            text = self._from_bytes(reader.take(token))
            if self.windowed:  # since invalid UTF-8: the window's text
                delta = self._advance(final=False)
                if self.read == len(self.ids):  # released: whole characters up to here, bytes from here on
                    self.held, self.windowed = b"", False
                return delta
            if text is None:
                return NOTHING
        self.prefix, self.read = self.read, len(self.ids)
        return self._released(text, final=False) if self.stop else Delta(text)

    def _from_bytes(self, data: bytes) -> str | None:
        """The text of the held bytes and ``data`` (a token's) where it is released now; None where it is held
        (nothing visible, a character unfinished, or a U+FFFD that a window's text would hold) or where the
        bytes are not UTF-8 (then ``windowed`` is set: the stream decodes windows from here)."""
        if self.windowed:
            return None
        data = self.held + data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            self.windowed = error.reason != "unexpected end of data"  # invalid, else a character unfinished
            text = ""
        if self.windowed or not text or text[-1] == REPLACEMENT:
            self.held = data
            return None
        self.held = b""
        return text

    def finish(self) -> Delta:
        """Everything still held back when the generation ends for another reason (EOS, max_tokens): the
        text of a character the ids left unfinished (U+FFFD, as ``decode`` gives it) and the text that could
        have begun a stop string (cut at a stop string that this completes)."""
        if self.stopped:
            return STOPPED
        if self.reader is not None and not self.held and not self.windowed:
            return self._released("", final=True)
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> Delta:
        """Take the window's new text into ``text`` (not while it ends in an unfinished character, unless
        ``final``) and release what can no longer be part of a stop string (all of it without stop strings:
        then ``text`` is not kept)."""
        ids, prefix = self.ids, self.prefix
        known = self.single.get(ids[prefix]) if self.read - prefix == 1 else None
        if known is None:
            known = self._known()
        window = self.decode(ids[prefix:])
        if not final and (len(window) <= len(known) or window[-1] == REPLACEMENT):
            return NOTHING  # a character split over tokens (or nothing visible yet): wait
        self.prefix, self.read = self.read, len(self.ids)
        return self._released(window[len(known) :], final=final)

    def _released(self, new: str, *, final: bool) -> Delta:
        """What of the text so far and ``new`` can no longer be part of a stop string (all of it where the
        stream has none, or ``final``), cut at a stop string it completes."""
        if not self.stop:
            return Delta(new) if new else NOTHING
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += new
        found = [at for at in (self.text.find(stop, searched_from) for stop in self.stop) if at >= 0]
        if found:
            self.stopped = True
            return self._release(min(found), stopped=True)
        return self._release(len(self.text) if final else len(self.text) - self.holdback)

    def _known(self) -> str:
        """The text of the window's tokens already in ``text`` (``decode(ids[prefix:read])``)."""
        if self.read - self.prefix != 1:
            return self.decode(self.ids[self.prefix : self.read])
        token = self.ids[self.prefix]
        text = self.single.get(token)
        if text is None:
            text = self.single[token] = self.codec.decode([token])
        return text

    def _release(self, end: int, *, stopped: bool = False) -> Delta:
        """The text up to ``end`` not yet given; ``text`` keeps what is not (a stop string begins past it)."""
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        self.text, self.sent = self.text[self.sent :], 0
        return Delta(piece, stopped)
