"""MkDocs hook: the docstrings cross-reference with Sphinx roles (:class:`Tensor`, :meth:`execute`);
render each as inline code of its target (``~`` and a leading dot dropped) instead of a literal role."""

from __future__ import annotations

import re
from typing import Any

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor
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
    return config
