"""The engine's host side: the GGUF tokenizer with its control tokens, the chat template, streaming text
that never splits a character and leaves stop strings out, sampling parameter checks, KV block
bookkeeping. No device involved."""

from __future__ import annotations

import pytest

from batchgpu.errors import RequestError
from batchgpu.llm import SamplingParams
from batchgpu.llm.blocks import BlockPool
from batchgpu.llm.text import REPLACEMENT, TextCodec, TextStream


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from batchgpu.models.llama import GGUFWeights, smollm2_path

    try:
        path = smollm2_path()
    except Exception as exc:
        pytest.skip(str(exc))
    return TextCodec.from_gguf(GGUFWeights(path).file)


def test_control_tokens_are_single_tokens(codec: TextCodec) -> None:
    assert codec.encode("<|im_start|>user\nHi<|im_end|>") == [1, 4093, 198, 26843, 2]
    assert codec.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert codec.eos_ids == {2} and codec.decode([504, 2]) == "The"


def test_chat_template_renders_the_models_own_format(codec: TextCodec) -> None:
    text = codec.render_chat([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(RequestError, match=r"messages\[0\]"):
        codec.render_chat([{"content": "no role"}])


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 end", "plain ascii text"])
def test_stream_never_splits_a_character(codec: TextCodec, text: str) -> None:
    ids = codec.encode(text)
    stream = TextStream(codec)
    pieces = [stream.push(token).text for token in ids] + [stream.finish().text]
    assert "".join(pieces) == text
    assert not any(REPLACEMENT in piece for piece in pieces)
    if any(REPLACEMENT in codec.decode([token]) for token in ids):  # a token ends inside a character
        assert "" in pieces[:-1]  # ... and was held back until the character was whole


def test_some_tokens_end_inside_a_character(codec: TextCodec) -> None:
    """The case the stream handles exists in this vocabulary (so the test above can fail)."""
    assert any(REPLACEMENT in codec.decode([token]) for token in codec.encode("emoji 🙂🚀 end"))


def test_stop_strings_end_the_stream_and_are_left_out(codec: TextCodec) -> None:
    ids = codec.encode("The capital of France is Paris. It is big.")
    stream = TextStream(codec, stop=["Paris", "big"])
    pieces = []
    for token in ids:
        delta = stream.push(token)
        pieces.append(delta.text)
        if delta.stopped:
            break
    assert "".join(pieces) == "The capital of France is "
    assert stream.stopped and stream.push(5).stopped


def test_stop_string_over_several_tokens_is_held_back(codec: TextCodec) -> None:
    ids = codec.encode("one two three four")
    stream = TextStream(codec, stop=["three four five"])  # never completed: everything comes out at the end
    pieces = [stream.push(token).text for token in ids]
    assert "".join(pieces) != "one two three four"  # the tail that could start the stop string waits
    assert "".join(pieces) + stream.finish().text == "one two three four"


BAD_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"seed": -5}, "seed"),
    ({"seed": 2**40}, "seed"),
    ({"stop": [1, 2]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize(("values", "name"), BAD_PARAMS)
def test_bad_sampling_params_are_refused(values: dict, name: str) -> None:
    with pytest.raises(RequestError, match=name):
        SamplingParams(**values)


def test_sampling_params_normalize() -> None:
    params = SamplingParams(stop="end", stop_token_ids=[7], temperature=0)
    assert params.stop == ("end",) and params.stop_token_ids == (7,) and params.greedy


def test_block_pool_hands_out_and_takes_back_blocks() -> None:
    pool = BlockPool(6, 4)
    a: list[int] = []
    b: list[int] = []
    assert pool.grow(a, 9) and a == [0, 1, 2] and pool.free == 3
    assert pool.grow(a, 12) and a == [0, 1, 2]  # still fits
    assert not pool.grow(b, 20) and b == [] and pool.free == 3  # nothing taken when it cannot fit
    assert pool.grow(b, 5) and b == [3, 4]
    assert pool.row(b, 6) == 4 * 4 + 2
    pool.release(a)
    assert a == [] and pool.free == 4 and pool.used == 2
    assert pool.grow(a, 16) and sorted(a) == [0, 1, 2, 5]
    with pytest.raises(RequestError):
        BlockPool(0, 16)
