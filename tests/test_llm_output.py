"""The engine's per-request output processor on SmolLM2's tokenizer (no device): pieces whose text joins
to the decoded ids, the end of a generation at max_tokens, end-of-sequence, stop token ids and stop
strings (also one spread over several tokens), and the held-back text flushed with the last piece."""

from __future__ import annotations

import pytest

from batchgpu.llm import SamplingParams
from batchgpu.llm.output import OutputProcessor, Piece
from batchgpu.llm.text import REPLACEMENT, TextCodec

PROMPT_TOKENS = 7


@pytest.fixture(scope="module")
def codec(smollm2_codec: TextCodec) -> TextCodec:
    return smollm2_codec


def pieces(codec: TextCodec, ids: list[int], **params) -> list[Piece]:
    """The pieces of ``ids`` pushed in order, up to the one that ends the generation."""
    output = OutputProcessor(codec, SamplingParams(**params), PROMPT_TOKENS)
    got = []
    for token in ids:
        got.append(output.push(token))
        if got[-1].finish_reason is not None:
            break
    return got


def joined(got: list[Piece]) -> str:
    return "".join(piece.text for piece in got)


def test_pieces_join_to_the_text_and_the_last_one_ends_at_max_tokens(codec: TextCodec) -> None:
    text = "héllo wörld, 日本語 🙂 end"
    ids = codec.encode(text)
    got = pieces(codec, ids, max_tokens=len(ids))
    assert joined(got) == text and [p.token_ids for p in got] == [[t] for t in ids]
    assert [p.finish_reason for p in got] == [None] * (len(ids) - 1) + ["length"]
    assert (got[-1].prompt_tokens, got[-1].completion_tokens) == (PROMPT_TOKENS, len(ids))
    assert all(p.completion_tokens == 0 for p in got[:-1])


def test_a_stop_string_over_several_tokens_ends_the_text_before_it(codec: TextCodec) -> None:
    ids = codec.encode("The capital of France is Paris. It is big.")
    assert not any("is Pa" in codec.decode([t]) for t in ids)  # the stop string spans tokens
    got = pieces(codec, ids, max_tokens=50, stop=["is Pa"])
    assert joined(got) == "The capital of France " and got[-1].finish_reason == "stop"
    assert codec.decode(ids[: len(got)]).endswith(" is Paris")  # it ends at the token completing it
    assert got[-1].completion_tokens == len(got)


def test_text_held_back_for_a_stop_string_comes_out_with_the_last_piece(codec: TextCodec) -> None:
    ids = codec.encode("one two three four")
    got = pieces(codec, ids, max_tokens=len(ids), stop=["three four five"])
    assert joined(got[:-1]) != "one two three four"  # the tail that could begin the stop string waits ...
    assert joined(got) == "one two three four" and got[-1].finish_reason == "length"  # ... and comes out at the end


def test_the_flush_at_max_tokens_can_complete_a_stop_string(codec: TextCodec) -> None:
    """An unfinished UTF-8 character at max_tokens decodes to U+FFFD; a stop string U+FFFD then ends it."""
    ids = [*codec.encode("ab"), codec.tokenizer.token_to_id("æ")]  # the byte 0xE6: a 3-byte character's start
    assert codec.decode(ids) == "ab" + REPLACEMENT
    stopped = pieces(codec, ids, max_tokens=len(ids), stop=[REPLACEMENT])
    assert joined(stopped) == "ab" and stopped[-1].finish_reason == "stop"
    plain = pieces(codec, ids, max_tokens=len(ids))
    assert joined(plain) == "ab" + REPLACEMENT and plain[-1].finish_reason == "length"


def test_end_of_sequence_ends_the_generation_and_flushes_its_text(codec: TextCodec) -> None:
    (eos,) = codec.eos_ids
    ids = [*codec.encode("Hello world"), eos, *codec.encode(" more")]
    got = pieces(codec, ids, max_tokens=50, stop=["never seen"])  # holds back up to 9 characters
    assert joined(got) == "Hello world" and got[-1].finish_reason == "stop"
    assert got[-1].token_ids == [eos] and got[-1].completion_tokens == len(got) == len(ids) - 1
    ignored = pieces(codec, ids, max_tokens=len(ids), ignore_eos=True)
    assert joined(ignored) == "Hello world more" and ignored[-1].finish_reason == "length"


def test_a_stop_token_id_ends_the_generation_without_its_text(codec: TextCodec) -> None:
    ids = codec.encode("The capital of France is Paris. It is big.")
    period = codec.encode(".")[0]
    got = pieces(codec, ids, max_tokens=50, stop_token_ids=[period])
    assert joined(got) == "The capital of France is Paris" and got[-1].finish_reason == "stop"
    assert got[-1].token_ids == [period]


def test_prompt_logprobs_of_a_prompt_run_again_replace_the_first_run(codec: TextCodec) -> None:
    """Prompt logprobs come in prefill pieces from position ``start``; a preempted sequence runs its prompt
    again from 0, and those pieces replace the first run's: one entry per prompt token, in order."""
    from batchgpu.llm.step import TokenLogprob

    prompt = [5, 6, 7, 8, 9]
    output = OutputProcessor(codec, SamplingParams(max_tokens=2, prompt_logprobs=0), len(prompt))
    first_run = [TokenLogprob(t, -1.0) for t in prompt[1:]]
    again = [TokenLogprob(t, -2.0) for t in prompt[1:]]
    output.add_prompt_logprobs(prompt, first_run[:2], 0)
    output.add_prompt_logprobs(prompt, again[:3], 0)  # preempted after its first piece: the prompt again
    output.add_prompt_logprobs(prompt, again[3:], 3)
    piece = output.push(11)
    assert piece.prompt_logprobs == [TokenLogprob(5, None), *again]
