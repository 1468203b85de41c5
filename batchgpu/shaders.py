"""Finding and rendering the shader sources under ``shaders/<language>/<family>``.

A family's source has an ``//!interface`` line where its declarations go, generated from its
:class:`~batchgpu.ops.interface.Family` (constants, ``Params``, bindings / ``BG_ARGS``); WGSL sources also
``//!include`` files of ``shaders/wgsl/lib`` and ``${NAME}`` placeholders for op expressions.
"""

from __future__ import annotations

import functools
import re
import string
from pathlib import Path
from typing import Literal

from .errors import UnsupportedError
from .kernels import HALF_ALIAS
from .ops import fused
from .ops.elementwise import EXPRESSIONS
from .ops.interface import FAMILIES

_HERE = Path(__file__).resolve().parent
SEARCH_PATH = (_HERE / "shaders", _HERE.parent / "shaders")  # inside a wheel, then a source checkout

Language = Literal["wgsl", "cuda"]

DEFAULT_SNIPPETS = {"UNARY": "x", "BINARY": "x", "ACTIVATION": "x"}
"""What a placeholder no snippet names stands for (the other op kind's function of elementwise.wgsl, a
matmul without an activation)."""

DEFAULT_FORMAT = "q8_0"
"""The block format rendered into the qmatmul and gather families' generic entries when a launch names
none (launches of their other entries)."""

FORMAT_SNIPPET = "FORMAT"
"""The placeholder a launch fills with a block format's name (``batchgpu/quant.py``): the format's
in-register dequantization, ``shaders/<language>/formats/<name>``."""

_FORMAT_SUFFIX = {"wgsl": ".wgsl", "cuda": ".cuh"}

STATEMENT_SNIPPETS: dict[str, tuple[str, ...]] = {"fused": fused.PLACEHOLDERS}
"""Placeholders filled with generated code (functions, statements) rather than one op's expression, by
family: their snippet value is a fused program (:mod:`batchgpu.ops.fused`)."""

_SUFFIX = {"wgsl": ".wgsl", "cuda": ".cu"}
_INTERFACE = "//!interface"
_INCLUDE = re.compile(r"^//!include (\w+)$", re.MULTILINE)


def shader_root() -> Path:
    """The folder holding the ``wgsl/`` and ``cuda/`` shader families."""
    for candidate in SEARCH_PATH:
        if (candidate / "wgsl").is_dir():
            return candidate
    raise FileNotFoundError(f"batchgpu shaders not found in {[str(p) for p in SEARCH_PATH]}")


@functools.cache
def family_source(language: Language, family: str) -> str:
    """``shaders/<language>/<family>`` with its ``//!interface`` line replaced by the family's declarations
    (and, for WGSL, its ``//!include`` lines by the lib files)."""
    path = shader_root() / language / f"{family}{_SUFFIX[language]}"
    text = path.read_text()
    if text.count(_INTERFACE + "\n") != 1:
        raise ValueError(f"{path}: needs exactly one {_INTERFACE} line (where the family's declarations go)")
    declared = FAMILIES[family]
    text = text.replace(_INTERFACE + "\n", (declared.wgsl() if language == "wgsl" else declared.cuda()) + "\n")
    return _with_includes(text) if language == "wgsl" else text


def _with_includes(text: str) -> str:
    """Replace ``//!include NAME`` lines by ``shaders/wgsl/lib/NAME.wgsl`` (WGSL has no includes)."""
    return _INCLUDE.sub(lambda m: (shader_root() / "wgsl" / "lib" / f"{m.group(1)}.wgsl").read_text(), text)


def expression(op: str, language: Language) -> str:
    """The expression of elementwise op ``op`` in ``language``, from the op-expression table."""
    row = EXPRESSIONS.get(op)
    if row is None:
        raise UnsupportedError(f"{op!r} is not an elementwise op of batchgpu/ops/elementwise.py's EXPRESSIONS")
    return row.text(language)


def snippet(placeholder: str, value: str, language: Language) -> str:
    """What ``placeholder`` of a launch's snippets stands for in ``language``: the fused family's generated
    code for its program ``value``, a block format's code, else the expression of elementwise op ``value``."""
    if placeholder in fused.PLACEHOLDERS:
        return fused.render(placeholder, value, language)
    if placeholder == FORMAT_SNIPPET:
        return format_source(value, language)
    return expression(value, language)


@functools.cache
def format_source(name: str, language: Language) -> str:
    """The in-register dequantization of block format ``name`` in ``language`` (CUDA: with the shared
    ``QBlock`` helpers in front; WGSL families include ``lib/qblock.wgsl`` themselves)."""
    folder = shader_root() / language / "formats"
    path = folder / f"{name}{_FORMAT_SUFFIX[language]}"
    if not path.is_file():
        raise UnsupportedError(f"block format {name!r} has no {language} kernels ({path} is missing)")
    text = path.read_text()
    return (folder / "qblock.cuh").read_text() + "\n" + text if language == "cuda" else text


@functools.cache
def _template(family: str) -> string.Template:
    return string.Template(family_source("wgsl", family))


@functools.cache
def render_wgsl(family: str, types: tuple[tuple[str, str], ...], snippets: tuple[tuple[str, str], ...]) -> str:
    """WGSL source of ``family`` with ``alias`` lines for ``types`` (and, with the product alias ``H``, the const
    ``HALF``: whether it is f16) and each ``${NAME}`` placeholder of ``snippets`` (NAME, op name) filled with the
    op's WGSL expression."""
    header = "enable f16;\n" if any(t == "f16" for _, t in types) else ""
    header += "".join(f"alias {name} = {wgsl_type};\n" for name, wgsl_type in types)
    half = dict(types).get(HALF_ALIAS)
    if half is not None:  # a half-capable family: whether its products are f16 (Launch.for_half)
        header += f"const HALF: bool = {'true' if half == 'f16' else 'false'};\n"
    defaults = {**DEFAULT_SNIPPETS, FORMAT_SNIPPET: format_source(DEFAULT_FORMAT, "wgsl")}
    filled = {**defaults, **{name: snippet(name, value, "wgsl") for name, value in snippets}}
    return header + _template(family).substitute(filled)
