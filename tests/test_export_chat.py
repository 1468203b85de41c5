"""``export_chat``: a GGUF model as a static WebGPU chat app, run in headless Chromium (SwiftShader's WebGPU on
machines without a GPU) and under Node (the ``webgpu`` npm package), against the same steps run in Python.

Contract: the page's greedy ids equal Python's (the recorded steps on the numpy reference device, and
``Llama.generate``); seeded draws equal Python's too unless two candidates' noisy logits lie within float error
of each other (WGSL's exp/log latitude), which random data makes vanishingly rare."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchgpu as bg
from batchgpu.arguments import linked_within, within
from batchgpu.errors import ArgumentError, BatchError
from batchgpu.export.browser import Chromium, serve
from batchgpu.export.chat import export_chat
from batchgpu.export.chat_steps import ChatSteps, Sampling, chunks
from batchgpu.export.node import NodeUnavailableError, find_node, node_environment, run_node, webgpu_package
from batchgpu.export.weight_sources import assemble
from batchgpu.models.gguf_reader import GGUFFile
from batchgpu.models.llama import Llama, open_weights, upload_weights
from batchgpu.models.speculative import Speculative, accepted, prompt_lookup

from .doc_blocks import named_block
from .test_llama_variants import K_DIMS, VARIANTS, random_weights, write_gguf

DRIVER = Path(__file__).with_name("chat_driver.mjs")
PROMPTS = [[3, 17, 42, 8, 29, 11, 5, 40, 23, 7, 1], [9], [30, 2, 44, 12, 6]]
"""Prompt ids: 11 tokens run as prefill chunks 4 + 4 + 2 + 1 (chunk 4), 1 token, 5 tokens (4 + 1)."""
TINY = {
    "llama-q8_0": ("llama", "Q8_0", {}),
    "qwen2-q4_0": ("qwen2", "Q4_0", {}),
    "qwen2-q4_1": ("qwen2", "Q4_1", {}),
    "qwen3-q6_k": ("qwen3", "Q6_K", K_DIMS),
}
"""Tiny models: llama.cpp's permuted q/k rows in q8_0 (blocks repacked for the device), q/k/v biases in q4_0 (also
repacked), q/k norms in q6_k (no joined q/k/v)."""


def tiny_model(folder: Path, name: str) -> Path:
    variant, qtype, dims = TINY[name]
    d = {**VARIANTS[variant], **dims}
    path = folder / f"{name}.gguf"
    write_gguf(path, variant, random_weights(d, 7), qtype, d=d)
    return path


def python_ids(
    path: Path, prompt: list[int], n: int, sampling: Sampling | None = None, stop: Any = (), **steps: int
) -> list[int]:
    """The ids the exported steps give in Python (the numpy reference device)."""
    device = bg.Device("reference")
    weights = open_weights(path)
    uploaded = upload_weights(device, weights, fuse=True)
    return list(ChatSteps(device, weights.config, uploaded, **steps).generate(prompt, n, sampling, stop))


def open_app(browser: Chromium, folder: Path, query: str, timeout: float = 300) -> dict[str, Any]:
    with serve(folder) as base:
        result = browser.evaluate(f"{base}index.html?{query}", "window.batchgpuChat", timeout)
    assert "error" not in result, result["error"]
    return result


def ids_query(prompts: list[list[int]], **settings: Any) -> str:
    return "&".join([*(f"ids={','.join(map(str, p))}" for p in prompts), *(f"{k}={v}" for k, v in settings.items())])


def test_chunks_cover_the_prompt_without_padding() -> None:
    assert chunks(11, 4) == [4, 4, 2, 1]
    assert chunks(64, 64) == [64] and chunks(1, 64) == [1] and chunks(37, 64) == [32, 4, 1]
    assert all(sum(chunks(n, 16)) == n for n in range(1, 100))


@pytest.mark.parametrize("name", sorted(TINY))
def test_every_weight_buffer_is_built_from_the_gguf_file(tmp_path: Path, name: str) -> None:
    """Weights (joined q/k/v and gate/up, unpermuted q/k, repacked blocks, row pieces under a lowered binding
    limit) all come from model.gguf, and the page's assembly of each equals the device's bytes."""
    path = tiny_model(tmp_path, name)
    kv_bytes = 16 * VARIANTS[TINY[name][0]]["kv_heads"] * {**VARIANTS[TINY[name][0]], **TINY[name][2]}["head_dim"] * 4
    limit = {"max_storage_buffer_binding_size": max(kv_bytes, 2048)}  # the embedding (at least) in row pieces
    out = export_chat(path, tmp_path / "app", max_context=16, chunk=1, limits=limit, speculative_tokens=1)
    manifest = json.loads((out / "model.json").read_text())
    weights = [b for b in manifest["buffers"] if b["kind"] == "resident" and not b["name"].startswith(("k", "v"))]
    weights = [b for b in weights if b["name"] != "token"]
    assert weights and all("source" in b for b in weights), [b["name"] for b in weights if "source" not in b]
    assert any("[" in b["name"] for b in weights)  # row pieces were made and sourced
    file = GGUFFile(out / "model.gguf")
    device = bg.Device("reference", limits=limit)
    uploaded = upload_weights(device, open_weights(path), fuse=True)
    by_name = {piece.name: piece for weight in uploaded.values() for piece in getattr(weight, "pieces", (weight,))}
    for entry in weights:
        stored = device.executor.read_resident(by_name[entry["name"]].storage).tobytes()[: entry["bytes"]]
        assert assemble(file.bytes, entry["source"]) == stored, entry["name"]


def test_steps_give_llamas_greedy_ids(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "llama-q8_0")
    llama = Llama(bg.Device("reference"), path, max_context=32)
    for prompt in PROMPTS:
        assert python_ids(path, prompt, 8, max_context=32, chunk=4) == list(llama.generate(prompt, 8))


BAD_REQUESTS = [
    ([3, 50, 7], {}, "token id 50 is not in [0, 50)"),
    ([3, -1], {}, "token id -1"),
    ([3] * 24, {}, "the prompt needs 1 to 23 tokens, got 24"),
    ([], {}, "the prompt needs 1 to 23 tokens, got 0"),
    ([3], {"maxTokens": 0}, "maxTokens out of range"),
    ([3], {"temperature": -1}, "temperature out of range"),
    ([3], {"topP": 0}, "topP out of range"),
    ([3], {"topK": 1.5}, "topK out of range"),
    ([3], {"seed": 2**32}, "seed out of range"),
    ([3], {"reuse": 1}, "reuse out of range"),
]
SEEDED = {"maxTokens": 10, "temperature": 0.9, "topK": 20, "seed": 5}

PAGE_SCRIPT = """window.batchgpuChat.then(async (greedy) => {
  const model = window.batchgpuModel;
  const run = async (ids, options) => {
    const out = [];
    for await (const id of model.generate(ids, options)) out.push(id);
    return out;
  };
  const errors = [];
  for (const [ids, options] of BAD) {
    try { await run(ids, options); errors.push(null); } catch (error) { errors.push(String(error.message)); }
  }
  const held = model.generate(PROMPT, { maxTokens: 3 });
  await held.next();
  let busy = null;
  try { await model.generate([3]).next(); } catch (error) { busy = String(error.message); }
  await held.return();
  const drawn = [await run(PROMPT, SEEDED), await run(PROMPT, SEEDED)];
  const long = await run(PROMPT, { maxTokens: 50 });
  return { greedy, errors, busy, drawn, long };
})"""
"""What the browser test runs in the page after the URL's runs: bad requests, a seed twice, a run to the context."""


def test_browser_generates_pythons_ids(tmp_path: Path, browser: Chromium) -> None:
    """One page load (each compiles the pipelines again: seconds on SwiftShader): greedy runs of three prompts
    from the URL (prefill chunks 4 + 4 + 2 + 1, 1, 4 + 1); then through ``window.batchgpuModel``: bad requests,
    each refused naming what is wrong before any step runs; a second generation while one runs, refused; a seed
    drawing the same ids twice; a run that stops at the context. Every id equals Python's."""
    path = tiny_model(tmp_path, "llama-q8_0")
    out = export_chat(path, tmp_path / "app", max_context=24, chunk=4, gpu_kernels=False)
    bad = json.dumps([[ids, options] for ids, options, _ in BAD_REQUESTS])
    script = PAGE_SCRIPT.replace("BAD", bad).replace("PROMPT", str(PROMPTS[0])).replace("SEEDED", json.dumps(SEEDED))
    with serve(out) as base:
        result = browser.evaluate(f"{base}index.html?{ids_query(PROMPTS, max_tokens=10)}", script, 300)
    greedy = result["greedy"]
    assert "error" not in greedy, greedy["error"]
    assert greedy["adapter"] and greedy["tokens_per_s"] > 0
    steps = {"max_context": 24, "chunk": 4}
    for run, prompt in zip(greedy["runs"], PROMPTS):
        assert run["prompt_ids"] == prompt
        assert run["token_ids"] == python_ids(path, prompt, 10, **steps)
    for (ids, options, message), error in zip(BAD_REQUESTS, result["errors"]):
        assert error is not None and message in error, (ids, options, error)
    assert "the model is generating already" in result["busy"]  # one sequence: one KV cache
    sampling = Sampling(temperature=0.9, top_k=20, seed=5)
    expected = python_ids(path, PROMPTS[0], 10, sampling, **steps)
    assert result["drawn"] == [expected, expected]
    assert expected != greedy["runs"][0]["token_ids"]
    assert len(result["long"]) == 24 - len(PROMPTS[0]) + 1  # the last token needs no position of its own
    assert result["long"] == python_ids(path, PROMPTS[0], 50, **steps)


def test_page_says_what_it_needs(tmp_path: Path, browser: Chromium) -> None:
    """Opened from a file: URL, the page says to serve the folder; in a browser without WebGPU, says that; with
    a model file other than the exported one, says that."""
    path = tiny_model(tmp_path, "llama-q8_0")
    out = export_chat(path, tmp_path / "app", max_context=16, chunk=4)
    result = browser.evaluate((out / "index.html").as_uri() + "?ids=3", "window.batchgpuChat", 60)
    assert "python -m http.server" in result["error"]
    no_webgpu = "Object.defineProperty(Navigator.prototype, 'gpu', { get: () => undefined });"
    with serve(out) as base:
        result = browser.evaluate(f"{base}index.html?ids=3", "window.batchgpuChat", 60, before=no_webgpu)
    assert "This browser has no WebGPU" in result["error"]
    model = out / "model.gguf"
    model.write_bytes(model.read_bytes()[:-64])  # another file than the one exported
    with serve(out) as base:
        result = browser.evaluate(f"{base}index.html?ids=3", "window.batchgpuChat", 120)
    assert f"the export was made from a file of {path.stat().st_size} bytes" in result["error"]


def test_node_generates_pythons_ids(tmp_path: Path) -> None:
    """The same module under Node: q/k/v biases joined, and the embedding and the head as row pieces (a lowered
    binding limit), built from the file by the page's code, the single-range ones written 60 bytes (three q4_1
    blocks) at a time."""
    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    path = tiny_model(tmp_path, "qwen2-q4_1")
    limits = {"max_storage_buffer_binding_size": 2048}  # activations of 2 rows fit: chunk 1, verify steps of 2 rows
    out = export_chat(
        path, tmp_path / "app", max_context=16, chunk=1, gpu_kernels=False, limits=limits, speculative_tokens=1
    )
    assert any("[" in b["name"] for b in json.loads((out / "model.json").read_text())["buffers"])  # pieces
    args = {"prompts": PROMPTS, "maxTokens": 4, "slabBytes": 64}
    result = run_node(DRIVER, out, function="generate", args=args, timeout=300)
    for run, prompt in zip(result["runs"], PROMPTS):
        assert run["token_ids"] == python_ids(path, prompt, 4, max_context=16, chunk=1)
    assert result["loading"]["file_bytes"] == path.stat().st_size
    check_readme_block(path, export_chat(path, tmp_path / "readme", max_context=64, chunk=16, gpu_kernels=False))


COPY = [3, 17, 42, 8, 29, 11, 5, 3, 17, 42, 8, 29, 11, 5, 3, 17]
"""A prompt that repeats itself: prompt lookup drafts from its first copy."""
NGRAM = Speculative("ngram", 4)


def test_verify_steps_give_llamas_ids(tmp_path: Path) -> None:
    """A verify step (every row's greedy id) gives the ids of Llama's verify step of the same rows at the same
    position; ChatSteps' speculative generation (the page's algorithm: prompt lookup, the accepted prefix and one
    more) gives Llama.speculate's ids and counts, which are greedy decoding's ids, with drafts accepted. Greedy only,
    up to the verify steps recorded, prompt lookup only: else refused."""
    path = tiny_model(tmp_path, "llama-q8_0")
    device = bg.Device("reference")
    weights = open_weights(path)
    steps = ChatSteps(device, weights.config, upload_weights(device, weights, fuse=True), max_context=32, chunk=4)
    llama = Llama(bg.Device("reference"), path, max_context=32)
    rows = [7, 12, 3, 40, 9]
    list(steps.generate(PROMPTS[0], 1))  # the prompt's rows, in both caches
    llama.prefill(PROMPTS[0])
    step = steps.steps["verify_5"]
    ours = steps._run(step, len(PROMPTS[0]), {"ids": np.asarray(rows, np.int32)}).read(step.next_id)
    theirs, next_tokens = llama._submit_prefill(rows, every_row=True)
    assert ours.tolist() == theirs.read(next_tokens).tolist()
    for prompt in (PROMPTS[0], COPY):
        plain = list(steps.generate(prompt, 12))
        assert list(steps.generate(prompt, 12, speculative=NGRAM)) == plain == list(llama.generate(prompt, 12))
        assert list(llama.generate(prompt, 12, speculative=NGRAM)) == plain
        assert steps.speculation == llama.speculation and steps.speculation["accepted"] > 0, steps.speculation
        assert 1 + steps.speculation["verify_steps"] + steps.speculation["accepted"] == len(plain)
    for speculative, sampling, message in [
        (NGRAM, Sampling(temperature=0.5), "greedy only"),
        (Speculative("ngram", 5), None, "speculative tokens must be at most 4"),
        (Speculative("draft", 2, draft="draft.gguf"), None, "must be Speculative"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            list(steps.generate(PROMPTS[0], 4, sampling, speculative=speculative))
    with pytest.raises(ArgumentError, match=r"speculative_tokens must be an int in \[0, 31\]"):
        ChatSteps(device, weights.config, steps.weights, max_context=32, chunk=4, speculative_tokens=32)


def test_speculative_decoding_under_node(tmp_path: Path) -> None:
    """The page's speculative decoding (``generate(ids, {speculative})``) under Node on a tiny model whose replies
    repeat themselves: every turn's ids are greedy decoding's (Python's steps without speculation), in fewer steps
    than tokens, drafts accepted, and its verify steps, drafted and accepted ids are Python's (the same rules:
    batchgpu.js's prompt lookup and acceptance also give Python's on random cases). Across turns the KV cache keeps
    only the rows of ids it holds (never a rejected draft's): a turn extending the last one, one without
    speculation, fewer drafted tokens, one that runs to the end of the context, one stopped mid-way and the next
    one continuing it. Refused: speculation with temperature > 0, past the export's verify steps, an unknown
    field."""
    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    rng = np.random.default_rng(42)
    lookups = []
    for _ in range(300):
        low, high, limit = map(int, rng.integers(1, 4, 3))
        lookups.append([rng.integers(0, 4, rng.integers(0, 30)).tolist(), limit - 1, low, low + high - 1])
    lookups += [  # no ids, one, a match only of fewer than min_ngram, past the end, the latest match, long n-grams
        [[], 4, 2, 4],
        [[7], 4, 1, 1],
        [[7, 7], 4, 1, 4],
        [[1, 2, 3, 1], 4, 2, 4],
        [[1, 2, 3, 1, 2], 9, 2, 4],
        [[1, 2, 9, 1, 2, 8, 1, 2], 3, 2, 4],
        [[5, 6, 7, 8, 5, 6, 7, 8], 2, 4, 4],
        [[5, 6, 7, 8, 5, 6, 7, 8], 2, 5, 9],
        [[1, 2, 3, 1, 2, 3], 0, 1, 3],
        [[3, 1, 2, 3, 4, 1, 2, 3], 2, 1, 3],
    ]
    verdicts = [[rng.integers(0, 3, n).tolist(), rng.integers(0, 3, n + 1).tolist()] for n in range(6) for _ in "ab"]
    verdicts += [[[], [4]], [[1, 2, 3], [1, 2, 3, 4]], [[1, 2, 3], [0, 2, 3, 4]], [[1, 2, 3], [1, 2, 0, 4]]]
    app = Path(str(resources.files("batchgpu.export") / "app"))
    result = run_node(DRIVER, app, function="speculation", args={"lookups": lookups, "verdicts": verdicts})
    assert result["drafts"] == [prompt_lookup(*case) for case in lookups]
    assert result["kept"] == [accepted(*case) for case in verdicts]

    path = tiny_model(tmp_path, "llama-q8_0")
    steps = {"max_context": 48, "chunk": 4}
    out = export_chat(path, tmp_path / "app", gpu_kernels=False, **steps)  # verify steps for up to 4 drafted ids
    device = bg.Device("reference")
    weights = open_weights(path)
    python = ChatSteps(device, weights.config, upload_weights(device, weights, fuse=True), **steps)
    first, stopped = list(python.generate(PROMPTS[0], 24)), list(python.generate(COPY, 24))
    near_end = [*COPY, *COPY, 1, 2, 3, 4, 5, 6, 7, 8]  # 40 ids: 9 more reach the context's 48
    two = Speculative("ngram", 2, min_ngram=1)
    turns = [  # (the page's turn, the settings of Python's speculative run)
        ({"ids": PROMPTS[0], "options": {"maxTokens": 24, "speculative": {"tokens": 4}}}, NGRAM),
        ({"ids": [*PROMPTS[0], *first, 21, 4, 33], "options": {"maxTokens": 12, "speculative": True}}, NGRAM),
        ({"ids": PROMPTS[0], "options": {"maxTokens": 24, "reuse": False}}, None),
        ({"ids": COPY, "options": {"maxTokens": 24, "speculative": {"tokens": 2, "minNgram": 1}}}, two),
        ({"ids": near_end, "options": {"maxTokens": 50, "speculative": True}}, NGRAM),  # to the context's end
        ({"ids": COPY, "options": {"maxTokens": 24, "speculative": True}, "abortAfter": 5}, NGRAM),
        ({"ids": [*COPY, *stopped[:5], 9, 30], "options": {"maxTokens": 8, "speculative": True}}, NGRAM),
    ]
    refused = [{"speculative": True, "temperature": 0.5}, {"speculative": {"tokens": 5}}, {"speculative": {"ngram": 3}}]
    args = {"turns": [turn for turn, _ in turns] + [{"ids": [3], "options": options} for options in refused]}
    runs = run_node(DRIVER, out, function="converse", args=args, timeout=300)["runs"]
    for n, ((turn, speculative), run) in enumerate(zip(turns, runs), 1):
        ids = list(python.generate(turn["ids"], turn["options"]["maxTokens"]))  # greedy, without speculation
        assert run["error"] is None and run["token_ids"] == ids[: turn.get("abortAfter", len(ids))], n
        assert run["cached_ids"] == [*turn["ids"], *ids][: len(run["cached_ids"])], n  # no rejected draft's row
        figures = {key: run["stats"][key] for key in ("verify_steps", "drafted", "accepted")}
        if speculative is None:
            assert figures == {"verify_steps": 0, "drafted": 0, "accepted": 0}
        elif "abortAfter" not in turn:
            assert list(python.generate(turn["ids"], turn["options"]["maxTokens"], speculative=speculative)) == ids
            assert figures == python.speculation, n
    assert runs[0]["stats"]["accepted"] > 0 and runs[0]["stats"]["verify_steps"] < len(runs[0]["token_ids"]) == 24
    assert runs[0]["cached_ids"] == [*PROMPTS[0], *first[:-1]]  # as without speculation: the last id has no row
    assert runs[1]["stats"]["cached_tokens"] == len(PROMPTS[0]) + 24 - 1
    assert len(runs[4]["token_ids"]) == 48 - len(near_end) + 1
    assert runs[6]["stats"]["cached_tokens"] >= len(COPY) + 4  # the stopped reply's rows were kept
    assert "greedy only: it needs temperature 0, got temperature 0.5" in runs[7]["error"]
    assert "tokens must be an integer in [1, 4] (the export's verify steps), got 5" in runs[8]["error"]
    assert "speculative has no field ngram" in runs[9]["error"]


def test_export_without_verify_steps_refuses_speculation(tmp_path: Path) -> None:
    """``export-chat --speculative-tokens 0`` exports no verify step, and its app refuses speculative decoding
    naming it: ``generate(ids, {speculative})`` and the engine's requests with ``speculative`` (the error's param);
    the same requests without it run, and give Python's greedy ids."""
    from batchgpu import cli

    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    path = tiny_model(tmp_path, "llama-q8_0")
    out = tmp_path / "app"
    shape = ["--max-context", "32", "--chunk", "4"]
    args = ["export-chat", str(out), "--model", str(path), *shape, "--cpu-kernels", "--no-f16"]
    assert cli.main([*args, "--speculative-tokens", "0"]) == 0
    assert not [name for name in json.loads((out / "model.json").read_text())["steps"] if "verify" in name]
    speculative = {"max_tokens": 4, "temperature": 0, "speculative": True}
    requests = [
        {"ids": PROMPTS[0], "options": {"maxTokens": 6, "speculative": True}},
        {"ids": PROMPTS[0], "options": {"maxTokens": 6, "speculative": {"tokens": 1}}},
        {"body": {"prompt": "abc", **speculative}},
        {"body": {"prompt": "abc", **speculative, "speculative": {"tokens": 1}}},
        {"ids": PROMPTS[0], "options": {"maxTokens": 6}},
        {"body": {"prompt": "abc", "max_tokens": 4, "temperature": 0, "speculative": False}},
    ]
    result = run_node(DRIVER, out, function="engineRequests", args={"requests": requests}, timeout=300)
    runs = result["results"]
    assert result["info"]["speculative_tokens"] == 0
    for run in runs[:2]:
        assert run["error"][1].startswith("batchgpu: speculative decoding needs verify steps"), run
        assert "--speculative-tokens 0" in run["error"][1]
    for run in runs[2:4]:
        assert run["error"][0] == "speculative" and "--speculative-tokens 0" in run["error"][1], run
    assert runs[4]["error"] is None and runs[4]["token_ids"] == python_ids(path, PROMPTS[0], 6, max_context=32, chunk=4)
    assert runs[4]["stats"]["verify_steps"] == 0
    assert runs[5]["error"] is None and runs[5]["stats"]["verify_steps"] == 0


GEMMA_PROMPT = [3, 17, 42, 8, 29, 11, 5, 23, 40]
DRAWN = {"temperature": 0.9, "topK": 20, "seed": 5}


def conversation(first: list[int], replies: dict[int, list[int]]) -> list[dict[str, Any]]:
    """The turns of test_turns_reuse_the_kv_cache: ``replies[n]`` holds turn n's ids, known after a first run."""
    t1, t2, t3 = (replies.get(n, []) for n in (1, 2, 3))
    ids2 = [*first, *t1, 21, 4, 33]
    ids3 = [*ids2, *t2, 7, 12]
    edited = [*first[:4], 44, *first[5:]]
    after_abort = [*ids3, *t3[:2], 9, 30]
    return [
        {"ids": first, "options": {"maxTokens": 5}},  # 1: nothing cached
        {"ids": ids2, "options": {"maxTokens": 5}},  # 2: turn 1's prompt and reply, then new ids
        {"ids": ids3, "options": {"maxTokens": 6, **DRAWN}},  # 3: drawn
        {"ids": edited, "options": {"maxTokens": 4}},  # 4: an earlier message edited: diverges at 4
        {"ids": edited, "options": {"maxTokens": 1}},  # 5: the cache then holds exactly these ids
        {"ids": edited, "options": {"maxTokens": 4}},  # 6: the same ids again: the last one runs again
        {"ids": ids2, "options": {"maxTokens": 5, "reuse": False}},  # 7: reuse off
        {"ids": ids3, "options": {"maxTokens": 6, "ahead": 3, **DRAWN}, "abortAfter": 2},  # 8: stopped
        {"ids": after_abort, "options": {"maxTokens": 5}},  # 9: continues the stopped reply
        {"ids": ids2, "options": {"maxTokens": 5}, "failAfter": 2},  # 10: an error mid-way
        {"ids": after_abort, "options": {"maxTokens": 5}},  # 11: the cache forgotten
    ]


def test_turns_reuse_the_kv_cache(tmp_path: Path) -> None:
    """A conversation under Node on tiny Gemma 3 (a 3-position sliding window in six of seven layers; prefill
    chunks of 4): each turn prefills only the ids after its common prefix with the ids the cache holds (the
    last prompt and the tokens fed back, not the last one read), and every turn's ids equal Python's steps
    run on the whole prompt from position 0, greedy and drawn. The rows kept are the keys and values of the
    same ids at the same positions (a row depends only on the ids up to it), and a step reads rows up to its
    own only, so the kept rows and the rewritten ones give what a fresh run gives: the existing contract of
    the page's ids against Python's holds as it is. An edited earlier message recomputes from the edit; the
    same ids again rerun their last; reuse off, a stopped reply (steps in flight past it) and an error mid-way
    (the cache forgotten) each leave ids equal to Python's."""
    from .test_gemma3 import TINY as GEMMA3
    from .test_gemma3 import random_gemma3, write_gemma3

    try:
        webgpu_package()
    except NodeUnavailableError as exc:
        pytest.skip(f"WebGPU under Node is unavailable: {exc}")
    path = tmp_path / "gemma3.gguf"
    write_gemma3(path, random_gemma3(GEMMA3, 30), qtype="Q8_0")
    steps = {"max_context": 48, "chunk": 4}
    out = export_chat(path, tmp_path / "app", gpu_kernels=False, **steps)
    device = bg.Device("reference")
    weights = open_weights(path)
    python = ChatSteps(device, weights.config, upload_weights(device, weights, fuse=True), **steps)

    def expected(turn: dict[str, Any]) -> list[int]:
        options = turn["options"]
        sampling = Sampling(temperature=0.9, top_k=20, seed=5) if "seed" in options else None  # DRAWN
        ids = list(python.generate(turn["ids"], options["maxTokens"], sampling))
        return ids[: turn.get("abortAfter") or turn.get("failAfter") or len(ids)]

    replies: dict[int, list[int]] = {}
    for n in (1, 2, 3):  # each turn's prompt holds the replies before it
        replies[n] = expected(conversation(GEMMA_PROMPT, replies)[n - 1])
    turns = conversation(GEMMA_PROMPT, replies)
    runs = run_node(DRIVER, out, function="converse", args={"turns": turns}, timeout=300)["runs"]
    for n, (turn, run) in enumerate(zip(turns, runs), 1):
        assert run["token_ids"] == expected(turn), n
    cached = [run["stats"]["cached_tokens"] for run in runs]
    computed = [run["stats"]["prefill_tokens"] for run in runs]
    assert cached == [0, 9 + 4, 17 + 4, 4, 8, 8, 0, 17 + 4, 24 + 1, 17 - 1, 0], cached
    assert [c + p for c, p in zip(cached, computed)] == [len(turn["ids"]) for turn in turns]
    assert runs[0]["cached_ids"] == GEMMA_PROMPT + replies[1][:-1]  # the last id read is not in the cache
    assert runs[4]["cached_ids"] == turns[4]["ids"]
    assert runs[7]["cached_ids"] == turns[7]["ids"] + replies[3][:1]  # steps in flight: only rows read count
    assert runs[9]["error"] == "signal failed" and runs[9]["cached_ids"] == []
    assert all(run["error"] is None for n, run in enumerate(runs) if n != 9)


def check_readme_block(path: Path, out: Path) -> None:
    """The guide's JavaScript block (docs/browser.md), run as written under Node in the export's folder, prints
    Python's reply."""
    script = out / "readme_chat.mjs"
    script.write_text(named_block("chat_js", "js"), encoding="utf-8")
    ran = subprocess.run(
        [find_node(), str(script)], cwd=out, env=node_environment(), capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    codec = open_weights(path).codec()
    ids = codec.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    reply = python_ids(path, ids, 16, stop=codec.eos_ids, max_context=64, chunk=16)
    text, rate = ran.stdout.strip().rsplit(" ", 1)
    assert text == codec.decode(reply) and float(rate) >= 0


def test_export_refuses_bad_arguments_before_writing(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "llama-q8_0")
    out = tmp_path / "app"
    for kwargs, error, message in [
        ({"chunk": 3}, ArgumentError, "chunk must be a power of two"),
        ({"chunk": 64, "max_context": 32}, ArgumentError, "chunk must be a power of two <= max_context=32"),
        ({"max_context": 0}, ArgumentError, "max_context must be an int >= 1"),
        ({"max_context": 65}, ArgumentError, "max_context must be <= 64"),
        ({"limits": {"max_buffer_size": 2**40}}, ArgumentError, "may only lower"),
    ]:
        with pytest.raises(error, match=message):
            export_chat(path, out, **kwargs)
        assert not out.exists()
    with pytest.raises(ArgumentError, match="is not a file"):
        export_chat(tmp_path / "missing.gguf", out)
    with pytest.raises(BatchError):
        export_chat(write_safetensors_dir(tmp_path), out)
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(BatchError, match="not empty"):
        export_chat(path, out)


def test_export_never_deletes_or_overwrites_its_own_model(tmp_path: Path) -> None:
    """A model the export would reach (inside the output folder, through a symbolic link either way, or a hard
    link of a file there) is refused before anything is written; the earlier export stays as it was."""
    model = tiny_model(tmp_path, "llama-q8_0")
    out = export_chat(model, tmp_path / "app", max_context=16, chunk=4, gpu_kernels=False)
    earlier = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    os.link(out / "model.gguf", tmp_path / "hard.gguf")
    (tmp_path / "soft.gguf").symlink_to(out / "model.gguf")
    (tmp_path / "alias").symlink_to(out, target_is_directory=True)
    for source, target, message in [
        (out / "model.gguf", out, "lies in the output folder"),
        (tmp_path / "soft.gguf", out, "lies in the output folder"),
        (out / "model.gguf", tmp_path / "alias", "lies in the output folder"),
        (tmp_path / "alias" / "model.gguf", out, "lies in the output folder"),
        (model, tmp_path, "lies in the output folder"),  # the model's own folder
        (tmp_path / "hard.gguf", out, "is the same file as"),
    ]:
        for copy_model in (True, False):
            with pytest.raises(ArgumentError, match=message):
                export_chat(source, target, max_context=16, chunk=4, copy_model=copy_model)
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == earlier


def test_export_over_an_earlier_export_replaces_its_model_by_rename(tmp_path: Path) -> None:
    model = tiny_model(tmp_path, "llama-q8_0")
    out = export_chat(model, tmp_path / "app", max_context=16, chunk=4, gpu_kernels=False)
    for copy_model in (True, False):
        export_chat(model, out, max_context=8, chunk=2, gpu_kernels=False, copy_model=copy_model)
        assert (out / "model.gguf").read_bytes() == model.read_bytes() and not list(out.glob("*.partial"))
    assert os.path.samefile(out / "model.gguf", model)  # the last export linked it


def test_within_and_linked_within(tmp_path: Path) -> None:
    folder, outside = tmp_path / "folder", tmp_path / "model.gguf"
    (folder / "sub").mkdir(parents=True)
    outside.write_bytes(b"GGUF")
    assert within(outside, folder) is None and linked_within(outside, folder) is None
    os.link(outside, folder / "sub" / "copy.gguf")
    assert linked_within(outside, folder) == folder / "sub" / "copy.gguf"
    assert within(folder / "sub" / "copy.gguf", folder) == folder / "sub" / "copy.gguf"
    (tmp_path / "alias").symlink_to(folder, target_is_directory=True)
    assert within(folder / "sub" / "copy.gguf", tmp_path / "alias") == tmp_path / "alias" / "sub" / "copy.gguf"
    assert within(tmp_path / "missing", folder) is None and linked_within(tmp_path / "missing", folder) is None


def write_safetensors_dir(tmp_path: Path) -> Path:
    """A path that is a file but not GGUF."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return path


CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]


@pytest.mark.slow
@pytest.mark.model
def test_smollm2_chats_in_the_browser_as_in_python(tmp_path: Path, browser: Chromium) -> None:
    """SmolLM2-135M-Instruct (Q4_1) exported and chatted with in the page: three prompts through the chat template
    in JavaScript give Python's prompt ids, and 16 greedy ids (or fewer, ending at the end token) equal
    ``Llama.generate``'s on the numpy reference device; the text streamed into the page is Python's decode."""
    from urllib.parse import quote

    from batchgpu.models.llama import smollm2_path

    try:
        path = smollm2_path()
    except BatchError as exc:
        pytest.skip(str(exc))
    out = export_chat(path, tmp_path / "app", max_context=128, chunk=32, gpu_kernels=False, copy_model=False)
    query = "&".join(f"prompt={quote(p)}" for p in CHAT_PROMPTS) + "&max_tokens=16"
    result = open_app(browser, out, query, timeout=900)
    codec = open_weights(path).codec()
    llama = Llama(bg.Device("reference"), path, max_context=128)
    for run, prompt in zip(result["runs"], CHAT_PROMPTS):
        ids = codec.encode_chat([{"role": "user", "content": prompt}])
        assert run["prompt_ids"] == ids
        expected = list(llama.generate(ids, 16, stop=codec.eos_ids))
        assert run["token_ids"] == expected
        assert run["text"] == codec.decode(expected)
    assert result["runs"][0]["text"] == "The capital of France is Paris."


@pytest.mark.model
def test_smollm2_turns_extend_the_last_prompt_and_reply() -> None:
    """SmolLM2's chat template renders earlier turns as they were: a turn's prompt ids begin with the last
    prompt's and the reply's (then the end token the model stopped at), so the page's cache covers them."""
    from batchgpu.models.llama import smollm2_path

    try:
        codec = open_weights(smollm2_path()).codec()
    except BatchError as exc:
        pytest.skip(str(exc))
    question = {"role": "user", "content": CHAT_PROMPTS[0]}
    answer = "The capital of France is Paris."
    first = codec.encode_chat([question])
    reply_turn = {"role": "assistant", "content": answer}
    second = codec.encode_chat([question, reply_turn, {"role": "user", "content": "Why?"}])
    reply = [*codec.encode(answer, special=False), *sorted(codec.eos_ids)]
    assert second[: len(first) + len(reply)] == first + reply


def test_command_line_exports_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from batchgpu import cli

    path = tiny_model(tmp_path, "llama-q8_0")
    out = tmp_path / "app"
    assert cli.main(["export-chat", str(out), "--model", str(path), "--chunk", "3"]) == 2
    assert "chunk must be a power of two" in capsys.readouterr().err and not out.exists()
    args = ["export-chat", str(out), "--model", str(path), "--max-context", "32", "--chunk", "8", "--link"]
    assert cli.main(args) == 0
    assert "python -m http.server" in capsys.readouterr().out
    manifest = json.loads((out / "model.json").read_text())
    steps = ["decode", "prefill_1", "prefill_2", "prefill_4", "prefill_8", *(f"verify_{n}" for n in range(2, 6))]
    assert manifest["model"]["max_context"] == 32 and sorted(manifest["steps"]) == steps
    assert manifest["model"]["speculative_tokens"] == 4 and sorted(manifest["variants"]["f16"]["steps"]) == steps
    verify = manifest["steps"]["verify_5"]
    assert verify["tokens"] == 5 and list(verify["inputs"]) == ["ids"] and verify["inputs"]["ids"]["shape"] == [5]
    assert verify["outputs"]["next_ids"]["bytes"] == 5 * 4
    assert (out / "model.gguf").read_bytes() == path.read_bytes() and (out / "vendor" / "jinja.js").is_file()
    assert (out / "vendor" / "noble-hashes" / "sha2.js").is_file() and (out / "worker.js").is_file()
    assert manifest["weights"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["variants"]["f16"]["features"] == ["shader-f16"] and (out / "self_test" / "expected.bin").is_file()
    (out / "model.gguf").unlink()  # the model's hard link: an export over it is refused (it would be the model)
    assert cli.main([*args, "--no-f16", "--speculative-tokens", "0"]) == 0  # again over it: no f16, no verify steps
    manifest = json.loads((out / "model.json").read_text())
    assert "variants" not in manifest and "self_test" not in manifest and not (out / "f16").exists()
    assert manifest["model"]["speculative_tokens"] == 0 and not [n for n in manifest["steps"] if "verify" in n]
    assert cli.main([*args, "--speculative-tokens", "32"]) == 2  # 33 rows past the context
    assert "--speculative-tokens must be less than --max-context (32)" in capsys.readouterr().err
