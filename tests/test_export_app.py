"""The exported chat app as an app people keep, in headless Chromium (SwiftShader's WebGPU): the model runs in a
Web Worker, its GGUF file is kept in browser storage (OPFS, else the Cache API) and read from there on the next
load, a cut download resumes with a Range request, a full storage falls back to streaming, and the page speaks an
OpenAI-shaped JS API; under Node, the f16 self-test's machinery. Each page load compiles the pipelines again
(seconds on SwiftShader): the tests share one export and load few pages.

Contract: every load gives Python's greedy ids (the exported steps run in Python); the second load in one
browser, same origin, fetches no byte of the model; the main thread runs no task over 50 ms while the worker
generates."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.export.browser import Chromium, ServeLog, serve
from batchgpu.export.chat import export_chat
from batchgpu.export.chat_steps import ChatSteps
from batchgpu.export.node import NodeUnavailableError, find_node, node_environment, run_node, webgpu_package
from batchgpu.models.llama import open_weights, upload_weights
from batchgpu.models.speculative import Speculative

from .doc_blocks import named_block
from .test_export_chat import DRIVER, PROMPTS, ids_query, python_ids, tiny_model

STEPS = {"max_context": 48, "chunk": 4}
MODEL = "model.gguf"
CHAT = "window.batchgpuChat"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Tiny Qwen2 (q4_1, joined q/k/v with biases: varied text from a chat prompt), exported once: (model, app)."""
    folder = tmp_path_factory.mktemp("app")
    path = tiny_model(folder, "qwen2-q4_1")
    return path, export_chat(path, folder / "app", gpu_kernels=False, **STEPS)


@pytest.fixture(scope="module")
def greedy(app: tuple[Path, Path]) -> list[list[int]]:
    """Python's greedy ids for PROMPTS, 8 each."""
    return [python_ids(app[0], prompt, 8, **STEPS) for prompt in PROMPTS]


def page(browser: Chromium, base: str, query: str, script: str = CHAT, **options: Any) -> Any:
    return browser.evaluate(f"{base}index.html?{query}", script, 300, **options)


def check_ids(result: dict[str, Any], greedy: list[list[int]]) -> None:
    assert "error" not in result, result["error"]
    assert [run["token_ids"] for run in result["runs"]] == greedy
    assert [run["prompt_ids"] for run in result["runs"]] == PROMPTS


FORGET = """window.batchgpuChat.then(async (result) => {
  const removed = await window.batchgpuEngine.forget();
  const folder = await (await navigator.storage.getDirectory()).getDirectoryHandle("batchgpu-models");
  const left = [];
  for await (const name of folder.keys()) left.push(name);
  return { result, removed, left };
})"""


def test_second_load_reads_the_model_from_storage(browser: Chromium, app: tuple[Path, Path], greedy: Any) -> None:
    """Two loads of the page in one browser, same origin: the first downloads model.gguf (every byte once, its
    SHA-256 checked) into the origin private file system as the weights are built, in the worker; the second reads
    it from there and fetches no model byte (the server sends none, the page counts none). Both give Python's
    greedy ids, with no main-thread task over 50 ms while generating. The page's "forget" then removes the file.
    SwiftShader offers no shader-f16: the f32 kernels run, the self-test skipped saying why."""
    path, out = app
    size = path.stat().st_size
    log = ServeLog()
    query = ids_query(PROMPTS, max_tokens=8)
    with serve(out, log=log) as base:
        browser.clear_storage(base)  # an OS may hand a port out again
        first = page(browser, base, query)
        sent = log.sent(MODEL)
        later = page(browser, base, query, FORGET)
    second = later["result"]
    check_ids(first, greedy)
    check_ids(second, greedy)
    assert sent == size and log.sent(MODEL) == size and [r["status"] for r in log.of(MODEL)] == [200]
    assert first["worker"] and second["worker"]
    assert (first["loaded_from"], first["network_bytes"], first["storage_bytes"]) == ("network", size, 0)
    assert first["stored"] and first["storage"] == "opfs" and first["sha256_checked"]
    assert (second["loaded_from"], second["network_bytes"], second["storage_bytes"]) == ("cache", 0, size)
    assert second["stored"] and second["storage_message"] is None
    for result in (first, second):
        assert result["long_tasks"] == [], result["long_tasks"]  # the main thread stays free while generating
        assert not result["shader_f16"]
        assert result["self_test"] == "skipped: the adapter does not offer shader-f16", result["self_test"]
    assert later["removed"] == ["opfs"] and later["left"] == []


API = """window.batchgpuChat.then(async (first) => {
  const engine = window.batchgpuEngine;
  const messages = [{ role: "user", content: PROMPT }];
  const drawn = { messages, max_tokens: 10, temperature: 0.8, top_k: 20, seed: 5 };
  const whole = await engine.chat.completions.create(drawn);
  const usage = { stream: true, stream_options: { include_usage: true } };
  const stream = await engine.chat.completions.create({ ...drawn, ...usage });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  const stopped = await engine.chat.completions.create({ messages, max_tokens: 12, temperature: 0, stop: STOP });
  const plain = { prompt: PROMPT, max_tokens: 6, temperature: 0 };
  const completion = await engine.completions.create(plain);
  const pieces = [];
  const streamed = await engine.completions.create({ ...plain, stream: true });
  for await (const chunk of streamed) pieces.push(chunk.choices[0].text);
  const greedy = { messages, max_tokens: 4, temperature: 0 };
  const both = await Promise.all([1, 2].map(() => engine.chat.completions.create(greedy)));
  const errors = [];
  for (const body of BAD) {
    try {
      await engine.chat.completions.create(body);
      errors.push(null);
    } catch (error) {
      errors.push([error.param, error.message]);
    }
  }
  const contents = both.map((c) => c.choices[0].message.content);
  return { first, whole, chunks, stopped, completion, pieces, both: contents, errors };
})"""
BAD_BODIES = [
    ({"messages": []}, "messages", "messages must be a non-empty array"),
    ({"n": 2}, "n", "n and best_of must be 1"),
    ({"temperature": 3}, "temperature", "temperature must be a number in [0, 2], got 3"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
    ({"seed": -1}, "seed", "seed must be an integer in [0, 2**32)"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "stop must be a string or up to 4 strings"),
    ({"logprobs": True}, "logprobs", "logprobs is not supported here"),
]


def test_openai_shaped_api(browser: Chromium, app: tuple[Path, Path]) -> None:
    """``api=1``: the prompt goes through ``engine.chat.completions.create`` as the user message, and the page's
    text is Python's chat greedy text. Then in the page: a drawn reply streamed as chat.completion.chunk objects
    accumulates to the same reply not streamed (usage in a last chunk, as OpenAI's ``include_usage``); a stop string
    ends the text before it; ``completions.create`` gives Python's plain completion, streamed or not; two requests
    at once run in turn; bad requests are refused naming the field."""
    path, out = app
    codec = open_weights(path).codec()
    prompt = "Hello"
    chat_ids = codec.encode_chat([{"role": "user", "content": prompt}])
    expected = codec.decode(python_ids(path, chat_ids, 12, stop=codec.eos_ids, **STEPS))
    stop = expected[5:7]
    plain = codec.decode(python_ids(path, codec.encode(prompt, special=True), 6, stop=codec.eos_ids, **STEPS))
    bad = [{"messages": [{"role": "user", "content": prompt}], **body} for body, _, _ in BAD_BODIES]
    script = API.replace("PROMPT", json.dumps(prompt)).replace("STOP", json.dumps(stop)).replace("BAD", json.dumps(bad))
    with serve(out) as base:
        result = page(browser, base, f"api=1&prompt={quote(prompt)}&max_tokens=12", script)
    first = result["first"]
    assert "error" not in first, first["error"]
    assert first["api"] and first["text"] == expected and first["prompt_ids"] == chat_ids
    assert first["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 12
    assert first["usage"]["prompt_tokens"] == len(chat_ids) and first["usage"]["total_tokens"] == len(chat_ids) + 12
    assert first["long_tasks"] == []
    whole, chunks = result["whole"], result["chunks"]
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["role"] == "assistant"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] and text != expected  # drawn, not greedy
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    stopped = result["stopped"]["choices"][0]
    assert stopped["message"]["content"] == expected[: expected.index(stop)] and stopped["finish_reason"] == "stop"
    assert result["completion"]["object"] == "text_completion" and result["completion"]["choices"][0]["text"] == plain
    assert "".join(result["pieces"]) == plain
    assert result["both"] == [expected[: len(result["both"][0])]] * 2 and result["both"][0]
    for (body, param, message), error in zip(BAD_BODIES, result["errors"]):
        assert error is not None and error[0] == param and message in error[1], (body, error)


SPECULATIVE = """window.batchgpuChat.then(async (page) => {
  const engine = window.batchgpuEngine;
  const messages = [{ role: "user", content: PROMPT }];
  const reply = await engine.chat.completions.create({ messages, max_tokens: 12, temperature: 0, speculative: true });
  const stats = engine.stats;
  const plain = [];
  for await (const id of engine.generate(COPIED, { maxTokens: 16, reuse: false })) plain.push(id);
  const plainStats = engine.stats;
  const errors = [];
  for (const body of BAD) {
    try {
      await engine.chat.completions.create({ messages, max_tokens: 4, ...body });
      errors.push(null);
    } catch (error) {
      errors.push([error.param, error.message]);
    }
  }
  return { page, text: reply.choices[0].message.content, stats, plain, plainStats, errors };
})"""
COPIED = [22, 21] * 4
"""A prompt whose greedy reply (the tiny Qwen2's) copies it: 22, 21, 22, 21, ..."""
BAD_SPECULATIVE = [
    ({"speculative": True}, "greedy only: set temperature to 0 (got none: the default is 1)"),
    ({"speculative": True, "temperature": 0.7}, "greedy only: set temperature to 0 (got 0.7)"),
    ({"speculative": {"tokens": 5}, "temperature": 0}, "tokens must be an integer in [1, 4] (the export's verify"),
    ({"speculative": "yes", "temperature": 0}, "must be true or an object {tokens, min_ngram, max_ngram}"),
    ({"speculative": {"min_ngram": 3, "max_ngram": 2}, "temperature": 0}, "max_ngram must be an integer >= min_ngram"),
]


def test_speculative_decoding_in_the_page(browser: Chromium, app: tuple[Path, Path]) -> None:
    """``speculative=4``: each prompt's greedy ids by speculative decoding (prompt lookup, up to 4 drafted ids a
    step) in the page's worker are Python's ids without it, and the page's verify steps, drafted and accepted ids
    are those of Python's steps run the same way; on a prompt its reply copies, the page's ids are those of the same
    page without speculation in a third of the steps. ``chat.completions.create`` with ``speculative: true`` gives
    Python's greedy text. Bad ``speculative`` values, and speculation with temperature > 0 (the API's default is 1),
    are refused naming the field."""
    path, out = app
    device = bg.Device("reference")
    weights = open_weights(path)
    steps = ChatSteps(device, weights.config, upload_weights(device, weights, fuse=True), **STEPS)
    codec = weights.codec()
    prompt = "Hello"
    chat_ids = codec.encode_chat([{"role": "user", "content": prompt}])
    expected = codec.decode(list(steps.generate(chat_ids, 12, stop=codec.eos_ids)))
    bad = json.dumps([body for body, _ in BAD_SPECULATIVE])
    script = SPECULATIVE.replace("PROMPT", json.dumps(prompt)).replace("BAD", bad).replace("COPIED", str(COPIED))
    prompts = [*PROMPTS, COPIED]
    with serve(out) as base:
        result = page(browser, base, ids_query(prompts, max_tokens=16, speculative=4), script)
    assert "error" not in result["page"], result["page"]["error"]
    runs = result["page"]["runs"]
    assert [run["prompt_ids"] for run in runs] == prompts
    for run, ids in zip(runs, prompts):
        greedy = list(steps.generate(ids, 16))
        assert run["token_ids"] == greedy == list(steps.generate(ids, 16, speculative=Speculative("ngram", 4)))
        assert {key: run[key] for key in ("verify_steps", "drafted", "accepted")} == steps.speculation
    copied, plain = runs[-1], result["plainStats"]
    assert copied["token_ids"] == result["plain"] == (COPIED * 2)[:16]  # the reply copies the prompt
    assert (plain["verify_steps"], plain["generated"]) == (0, 16)  # without: 15 decode steps after the prompt
    assert copied["verify_steps"] <= 15 // 3 and copied["accepted"] == 15 - copied["verify_steps"]
    assert result["text"] == expected and result["stats"]["verify_steps"] > 0
    for (body, message), error in zip(BAD_SPECULATIVE, result["errors"]):
        assert error is not None and error[0] == "speculative" and message in error[1], (body, error)


def test_cut_download_resumes(browser: Chromium, app: tuple[Path, Path], greedy: Any) -> None:
    """A download cut off after a third of the file resumes in the same load with ``Range: bytes=N-`` (206) from
    the bytes in, and the file's SHA-256 still checks; one cut off where the page may not retry (``retries=0``,
    on the page's own thread: OPFS through a writable stream) fails saying the bytes in are kept, and the next load
    reads them from storage and downloads only the rest. Every load that finishes gives Python's ids."""
    path, out = app
    size = path.stat().st_size
    cut = size // 3
    log = ServeLog(cut={MODEL: cut})
    query = ids_query(PROMPTS, max_tokens=8)
    with serve(out, log=log) as base:
        browser.clear_storage(base)
        resumed = page(browser, base, query)
        browser.clear_storage(base)  # forget the model: the next load downloads it
        log.cut[MODEL] = 2 * cut
        failed = page(browser, base, f"{query}&worker=0&retries=0")
        again = page(browser, base, f"{query}&worker=0")
    requests = [(r["range"], r["status"], r["bytes"]) for r in log.of(MODEL)]
    check_ids(resumed, greedy)
    (first,) = resumed["resumed_at"]  # the bytes the page had read when the connection dropped (all, unless late)
    assert 0 < first <= cut and resumed["network_bytes"] == size and resumed["sha256_checked"] and resumed["stored"]
    kept = int(failed["error"].split("stopped at byte ")[1].split(" ")[0])
    assert 0 < kept <= 2 * cut and f"of {size} after 1 attempt(s)" in failed["error"], failed
    assert f"the {kept} bytes in are kept, so the next load resumes from there" in failed["error"]
    check_ids(again, greedy)
    assert not again["worker"] and again["loaded_from"] == "network" and again["sha256_checked"] and again["stored"]
    assert (again["storage_bytes"], again["network_bytes"], again["resumed_at"]) == (kept, size - kept, [kept])
    assert requests == [
        (None, 200, cut),  # cut off
        (f"bytes={first}-", 206, size - first),  # resumed in the same load
        (None, 200, 2 * cut),  # cut off, not retried
        (f"bytes={kept}-", 206, size - kept),  # the next load: the rest
    ]


def test_full_storage_streams_without_keeping(browser: Chromium, app: tuple[Path, Path], greedy: Any) -> None:
    """With a quota smaller than the model (DevTools' quota override), keeping it fails with QuotaExceededError:
    the load goes on from the network, says so, and keeps nothing."""
    path, out = app
    size = path.stat().st_size
    with serve(out) as base:
        browser.clear_storage(base)
        quota = [("Storage.overrideQuotaForOrigin", {"origin": base.rstrip("/"), "quotaSize": size // 2})]
        result = page(browser, base, ids_query(PROMPTS, max_tokens=8), commands=quota)
    check_ids(result, greedy)
    assert result["loaded_from"] == "network" and result["network_bytes"] == size
    assert not result["stored"] and result["storage"] is None
    assert (
        "QuotaExceededError" in result["storage_message"]
        and "next load downloads it again" in result["storage_message"]
    )


NO_OPFS = "delete StorageManager.prototype.getDirectory;"


def test_cache_api_where_opfs_is_missing(browser: Chromium, app: tuple[Path, Path], greedy: Any) -> None:
    """A page without the origin private file system (on its own thread) keeps the model in the Cache API instead:
    the second load reads it from there, fetching no model byte."""
    path, out = app
    size = path.stat().st_size
    log = ServeLog()
    query = f"{ids_query(PROMPTS, max_tokens=8)}&worker=0"
    with serve(out, log=log) as base:
        browser.clear_storage(base)
        first = page(browser, base, query, before=NO_OPFS)
        second = page(browser, base, query, before=NO_OPFS)
    for result in (first, second):
        check_ids(result, greedy)
        assert not result["worker"] and result["storage"] == "cache" and result["stored"]
    assert (first["loaded_from"], second["loaded_from"], second["network_bytes"]) == ("network", "cache", 0)
    assert log.sent(MODEL) == size


def test_self_test_machinery_under_node(tmp_path: Path, app: tuple[Path, Path]) -> None:
    """precision.js's self-test under Node (Dawn on SwiftShader: no shader-f16, so its f32 half): the f32 kernels
    give the export's values; with one expected value moved past the tolerance it fails, naming the case, the
    element and both values."""
    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    _, out = app
    test = json.loads((out / "model.json").read_text())["self_test"]
    raw = bytearray((out / test["expected"]["file"]).read_bytes())
    entry = test["expected"]["outputs"]["attention"]
    values = np.frombuffer(raw, np.float32, entry["bytes"] // 4, entry["offset"]).copy()
    values[3] += 1.0
    raw[entry["offset"] : entry["offset"] + entry["bytes"]] = values.tobytes()
    (out / "self_test" / "moved.bin").write_bytes(bytes(raw))
    args = {"steps": ["f32"], "expected": [None, "self_test/moved.bin"]}
    passed, failed = run_node(DRIVER, out, function="selfTest", args=args, timeout=300)
    assert passed["passed"] and passed["reason"] is None, passed
    assert [c["name"] for c in passed["cases"]] == test["cases"]
    assert all(c["max_error"] <= c["allowed"] for c in passed["cases"])
    assert not failed["passed"]
    assert failed["reason"].startswith("attention: the f32 kernels give ") and "at element 3" in failed["reason"]


def test_readme_engine_block_runs_under_node(app: tuple[Path, Path]) -> None:
    """The guide's engine block (docs/browser.md), run as written under Node in the export's folder (no Worker
    there: the engine runs on Node's thread; its file: URL is read from disk, not stored): the reply is Python's
    chat greedy text, and the stream of chunks accumulates to it."""
    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    path, out = app
    script = out / "readme_engine.mjs"
    script.write_text(named_block("chat_engine_js", "js"), encoding="utf-8")
    ran = subprocess.run(
        [find_node(), str(script)], cwd=out, env=node_environment(), capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    codec = open_weights(path).codec()
    ids = codec.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    reply = python_ids(path, ids, 16, stop=codec.eos_ids, **STEPS)
    assert result["text"] == result["streamed"] == codec.decode(reply)
    assert result["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(reply),
        "total_tokens": len(ids) + len(reply),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert result["worker"] is False
