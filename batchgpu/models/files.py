"""A model directory's files read as untrusted input. A file is named by a plain file name (from a fixed
list, a shard index or the directory's listing) and read only where its real path (links resolved) lies
inside the directory; JSON files are read within a size limit, as objects, with duplicate keys and
non-finite numbers refused. Each refusal is a :class:`~batchgpu.errors.ModelFileError` naming the file
and what is wrong with it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import ModelFileError

MAX_TEXT_BYTES = 64 << 20
"""The largest JSON or text file of a model directory read (tokenizer.json files run to about 35 MB)."""

HF_CACHE_SNAPSHOTS, HF_CACHE_BLOBS = "snapshots", "blobs"
"""A Hugging Face cache keeps a repository's files in ``<repo>/blobs`` and links to them from each
revision's folder ``<repo>/snapshots/<revision>``."""


def describe(value: Any) -> str:
    """A short text of a value read from a file and its JSON / GGUF kind, for error messages."""
    kinds = {bool: "a bool", int: "an integer", float: "a number", str: "a string", dict: "an object"}
    kind = next((text for cls, text in kinds.items() if type(value) is cls), None)
    if kind is None:
        kind = f"an array of {len(value)}" if hasattr(value, "__len__") else type(value).__name__
    text = repr(value if not hasattr(value, "tolist") else value.tolist())
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})"


def roots(directory: Path) -> list[Path]:
    """Where the files of ``directory`` may really be: the directory itself, and where it is a Hugging Face
    cache revision (``<repo>/snapshots/<revision>``) its repository's ``blobs`` folder (not a link)."""
    real = directory.resolve()
    places = [real]
    blobs = real.parent.parent / HF_CACHE_BLOBS
    if real.parent.name == HF_CACHE_SNAPSHOTS and blobs.is_dir() and not blobs.is_symlink():
        places.append(blobs.resolve())
    return places


def plain_file_name(name: Any) -> bool:
    """Whether ``name`` is a file name alone: a string without a folder part (``/``, ``\\``), not empty,
    ``.`` or ``..``, without NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and Path(name).name == name
        and not ("\\" in name or "\0" in name)
    )


def model_file(directory: Path, name: Any, source: str | Path, field: str) -> Path:
    """The path of file ``name`` of the model ``directory``, as ``field`` of ``source`` names it: a plain
    file name (no folder part, not ``.`` or ``..``) whose real path (links resolved) is a file inside the
    directory (see :func:`roots`); ModelFileError otherwise, before anything is read."""
    if not plain_file_name(name):
        raise ModelFileError(
            f"{source}: {field} must be a plain file name (no folder part) in {directory}, got {describe(name)}"
        )
    path = directory / name
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in roots(directory)):
        raise ModelFileError(
            f"{source}: {field} {name!r} resolves to {real}, outside the model directory {directory.resolve()}"
        )
    if not real.is_file():
        raise ModelFileError(f"{source}: {field} {name!r} is not a file in {directory}")
    return path


def optional_file(directory: Path, name: str) -> Path | None:
    """The model directory's file ``name`` (checked as :func:`model_file` does), or None where there is none."""
    path = directory / name
    if not path.exists() and not path.is_symlink():
        return None
    return model_file(directory, name, directory, "file")


def read_bytes(path: Path, limit: int = MAX_TEXT_BYTES) -> bytes:
    """The file's bytes, where it holds at most ``limit``."""
    size = path.stat().st_size
    if size > limit:
        raise ModelFileError(f"{path}: size must be at most {limit} bytes, got {size}")
    return path.read_bytes()


def read_text(path: Path) -> str:
    """The file as UTF-8 text (within :data:`MAX_TEXT_BYTES`)."""
    try:
        return read_bytes(path).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ModelFileError(f"{path}: must be UTF-8 text: {error}") from None


def parse_json(data: bytes, source: str | Path, what: str = "the file") -> Any:
    """The JSON value of ``data``; ModelFileError for text that is not UTF-8 JSON, a key given twice in one
    object (Python's reader would keep the last silently), NaN / Infinity / numbers past float range, or
    nesting deeper than Python's reader goes."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ModelFileError(f"{source}: key {key!r} appears twice in one object of {what}")
            result[key] = value
        return result

    def finite(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ModelFileError(f"{source}: {what} holds the number {text}; numbers must be finite")
        return value

    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=unique, parse_float=finite, parse_constant=finite)
    except ModelFileError:
        raise
    except UnicodeDecodeError as error:
        raise ModelFileError(f"{source}: {what} must be UTF-8 JSON: {error}") from None
    except ValueError as error:  # json.JSONDecodeError, and integers of more digits than Python converts
        raise ModelFileError(f"{source}: {what} is not JSON: {error}") from None
    except RecursionError:
        raise ModelFileError(f"{source}: {what} nests arrays or objects deeper than its reader goes") from None


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object a file holds (within :data:`MAX_TEXT_BYTES`)."""
    value = parse_json(read_bytes(path), path)
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: must be a JSON object, got {describe(value)}")
    return value
