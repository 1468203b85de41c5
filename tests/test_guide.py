"""The user guide (docs/*.md) and README.md as documents: nothing of the old one-page README lost (each of its
headings a heading of exactly one file), README's set-up commands the ones CI runs, links that resolve, and
every ``batchgpu`` command line of a ```bash block one the CLI's own parser takes (the quick ones run as
written). The Python blocks run in tests/test_readme.py; the site builds in tests/test_docs.py."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from batchgpu import cli

from . import doc_blocks
from .doc_blocks import DOCS, README, ROOT, github_anchor
from .test_cache import python_env

CONTRIBUTING = ROOT / "CONTRIBUTING.md"

# The headings of the one-page README this guide was made from (2f76c87), frozen: each is a heading, at any
# level, of exactly one of README.md, the guide's pages (design.md among them) and CONTRIBUTING.md.
OLD_README_HEADINGS = [
    "batchgpu",
    "Example",
    "API",
    "numpy and torch idioms",
    "Ops",
    "Per-execute scalars",
    "`@bg.jit`: a function captured once, replayed per call",
    "Quantized weights",
    "A real model: SmolLM2-135M-Instruct",
    "Synthetic checkpoints of real model sizes",
    "Serving many requests: `batchgpu.llm`",
    "Structured outputs and tool calls",
    "Text embeddings: BERT encoders and `/v1/embeddings`",
    "Many devices and machines: Ray Serve",
    "Custom kernels",
    "Executors",
    'Native CUDA and HIP (`Device("cuda")`, `Device("hip")`)',
    "Reliability",
    "How execution works",
    "Reads, submissions and asyncio",
    "Run a batch in the browser",
    "A chat model in the browser",
    "Profiling",
    "Command line",
    "Cache directory and cold start",
    "Benchmarks",
    "Development",
]

QUICK_COMMANDS = {"info", "--version"}  # besides `synth` of a tiny preset: each runs in about a second
PLACEHOLDER_INT = "2"  # what an `N` metavar in a documented command line stands for when it is parsed


def _documents() -> list[Path]:
    return [README, *doc_blocks.guide_pages(), CONTRIBUTING]


def test_every_old_readme_heading_lives_in_exactly_one_file() -> None:
    where: dict[str, list[str]] = {heading: [] for heading in OLD_README_HEADINGS}
    for path in _documents():
        for _, text in doc_blocks.headings(path.read_text(encoding="utf-8")):
            if text in where:
                where[text].append(path.name)
    assert {heading: files for heading, files in where.items() if len(files) != 1} == {}


def test_the_guide_has_the_pages_the_readme_lists() -> None:
    """README's table of guide pages links every page of docs/ (the home page aside), and each page has one title."""
    assert len(doc_blocks.guide_pages()) >= 10, DOCS
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README.read_text(encoding="utf-8")))
    assert linked - {"index.md"} == {path.name for path in doc_blocks.guide_pages()} - {"index.md"}
    for path in doc_blocks.guide_pages():
        levels = [level for level, _ in doc_blocks.headings(path.read_text(encoding="utf-8"))]
        assert levels[:1] == [1] and levels.count(1) == 1, f"{path.name}: one # title, first"


def test_readme_set_up_commands_are_what_ci_runs() -> None:
    """README's first ```bash block holds the two set-up commands (# 1. and # 2.); .ci/run runs the second
    verbatim."""
    setup = doc_blocks.blocks("bash")[0]
    assert setup.page == "README.md"
    lines = setup.code.splitlines()
    assert [line.split()[:2] for line in lines[::2]] == [["#", "1."], ["#", "2."]] and len(lines) == 4
    assert "python examples/quickstart.py" in lines[1] and "python -m pytest" in lines[3]
    ci = ROOT / ".ci" / "run"
    if not ci.is_file():
        pytest.skip("no .ci/run here (an sdist)")
    assert lines[3] in ci.read_text(encoding="utf-8").splitlines()


LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (the guide's pages get the same from mkdocs:
    tests/test_docs.py checks it)."""
    return {github_anchor(text) for _, text in doc_blocks.headings(path.read_text(encoding="utf-8"))}


@pytest.mark.parametrize("path", [README, CONTRIBUTING], ids=lambda path: path.name)
def test_links_outside_the_site_resolve(path: Path) -> None:
    """README.md's and CONTRIBUTING.md's relative links (into docs/ and elsewhere) name files that exist, and
    headings of them where they have an anchor (mkdocs --strict checks the guide's own links)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    links = [match["target"] for match in LINK.finditer(text) if "://" not in match["target"]]
    assert links
    for link in links:
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        assert target.is_file(), f"{path.name}: {link}"
        if anchor:
            assert anchor in _anchors(target), f"{path.name}: {link}: no such heading"


def _command_lines() -> list[tuple[str, list[str]]]:
    """Each ``python -m batchgpu ...`` / ``batchgpu ...`` command of the README's and the guide's ```bash
    blocks: (where, its arguments after the program)."""
    found = []
    for block in doc_blocks.blocks("bash"):
        for n, line in enumerate(block.code.replace("\\\n", " ").splitlines()):
            lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
            while words:
                cut = next((i for i, word in enumerate(words) if word in {"&&", "||", "|", ";"}), len(words))
                command, words = words[:cut], words[cut + 1 :]
                if command[:3] == ["python", "-m", "batchgpu"]:
                    found.append((f"{block.where}+{n + 1}", command[3:]))
                elif command[:1] == ["batchgpu"]:
                    found.append((f"{block.where}+{n + 1}", command[1:]))
    return found


def _as_parsed(args: list[str]) -> list[str] | None:
    """A documented command line as the parser gets it: optional parts in brackets taken (``[--quick]``),
    an ``N`` metavar a number; None for a line with ``...`` standing for any command."""
    if "..." in args:
        return None
    words = [word.strip("[]") for word in args]
    return [PLACEHOLDER_INT if word == "N" else word for word in words]


def test_every_documented_command_line_parses() -> None:
    """An unknown command or flag, or a value of the wrong type, in the guide fails here (argparse's exit 2);
    every command of the CLI appears in the guide."""
    lines = _command_lines()
    parser = cli.build_parser()
    commands, placeholders = set(), []
    for where, args in lines:
        words = _as_parsed(args)
        if words is None:
            placeholders.append(where)
            continue
        try:
            parsed = parser.parse_args(words)
        except SystemExit as exc:
            assert exc.code == 0 and words == ["--version"], f"{where}: {shlex.join(args)}"
            continue
        commands.add(parsed.command)
    assert len(placeholders) <= 1, placeholders  # `python -m batchgpu -v ...`
    subparsers = next(action for action in parser._actions if action.dest == "command")
    assert commands == set(subparsers.choices), set(subparsers.choices) - commands


def test_quick_documented_commands_run_as_written(tmp_path: Path) -> None:
    """``info``, ``--version`` and ``synth`` of a tiny preset, as the guide writes them (``batchgpu`` is the
    console script of ``python -m batchgpu``), exit 0; synth's file is written."""
    quick = [
        (where, args)
        for where, args in _command_lines()
        if args[:1] and (args[0] in QUICK_COMMANDS or (args[0] == "synth" and "tiny" in " ".join(args)))
    ]
    assert {args[0] for _, args in quick} == {"info", "--version", "synth"}, quick
    for where, args in quick:
        done = subprocess.run(
            [sys.executable, "-m", "batchgpu", *args],
            env=python_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{where}: {shlex.join(args)}\n{done.stderr}"
        if args[0] == "synth":
            assert (tmp_path / args[args.index("--out") + 1]).stat().st_size > 0
