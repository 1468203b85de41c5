"""The API reference (mkdocs.yml, docs/: MkDocs with mkdocstrings' Python handler) builds from the docstrings
with ``mkdocs build --strict`` and no warning at all, and holds a page per public module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocs", reason='the docs extra: pip install -e ".[docs]"')
pytest.importorskip("mkdocstrings_handlers.python", reason='the docs extra: pip install -e ".[docs]"')

PAGES = {  # page -> objects it must document (their anchors)
    "reference/batchgpu": [
        "batchgpu.Device",
        "batchgpu.Device.tensor",
        "batchgpu.GpuCommandBatch",
        "batchgpu.GpuCommandBatch.execute",
        "batchgpu.GpuCommandBatch.add",  # built by _binary("add"): docs/griffe_ops.py
        "batchgpu.GpuCommandBatch.exp",
        "batchgpu.Tensor",
        "batchgpu.jit.jit",
        "batchgpu.jit.Jit",
        "batchgpu.Kernel",
        "batchgpu.Profile",
        "batchgpu.errors.BatchError",
        "batchgpu.errors.ShapeError",
    ],
    "reference/llm": ["batchgpu.llm.Engine", "batchgpu.llm.Engine.generate", "batchgpu.llm.SamplingParams"],
    "reference/models-llama": ["batchgpu.models.llama.Llama", "batchgpu.models.llama.open_weights"],
    "reference/quant": ["batchgpu.quant", "batchgpu.quant.FORMATS", "batchgpu.quant.BlockFormat"],
    "reference/promotion": ["batchgpu.promotion", "batchgpu.promotion.promote_types"],
}


def test_docs_build_strict_without_warnings(tmp_path: Path) -> None:
    if not (ROOT / "mkdocs.yml").is_file():
        pytest.skip("no mkdocs.yml here (an sdist)")
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    done = subprocess.run(
        [*command, "--site-dir", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    problems = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not problems, log
    for page, objects in PAGES.items():
        html = (site / page / "index.html").read_text(encoding="utf-8")
        missing = [name for name in objects if f'id="{name}"' not in html]
        assert not missing, f"{page}: {missing}"
        assert ":class:`" not in html and ":meth:`" not in html, f"{page}: a Sphinx role left unrendered"
    assert not list(site.rglob("*.py")), "the docs' build scripts were copied into the site"
