"""The code blocks of README.md and of the user guide (docs/*.md; the generated API reference pages under
docs/reference/ hold none), parsed once for every test that runs or reads them.

A block may carry one marker on the line right before its fence: ``<!-- readme-test: NAME -->`` names it (the
test id, and a handle for other tests: :func:`named_block` finds it wherever it lives), ``<!-- readme-skip:
REASON -->`` exempts it from being run (tests/test_readme.py's rules). Names are unique across all the files."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`\s]*)\s*$")
MARKER = re.compile(r"^\s*<!-- readme-(?P<kind>test|skip)(?::(?P<value>.*?))? -->\s*$")
HEADING = re.compile(r"^(?P<level>#{1,6}) (?P<text>.+?)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # README.md, or the guide page's name (serving.md)
    line: int  # 1-based line of the opening fence
    language: str
    code: str  # dedented to the fence's indentation
    name: str | None = None
    skip: str | None = None  # the exemption's reason

    @property
    def id(self) -> str:
        return f"{self.page}:{self.name or f'line{self.line}'}"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def guide_pages() -> list[Path]:
    """The guide's pages (docs/*.md), in name order."""
    return sorted(DOCS.glob("*.md"))


def files() -> list[Path]:
    """README.md, then the guide's pages: every file whose blocks run in the tests."""
    return [README, *guide_pages()]


def parse(text: str, page: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` with the marker (if any) on the line before its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening["indent"], opening["info"]
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}```"), None)
        assert end is not None, f"{page}:{i + 1}: the ```{language} block is never closed"
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        name = skip = None
        if marker and marker["kind"] == "test":
            name = (marker["value"] or "").strip()
            assert re.fullmatch(r"\w+", name), f"{page}:{i}: readme-test needs a name: {lines[i - 1]!r}"
        elif marker:
            skip = (marker["value"] or "").strip()
        blocks.append(Block(page, i + 1, language, code, name, skip))
        i = end + 1
    return blocks


@cache
def _all_blocks() -> tuple[Block, ...]:
    return tuple(block for path in files() for block in parse(path.read_text(encoding="utf-8"), path.name))


def blocks(language: str | None = None) -> list[Block]:
    """The blocks of README.md and the guide (of one language: ``"python"``, ``"bash"``, ``"js"``)."""
    return [block for block in _all_blocks() if language is None or block.language == language]


def named_block(name: str, language: str) -> str:
    """The code of the block marked ``<!-- readme-test: NAME -->``, in README.md or a guide page."""
    found = [block for block in blocks(language) if block.name == name]
    assert len(found) == 1, f"{len(found)} {language} blocks marked readme-test: {name} in README.md and docs/*.md"
    return found[0].code


def headings(text: str) -> list[tuple[int, str]]:
    """The Markdown headings of ``text`` outside code blocks, as (level, text)."""
    found: list[tuple[int, str]] = []
    code = False
    for line in text.splitlines():
        if re.match(r"^ *```", line):
            code = not code
        elif not code and (match := HEADING.match(line)):
            found.append((len(match["level"]), match["text"]))
    return found


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (lower case, punctuation dropped, spaces to hyphens); mkdocs gives the
    guide's headings the same (tests/test_docs.py checks it), so README.md's links into docs/ work on both."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
