"""Each token's bytes (batchgpu/models/token_bytes.py) under every tokenizer kind the project loads, against the
tokenizer's own decoding (and sentencepiece's): GGUF byte-level BPE (SmolLM2), GGUF SentencePiece with byte
fallback (Gemma 3 270M; one trained here with the sentencepiece package, with Llama 2's dummy prefix), and
Hugging Face tokenizer.json directories (SmolLM2's and Gemma 3's tokenizers saved there, a Metaspace one in
today's Llama 2 form, a character BPE without decoder; WordPiece, which is not a concatenation, falls back to
each token decoded alone). Texts whose characters split over tokens (Chinese, emoji, characters only byte
fallback spells) and random id sequences with control tokens among them join to the decoding.

Then the logprobs built from those bytes, without a model: an output processor fed token ids (and logprob
entries naming other top ids) gives chat ``bytes`` that join to the text's UTF-8 and ``token`` strings that
are those bytes (``\\xNN`` for a byte outside a whole character), completions ``tokens`` that join to the text
with ``text_offset`` on it, streamed or whole, and an echoed prompt whose tokens join to the prompt as given
(its BOS empty, a control token it spells shown)."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pytest

from batchgpu.llm.logprobs import CompletionTokens, chat_logprobs, completed
from batchgpu.llm.output import OutputProcessor, joined
from batchgpu.llm.params import SamplingParams
from batchgpu.llm.step import TokenLogprob
from batchgpu.llm.text import REPLACEMENT, TextStream
from batchgpu.models.codec import TextCodec
from batchgpu.models.token_bytes import BYTE_TOKEN, TokenBytes, byte_characters, shown

from .test_gemma3 import gemma3_270m  # noqa: F401 - a fixture
from .test_gguf_tokenizers import CORPUS, codec_of, sentencepiece_model, write_sentencepiece_vocabulary  # noqa: F401

pytest.importorskip("tokenizers")

TEXTS = [
    "The capital of France is Paris.",
    "  two leading spaces and\ttabs\nnew lines\n",
    "你好\uff0c世界\u3002今天天气很好",
    "emoji 😀🎉👩‍👩‍👧 and ½ ü é",
    "日本語のテキスト and 한국어 mixed",
    "rare: 𓀀𓁐 \U0001d518\U0001d52b\U0001d526 ꙮ",
]
"""Texts whose characters split over tokens: byte-level BPE splits most non-Latin characters into partial
bytes, SentencePiece spells rare ones (the last line) with byte pieces."""


def trained_metaspace() -> Any:
    """A Hugging Face tokenizer in today's Llama 2 form: Metaspace, ``▁`` prepended to the first piece only,
    byte fallback in the model (the decoder keeps ``<0xXX>`` pieces as text, as this form does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    tokenizer.train_from_iterator(
        [*CORPUS, *TEXTS], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    )
    return tokenizer


def characters_without_decoder() -> Any:
    """A character BPE without decoder (as the tests' tiny checkpoints write): decoding joins tokens by spaces."""
    from tokenizers import Tokenizer, models

    vocab = {character: i for i, character in enumerate(sorted(set("".join(TEXTS))))}
    tokenizer = Tokenizer(models.BPE(vocab, []))
    tokenizer.add_special_tokens(["<|end|>"])
    return tokenizer


def wordpiece() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "[SEP]", "the", "capital", "of", "fr", "##ance", "is", "paris", ".", "two", "and"]
    tokenizer = Tokenizer(models.WordPiece({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["[SEP]"])
    return tokenizer


def in_directory(tokenizer: Any, directory: Path) -> TextCodec:
    """The codec of a Hugging Face directory holding ``tokenizer`` as its tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return TextCodec.from_hf(directory)


KINDS = ["smollm2", "smollm2-dir", "gemma3", "gemma3-dir", "sentencepiece", "metaspace-dir", "no-decoder-dir"]


CODECS: dict[str, TextCodec] = {}


@pytest.fixture
def codec(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TextCodec:
    """The codec of one tokenizer kind (built once)."""
    kind = request.param
    if kind not in CODECS:
        folder = tmp_path_factory.mktemp(kind)
        if kind.startswith("smollm2"):
            made = request.getfixturevalue("smollm2_codec")
        elif kind.startswith("gemma3"):
            from batchgpu.models.gguf_reader import GGUFFile

            made = TextCodec.from_gguf(GGUFFile(request.getfixturevalue("gemma3_270m")))
        elif kind == "sentencepiece":
            made = codec_of(
                write_sentencepiece_vocabulary(folder / "spm.gguf", request.getfixturevalue("sentencepiece_model"))
            )
        elif kind == "metaspace-dir":
            made = in_directory(trained_metaspace(), folder)
        else:
            made = in_directory(characters_without_decoder(), folder)
        if kind in ("smollm2-dir", "gemma3-dir"):  # the GGUF file's tokenizer as a directory's tokenizer.json
            made = in_directory(made.tokenizer, folder)
        CODECS[kind] = made
    return CODECS[kind]


def one_replacement(text: str) -> str:
    """``text`` with each run of U+FFFD as one."""
    return re.sub("\ufffd+", "\ufffd", text)


def decoded_from_bytes(codec: TextCodec, ids: list[int]) -> str:
    """The decoding of ``ids`` as their bytes give it: read as UTF-8, except that under byte fallback a run of
    byte pieces that is not valid UTF-8 as a whole is one U+FFFD per byte (ASCII bytes in it too), as the
    ``ByteFallback`` decoder writes it (the module docstring's exception)."""
    table = codec.token_bytes
    fallback = table.decoding is not None and ("bytes",) in table.decoding.steps
    text, run = "", b""
    for token, data in zip(ids, table.text(ids)):
        if table.skipped(token):
            continue
        if fallback and BYTE_TOKEN.fullmatch(codec.tokenizer.id_to_token(token)):
            run += data
            continue
        text += (run.decode("utf-8") if valid(run) else "\ufffd" * len(run)) + data.decode("utf-8", "replace")
        run = b""
    return text + (run.decode("utf-8") if valid(run) else "\ufffd" * len(run))


def valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("codec", KINDS, indirect=True)
def test_token_bytes_join_to_the_decoding(codec: TextCodec) -> None:
    """Every text encoded (with the tokens the tokenizer adds around it) and random id sequences (control
    tokens among them): the tokens' bytes at their places join to the tokenizer's decoding, exactly where
    that is valid UTF-8 (else up to its U+FFFD: one per invalid sequence, or per byte of a byte-fallback run
    that is not valid as a whole); control tokens add nothing."""
    table = codec.token_bytes
    assert table.exact and table.special
    for text in TEXTS:
        ids = codec.encode(text)
        parts = table.text(ids)
        assert b"".join(parts) == codec.decode(ids).encode("utf-8"), text
        assert all(parts[i] == b"" for i, token in enumerate(ids) if token in table.special)
    rng = random.Random(3)
    specials = sorted(table.special)
    for _ in range(200):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 16))]
        ids[rng.randrange(len(ids))] = rng.choice(specials)
        data = b"".join(table.text(ids))
        if valid(data):
            assert data.decode("utf-8") == codec.decode(ids), ids
        else:
            assert one_replacement(decoded_from_bytes(codec, ids)) == one_replacement(codec.decode(ids)), ids


def stream_deltas(codec: TextCodec, ids: list[int], stop: list[str], bytewise: bool) -> list[tuple[str, bool]]:
    """Each delta a TextStream gives for ``ids`` pushed in turn, then at finish."""
    stream = TextStream(codec, stop, bytewise=bytewise)
    return [tuple(stream.push(token)) for token in ids] + [tuple(stream.finish())]


@pytest.mark.parametrize("codec", KINDS, indirect=True)
def test_a_stream_read_from_bytes_gives_the_windows_deltas(codec: TextCodec) -> None:
    """A stream that reads its tokens' bytes gives, push by push, what decoding windows gives (the same text
    held back and released at the same tokens, stop strings found at the same place): for every text
    (characters split over tokens, a literal U+FFFD), random ids (control tokens, partial and invalid UTF-8
    among them), with and without stop strings."""
    table = codec.token_bytes
    assert table.exact
    rng = random.Random(5)
    specials = sorted(table.special)
    cases = [codec.encode(text) for text in [*TEXTS, f"held {REPLACEMENT} back"]]
    for _ in range(150):
        ids = [rng.randrange(codec.vocab_size) for _ in range(rng.randrange(1, 20))]
        if rng.random() < 0.5:
            ids[rng.randrange(len(ids))] = rng.choice(specials)
        cases.append(ids)
    released = 0
    for ids in cases:
        text = codec.decode(ids)
        words = [word for word in text.split() if word]
        for stop in ([], [rng.choice(words)[:3]] if words else ["a"], ["\n", REPLACEMENT]):
            bytewise = stream_deltas(codec, ids, stop, bytewise=True)
            assert bytewise == stream_deltas(codec, ids, stop, bytewise=False), (ids, stop)
            released += sum(1 for delta, _ in bytewise[:-1] if delta)
    assert released > len(cases)  # text comes out before the end


@pytest.mark.parametrize("codec", ["smollm2", "gemma3", "sentencepiece"], indirect=True)
def test_split_characters_keep_their_bytes(codec: TextCodec) -> None:
    """Tokens holding part of a character hold its bytes (not U+FFFD's): byte-level BPE splits Chinese and
    emoji, byte fallback spells rare characters; such a token alone reads as ``\\xNN`` escapes (OpenAI's form)."""
    table = codec.token_bytes
    partial = []
    for text in TEXTS[2:]:
        ids = codec.encode(text, special=False)
        parts = table.text(ids)
        assert b"".join(parts).decode("utf-8") == codec.decode(ids)
        for token, data in zip(ids, parts):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                partial.append((token, data))
    assert partial, "no token held part of a character"
    for token, data in partial:
        assert "\ufffd" not in table.alone(token) and "\\x" in shown(data)
        assert shown(data).encode("utf-8").decode("unicode_escape").encode("latin-1")[-1:] == data[-1:]


def test_sentencepiece_dummy_prefix_is_dropped_once_at_the_start(sentencepiece_model: Any, tmp_path: Path) -> None:  # noqa: F811
    """Llama 2's dummy prefix: decoding drops one leading space of the whole text, so a text's first token
    reads without it and the same token later with it; sentencepiece's own decoding agrees."""
    sp = sentencepiece_model
    codec = codec_of(write_sentencepiece_vocabulary(tmp_path / "spm.gguf", sp))
    table = codec.token_bytes
    assert table.decoding is not None and table.decoding.strip == (b" ", 1)
    for text in ["The quick brown fox", "  two leading spaces", "hello world"]:
        ids = sp.encode(text)
        parts = table.text(ids)
        assert b"".join(parts) == sp.decode(ids).encode("utf-8")
        assert not parts[0].startswith(b" ") or text.startswith("  ")
    word = sp.piece_to_id("\u2581quick")
    reader = table.reader()
    assert reader.place(word) == b"quick" and reader.take(word) == b"quick" and reader.take(word) == b" quick"
    space = sp.piece_to_id("\u2581")
    reader = table.reader()
    assert reader.take(space) == b"" and reader.take(space) == b" "  # one space dropped, not two


def test_metaspace_and_decoderless_texts_start_apart(tmp_path: Path) -> None:
    """Metaspace drops the ``▁`` of a text's first token only; a tokenizer without decoder joins tokens by
    spaces: each token but the first gets one. Control tokens skipped first do not take the first place."""
    metaspace = in_directory(trained_metaspace(), tmp_path / "metaspace")
    word = metaspace.tokenizer.token_to_id("\u2581quick")
    bos = metaspace.tokenizer.token_to_id("<s>")
    assert metaspace.token_bytes.text([bos, word, word]) == [b"", b"quick", b" quick"]
    plain = in_directory(characters_without_decoder(), tmp_path / "plain")
    ids = plain.encode("你好 on", special=False)
    assert b"".join(plain.token_bytes.text(ids)).decode() == plain.decode(ids) == "你 好   o n"


def test_a_tokenizer_that_is_no_concatenation_reads_tokens_alone(tmp_path: Path) -> None:
    """WordPiece joins words with spaces and cleans up punctuation: not a concatenation of token bytes, so the
    table is not exact and each token's bytes are its text decoded alone."""
    codec = in_directory(wordpiece(), tmp_path / "wordpiece")
    table = codec.token_bytes
    assert not table.exact and table.decoding is None
    ids = codec.encode("the capital of france is paris.", special=False)
    assert [table.later(i) for i in ids] == [codec.decode([i]).encode() for i in ids]


def test_byte_level_alphabet_is_gpt2s() -> None:
    """256 distinct characters, printable ones standing for themselves (GPT-2's ``bytes_to_unicode``)."""
    characters = byte_characters()
    assert len(set(characters)) == 256 and characters[ord("A")] == "A" and characters[ord(" ")] == "\u0120"
    assert characters[0] == "\u0100" and characters[0xAD] == "\u0143"


def test_completed_characters_carry_unfinished_bytes() -> None:
    """The characters bytes complete after unfinished ones, and what is still unfinished."""
    data = "你😀".encode()
    assert completed(b"", data[:2]) == ("", data[:2])
    assert completed(data[:2], data[2:5]) == ("你", data[3:5])
    assert completed(data[3:5], data[5:]) == ("😀", b"")
    assert completed(b"", b"\x80ok") == ("\ufffdok", b"")


# the logprobs built from them ------------------------------------------------------------------------


def run_outputs(codec: TextCodec, prompt: list[int], output: list[int]) -> list[Any]:
    """Pieces of an output processor fed ``output`` after ``prompt`` (logprob entries made up: each token with
    two other top ids, one of them a control token), every id pushed, the last by length."""
    specials = sorted(codec.token_bytes.special)
    params = SamplingParams(max_tokens=len(output), logprobs=3, prompt_logprobs=2, ignore_eos=True)
    processor = OutputProcessor(codec, params, len(prompt))
    entries = [
        TokenLogprob(token, -1.0, ((token, -1.0), (specials[0], -2.0), ((token * 7 + 3) % codec.vocab_size, -3.0)))
        for token in prompt[1:]
    ]
    processor.add_prompt_logprobs(prompt, entries, 0)
    pieces = []
    for index, token in enumerate(output):
        other = (token * 31 + index) % codec.vocab_size
        entry = TokenLogprob(token, -0.5, ((token, -0.5), (other, -1.5), (specials[-1], -4.0)))
        pieces.append(processor.push(token, entry))
        if pieces[-1].finish_reason is not None:
            break
    return pieces


@pytest.mark.parametrize("codec", KINDS, indirect=True)
def test_logprobs_join_to_the_text(codec: TextCodec) -> None:
    """For each text as a reply's output: the chat ``bytes`` join to its UTF-8 (each ``token`` those bytes,
    escaped where partial; top ids' likewise), and the completions ``tokens`` join to it with ``text_offset``
    each token's start, whole or over the streamed pieces (the tokens' state carried from piece to piece)."""
    for text in TEXTS:
        output = codec.encode(text, special=False)
        pieces = run_outputs(codec, codec.encode("Hi"), output)
        whole = joined(pieces)
        assert whole.text == codec.decode(output) and whole.logprobs is not None
        content = chat_logprobs(whole.logprobs)["content"]
        assert b"".join(bytes(entry["bytes"]) for entry in content) == whole.text.encode("utf-8"), text
        for entry, placed in zip(content, whole.logprobs):
            assert entry["token"] == shown(bytes(entry["bytes"])) and bytes(entry["bytes"]) == placed.token_bytes
            assert [top["token"] for top in entry["top_logprobs"]] == [shown(data) for data in placed.top_bytes]
            assert entry["top_logprobs"][2] == {"token": "", "logprob": -4.0, "bytes": []}  # a control token
        legacy = CompletionTokens().logprobs(whole.logprobs, whole.token_texts or {}, end=True)
        assert "".join(legacy["tokens"]) == whole.text, text
        starts = [len("".join(legacy["tokens"][:i])) for i in range(len(legacy["tokens"]))]
        assert legacy["text_offset"] == starts
        for top, token in zip(legacy["top_logprobs"], legacy["tokens"]):
            assert top[token] == -0.5
        streamed = CompletionTokens(5)
        chunks = [streamed.logprobs(p.logprobs, p.token_texts or {}, end=p.finish_reason is not None) for p in pieces]
        assert [t for chunk in chunks for t in chunk["tokens"]] == legacy["tokens"]
        assert [o - 5 for chunk in chunks for o in chunk["text_offset"]] == legacy["text_offset"]


@pytest.mark.parametrize("codec", KINDS, indirect=True)
def test_echoed_prompt_tokens_join_to_the_prompt(codec: TextCodec) -> None:
    """The echo of a text prompt: its tokens join to the prompt as given, the BOS a tokenizer adds empty, a
    control token the prompt spells shown as its text; ``text_offset`` on the prompt."""
    control = codec.token_bytes.special
    spelled = next(text for i, text in sorted(control.items()) if codec.encode(text, special=False) == [i])
    for text in [*TEXTS, f"{spelled}user\n你好{spelled}"]:
        prompt = codec.encode(text)
        if codec.decode(prompt) != text.replace(spelled, ""):
            continue  # a tokenizer that does not give this text back (the documented exception)
        pieces = run_outputs(codec, prompt, codec.encode(" ok", special=False))
        echoed = CompletionTokens(given=text).logprobs(pieces[0].prompt_logprobs, pieces[0].token_texts or {}, end=True)
        assert "".join(echoed["tokens"]) == text, text
        assert echoed["token_logprobs"][0] is None and echoed["top_logprobs"][0] is None
        assert echoed["text_offset"] == [len("".join(echoed["tokens"][:i])) for i in range(len(prompt))]


@pytest.mark.parametrize("codec", ["smollm2", "gemma3"], indirect=True)
def test_a_text_that_ends_inside_a_character(codec: TextCodec) -> None:
    """An output cut by length inside a character: the text ends in U+FFFD (its decoding), the chat bytes are
    the partial character's own, the completions tokens' last string the U+FFFD (one; byte fallback's
    decoding writes one per byte of the unfinished character)."""
    table, cuts = codec.token_bytes, 0
    for text in ("ab 😀", "ab 𓀀"):
        output = codec.encode(text, special=False)
        for cut in range(1, len(output)):
            data = b"".join(table.text(output[:cut]))
            try:
                data.decode("utf-8")
                continue
            except UnicodeDecodeError:
                cuts += 1
            whole = joined(run_outputs(codec, codec.encode("Hi"), output[:cut]))
            assert b"".join(entry.token_bytes for entry in whole.logprobs or ()) == data
            assert one_replacement(whole.text) == data.decode("utf-8", "replace") and whole.text.endswith("\ufffd")
            legacy = CompletionTokens().logprobs(whole.logprobs or [], whole.token_texts or {}, end=True)
            assert "".join(legacy["tokens"]) == data.decode("utf-8", "replace") and legacy["tokens"][-1].endswith(
                "\ufffd"
            )
    assert cuts


def test_token_bytes_table_is_checked_against_the_decoding(smollm2_codec: TextCodec) -> None:
    """A table that disagrees with the tokenizer's decoding is not used: its check fails and the table falls
    back to tokens decoded alone (here a decoder the table would read wrong: byte-level, then a replacement)."""
    from tokenizers import Tokenizer, decoders

    tokenizer = Tokenizer.from_str(smollm2_codec.tokenizer.to_str())
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("a", "b")])
    table = TokenBytes(tokenizer)
    assert not table.exact
    assert TokenBytes(smollm2_codec.tokenizer).exact
