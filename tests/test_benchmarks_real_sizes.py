"""benchmarks/real_sizes.py's own code path on a tiny synthetic model on the reference executor: the file is
written and deleted, the row has every figure, its weight bytes are the file's, and batch 1's greedy ids are
the engine's first request's (same prompt, greedy): a wrong number in either path shows as a mismatch.

The model is tiny-qwen2, not tiny-llama: tiny-llama ties its output head to the embedding, and at these
weights' scale its greedy output is one token repeated (the token nearest the residual stream), so a decode
step gone wrong after the first token would mostly still give equal ids. tiny-qwen2 has its own head (and
biases); the test also checks that its ids are not one token repeated."""

from __future__ import annotations

import json

import pytest

import batchgpu as bg
from batchgpu.models.synth import PRESETS, tensor_plans

from .conftest import load_script

pytest.importorskip("gguf", reason="the synthetic file is written with the gguf package")


def real_sizes():
    """benchmarks/real_sizes.py as a module (it puts its folder on sys.path for its neighbours)."""
    return load_script("benchmarks/real_sizes.py", "real_sizes_benchmark")


def step_bytes_in_file(preset: str, fmt: str) -> int:
    """GGUF bytes one decode step reads, from the synth plan: every tensor, of the embedding one row where
    the head is its own matrix (the device may pad blocks to whole words: at most 2 bytes per 18 here)."""
    plans = {plan.name: plan for plan in tensor_plans(PRESETS[preset], fmt)}
    total = sum(plan.nbytes for name, plan in plans.items() if name != "rope_freqs.weight")
    embedding = plans["token_embd.weight"]
    if "output.weight" in plans:
        total -= embedding.nbytes - embedding.nbytes // embedding.shape[0]
    return total


def test_a_tiny_run_has_every_figure_and_batch_1_ids_equal_the_engines(tmp_path):
    module = real_sizes()
    figures = tmp_path / "figures.json"
    args = module.parse_args(
        ["--preset", "tiny-qwen2", "--format", "q4_0", "--device", "reference", "--tokens", "8", "--prompt", "24",
         "--decode-prompt", "6", "--rounds", "1", "--copy-mib", "4", "--json", str(figures)]
    )  # fmt: skip
    printed: list[str] = []
    report = module.run(args, tmp_path, printed.append)

    (row,) = report["rows"]
    assert (row["preset"], row["format"], row["executor"]) == ("tiny-qwen2", "q4_0", "reference")
    assert not row.get("failed") and not row.get("refused"), row
    assert row["b1_ids"] == row["b16_ids"] and row["ids_equal"] == "yes"
    assert len(row["b1_ids"]) == 8 and len(set(row["b1_ids"])) > 1  # not one token repeated
    gguf = step_bytes_in_file("tiny-qwen2", "q4_0")
    assert gguf <= row["step_bytes"] <= gguf * 20 // 18
    bandwidth = report["bandwidth"]["reference"]["bytes_per_s"]
    assert row["floor_ms"] == pytest.approx(1e3 * row["step_bytes"] / bandwidth)
    for key in ("load_s", "b1_ms", "b16_ms", "prefill_tokens_per_s", "peak_rss", "engine_load_s"):
        assert row[key] > 0, key
    assert row["kernels"] and row["launches"] >= len(row["kernels"])
    assert not list(tmp_path.glob("*.gguf"))  # the file is gone once its rows are done

    table = printed[-1].splitlines()
    assert table[0].startswith("| preset") and len(table) == 3
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert cells[:4] == ["tiny-qwen2", "q4_0", "reference", bg.Device("reference").name]
    assert cells[-1] == "yes" and float(cells[module.HEADER.index("batch 1 ms/token")]) > 0
    assert json.loads(figures.read_text())["rows"][0]["b1_ids"] == row["b1_ids"]


def test_a_refused_row_says_so_in_place_of_its_figures():
    module = real_sizes()
    row = module.Row(preset="qwen2.5-0.5b", format="q8_0", executor="wgpu", device="lavapipe")
    message = "token_embd.weight is 153151488 bytes; max_storage_buffer_binding_size is 134217728"

    def refused() -> None:
        raise bg.LimitError(message)

    assert row.guard("batch 1", refused) is None and row.stopped and not row.get("failed")
    cells = module.cells(row)
    assert cells[module.HEADER.index("load s")] == f"refused: batch 1: {message}"
    assert set(cells[module.HEADER.index("load s") + 1 :]) == {"-"}


def test_a_rival_that_fails_is_noted_in_its_own_row_only():
    """torch's errors (a rival of batchgpu's batch-1 decode) go to the torch row, which stops there."""
    module = real_sizes()
    twin = module.Row(preset="llama-3.1-8b", format="f16 of q4_0", executor="torch", device="GPU")
    calls = []

    class Failing:
        def warm(self, prompt):
            calls.append("warm")
            raise RuntimeError("CUDA graph capture failed")

        def decode(self, prompt, tokens):
            calls.append("decode")
            return [1], 0.1

        def prefill(self, ids):
            calls.append("prefill")
            return 0.1

    rival = module.Guarded(Failing(), twin)
    assert rival.warm([1, 2]) is None and rival.decode([1, 2], 4) is None and rival.prefill([1]) is None
    assert calls == ["warm"] and twin["failed"] == ["warm-up: RuntimeError: CUDA graph capture failed"]
