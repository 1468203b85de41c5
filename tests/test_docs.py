"""The site (mkdocs.yml, docs/: MkDocs with mkdocstrings' Python handler) builds with ``mkdocs build --strict``
and no warning at all (a link to a missing page or heading is one): the user guide's pages, each in the nav and
built, with README's sections they include; and the API reference, from the docstrings, a page per public
module."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from . import doc_blocks
from .doc_blocks import github_anchor

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
    check_guide(site)


INCLUDED = {  # guide page -> text of README's sections it shows (pymdownx.snippets)
    "getting-started": ["# 2. install and run the tests", "dev = bg.Device()"],
    "serving": ["python -m batchgpu serve --port 8000", 'client = OpenAI(base_url="http://127.0.0.1:8000/v1"'],
}


def check_guide(site: Path) -> None:
    """Each guide page is in the nav and built; README's sections are shown where they are included; each
    heading's anchor is the one GitHub gives it (README.md links into docs/ with those: tests/test_guide.py)."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = set(re.findall(r"^  - [^:]+: ([\w-]+\.md)$", config, re.MULTILINE))
    pages = doc_blocks.guide_pages()
    assert nav == {path.name for path in pages}, "every guide page in mkdocs.yml's nav, and only those"
    for path in pages:
        name = path.stem
        built = site / ("" if name == "index" else name) / "index.html"
        text = built.read_text(encoding="utf-8")
        plain = html.unescape(re.sub(r"<[^>]+>", "", text))
        assert "--8<--" not in plain, f"{name}: a snippet not included"
        for included in INCLUDED.get(name, []):
            assert included in plain, f"{name}: README's {included!r} not shown"
        headings = [heading for _, heading in doc_blocks.headings(path.read_text(encoding="utf-8"))]
        anchors = [github_anchor(heading) for heading in headings]
        assert len(anchors) == len(set(anchors)), f"{name}: two headings with one anchor"
        ids = set(re.findall(r'<h[1-6] id="([^"]+)"', text))
        assert set(anchors) <= ids, f"{name}: mkdocs anchors differ from GitHub's: {set(anchors) - ids}"
