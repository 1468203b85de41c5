"""Finding and rendering the shader sources under ``shaders/<language>/<family>``."""

from __future__ import annotations

import functools
import re
import string
from pathlib import Path

_HERE = Path(__file__).resolve().parent
SEARCH_PATH = (_HERE / "shaders", _HERE.parent / "shaders")  # inside a wheel, then a source checkout

DEFAULT_SNIPPETS = {"UNARY": "x", "BINARY": "x"}


def shader_root() -> Path:
    """The folder holding ``wgsl/`` (and later ``cuda/``) shader families."""
    for candidate in SEARCH_PATH:
        if (candidate / "wgsl").is_dir():
            return candidate
    raise FileNotFoundError(f"batchgpu shaders not found in {[str(p) for p in SEARCH_PATH]}")


@functools.cache
def _template(language: str, family: str) -> string.Template:
    suffix = {"wgsl": ".wgsl", "cuda": ".cu"}[language]
    return string.Template(_with_includes((shader_root() / language / f"{family}{suffix}").read_text()))


_INCLUDE = re.compile(r"^//!include (\w+)$", re.MULTILINE)


def _with_includes(text: str) -> str:
    """Replace ``//!include NAME`` lines by ``shaders/wgsl/lib/NAME.wgsl`` (WGSL has no includes)."""
    return _INCLUDE.sub(lambda m: (shader_root() / "wgsl" / "lib" / f"{m.group(1)}.wgsl").read_text(), text)


@functools.cache
def render_wgsl(family: str, types: tuple[tuple[str, str], ...], snippets: tuple[tuple[str, str], ...]) -> str:
    """WGSL source of ``family`` with ``alias`` lines for ``types`` and ``${NAME}`` snippets filled in."""
    header = "enable f16;\n" if any(t == "f16" for _, t in types) else ""
    header += "".join(f"alias {name} = {wgsl_type};\n" for name, wgsl_type in types)
    body = _template("wgsl", family).substitute({**DEFAULT_SNIPPETS, **dict(snippets)})
    return header + body
