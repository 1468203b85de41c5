"""MkDocs hooks.

- The docstrings cross-reference with Sphinx roles (:class:`Tensor`, :meth:`execute`); render each as inline
  code of its target (``~`` and a leading dot dropped) instead of a literal role.
- Snippets (``--8<-- "README.md:setup"``) are read from the repository root, wherever mkdocs runs.
- A guide page's link to a repository file outside docs/ (``[RESULTS](../benchmarks/RESULTS.md#cold-start)``,
  which works on GitHub) must name a file that exists, and a heading of it when it has an anchor; the site,
  which holds only docs/, shows the link's text."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`[~.]?([^`]+)`")


class _Roles(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        return [ROLE.sub(r"`\1`", line) for line in lines]


class SphinxRoles(Extension):
    def extendMarkdown(self, md: Markdown) -> None:
        md.preprocessors.register(_Roles(md), "sphinx_roles", 40)


@event_priority(100)  # before mkdocstrings reads the Markdown extensions for its docstrings
def on_config(config: Any) -> Any:
    config.markdown_extensions.append(SphinxRoles())
    snippets = config.mdx_configs.get("pymdownx.snippets")
    if snippets is not None:
        snippets["base_path"] = [str(Path(config.config_file_path).resolve().parent)]
    return config


OUTSIDE = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<path>\.\./[^)#\s]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^ *```")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> set[str]:
    """The GitHub anchors of a Markdown file's headings (outside code blocks)."""
    found, code = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            code = not code
        elif not code and (match := re.match(r"#{1,6} (.+)", line)):
            found.add(github_anchor(match[1]))
    return found


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(config.docs_dir).resolve()
    here = (docs / page.file.src_path).parent

    def outside(match: re.Match[str]) -> str:
        target = (here / match["path"]).resolve()
        where = f"{page.file.src_path}: the link {match[0]!r}"
        if docs in target.parents or not target.is_file():
            raise PluginError(f"{where} points to no file of the repository outside docs/")
        anchor = (match["anchor"] or "#")[1:]
        if anchor and anchor not in headings(target):
            raise PluginError(f"{where}: {target.name} has no heading #{anchor}")
        return match["text"]

    return OUTSIDE.sub(outside, markdown)
