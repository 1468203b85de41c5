"""benchmarks/browser_chat.py end to end on a tiny GGUF file: batchgpu's exported page and wllama (llama.cpp
compiled to WebAssembly) in one headless Chromium, with the table's shape and both sides' ids checked; plus
the pieces it stands on (serve's optional headers, the npm fetch's refusal without npm).

The tiny model is tiny-qwen2 (its own head and q/k/v biases; see tests/test_benchmarks_real_sizes.py for why
not tiny-llama) with the tiny SentencePiece vocabulary (llama.cpp refuses a byte-level one without merges), in
float32, so llama.cpp multiplies float32 weights as batchgpu does; its KV cache holds
float16 (llama.cpp's default), about 1e-3 relative. The ids must agree where the float64 numpy model's
top-2 logit gap at every step is over 2% of the largest logit, which the prompt here is checked to give:
far beyond both sides' rounding, so agreement holds on any WebGPU driver."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np
import pytest

from batchgpu.errors import ArgumentError, ModelFileError
from batchgpu.export.browser import CROSS_ORIGIN_ISOLATION, find_chromium, serve

from .conftest import load_script
from .test_llama_variants import VARIANTS, float64_logits, random_weights, tiny_sizes, write_tiny_gguf

pytest.importorskip("gguf", reason="the tiny model is written with the gguf package")

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [3, 17, 42, 8, 29, 11, 5]
TOKENS = 5
MARGIN = 0.02
"""The float64 model's smallest top-2 gap over the steps, as a fraction of the largest logit."""


def browser_chat():
    """benchmarks/browser_chat.py as a module."""
    return load_script("benchmarks/browser_chat.py", "browser_chat_benchmark")


@pytest.fixture(scope="module")
def wllama() -> Path:
    """The wllama package (fetched with npm into the user's cache on first use); skips without Chromium or npm."""
    if find_chromium() is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): the browser tests need it")
    module = browser_chat()
    try:
        return module.wllama_package()
    except module.WllamaUnavailable as missing:
        pytest.skip(f"wllama could not be fetched from npm: {missing}")


def greedy_with_gaps(d: dict, weights: dict[str, np.ndarray], prompt: list[int], n: int) -> tuple[list[int], float]:
    """The float64 model's greedy ids and its smallest top-2 gap over the steps (relative to max |logit|)."""
    ids, out, gap = list(prompt), [], np.inf
    for _ in range(n):
        logits = float64_logits(d, weights, ids)
        top = np.sort(logits)[-2:]
        gap = min(gap, (top[1] - top[0]) / np.abs(logits).max())
        out.append(int(np.argmax(logits)))
        ids.append(out[-1])
    return out, gap


def test_tiny_model_on_batchgpus_page_and_wllama(tmp_path, wllama):
    module = browser_chat()
    d = VARIANTS["qwen2"]
    path = tmp_path / "tiny-qwen2.gguf"
    sizes = {**tiny_sizes(d), "rope.dimension_count": d["head_dim"]}
    meant = write_tiny_gguf(path, "qwen2", d, random_weights(d, 7), "F32", sizes, seed=1, tokenizer="llama")
    expected, gap = greedy_with_gaps(d, meant, PROMPT, TOKENS)
    assert gap > MARGIN, f"the prompt gives a near-tie ({gap:.4f}): pick another"
    assert len(set(expected)) > 1  # not one token repeated: a wrong step would show
    prompt, tokens = ",".join(map(str, PROMPT)), str(TOKENS)
    args = module.parse_args(
        ["--model", str(path), "--prompt-ids", prompt, "--max-tokens", tokens, "--threads", "1,2", "--timeout", "120"]
    )
    report = module.benchmark(args, log=lambda line: None)

    rows = report["rows"]
    assert [(row["engine"], row["threads"]) for row in rows] == [("batchgpu", None), ("wllama", 1), ("wllama", 2)]
    for row in rows:
        assert row["ids"] == expected, row
        assert row["first_difference"] is None
        assert row["load_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0, row
    assert report["agree"] and report["prompt_ids"] == PROMPT
    multi = rows[2]["detail"]
    assert multi["multithread"] and multi["cross_origin_isolated"], multi  # the served headers reached it
    lines = report["table"].splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == 8 for line in lines)
    assert lines[2].startswith("| batchgpu | - |") and lines[3].startswith("| wllama | 1 |")
    assert all(line.endswith("| yes |") for line in lines[2:])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--prompt-ids", "3,50,4"], r"prompt id 50 is not in the file's vocabulary \[0, 50\)"),
        (["--prompt-ids", "3,-1"], r"prompt id -1 is not in the file's vocabulary \[0, 50\)"),
        (["--prompt-ids", "3,x"], r"--prompt-ids must be comma-separated integers, got '3,x'"),
        (["--prompt-ids", ","], "the prompt has no ids"),
        (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1, got 0"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (
            ["--prompt-tokens", "7", "--max-context", "8"],
            r"--max-context 8 is under the prompt \(7\) \+ --max-tokens \(5\)",
        ),
    ],
    ids=["id past the vocabulary", "negative id", "not a number", "no ids", "no tokens", "no new tokens", "context"],
)
def test_bad_arguments_are_refused_before_anything_is_built(tmp_path, change, message):
    module = browser_chat()
    d = VARIANTS["qwen2"]
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", d, random_weights(d, 7), "F32", tiny_sizes(d), seed=1, tokenizer="llama")
    args = module.parse_args(["--model", str(path), "--max-tokens", "5", *change])
    with pytest.raises(ArgumentError, match=message):
        module.benchmark(args, log=lambda line: None)
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model")
    with pytest.raises(ModelFileError, match="magic"):
        module.benchmark(module.parse_args(["--model", str(not_gguf)]), log=lambda line: None)


def test_first_difference_is_the_first_index_that_differs():
    first_difference = browser_chat().first_difference
    assert first_difference([5, 6, 7], [5, 6, 7, 8]) is None  # over the shorter list
    assert first_difference([5, 6, 7], [5, 9, 7]) == 1
    assert first_difference([4], [5]) == 0


def test_serve_sends_extra_headers_only_when_asked(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with serve(tmp_path) as base, urllib.request.urlopen(base + "a.txt") as plain:
        assert plain.headers["Cross-Origin-Opener-Policy"] is None
        assert plain.headers["Cache-Control"] == "no-store"
    with serve(tmp_path, headers=CROSS_ORIGIN_ISOLATION) as base, urllib.request.urlopen(base + "a.txt") as isolated:
        for name, value in CROSS_ORIGIN_ISOLATION.items():
            assert isolated.headers[name] == value
        assert isolated.headers["Cache-Control"] == "no-store"
        assert isolated.read() == b"x"


def test_the_npm_fetch_says_when_npm_is_missing(tmp_path, monkeypatch):
    module = browser_chat()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(module.WllamaUnavailable, match="npm is not on PATH"):
        module.wllama_package(cache=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # nothing half-made
