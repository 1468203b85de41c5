"""Values of a model file by key (GGUF metadata, or a JSON object: config.json, tokenizer_config.json, a
safetensors header entry), each type- and range-checked as it is read. A refusal is a
:class:`~batchgpu.errors.ModelFileError` naming the file and the key with expected vs actual; a bool is
never taken for a number, nor a string for either, and numbers are finite."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ModelFileError
from .files import describe

REQUIRED: Any = object()
"""The default of a key that must be present."""

INT32_MAX = (1 << 31) - 1
"""The default upper bound of an integer: sizes and ids reach the kernels as 32-bit integers."""


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return _is_integer(value) or isinstance(value, (float, np.floating))


class Fields:
    """The values of ``values`` (key -> value) read from ``source``; a JSON null is an absent key (as
    transformers writes unset settings). ``label`` goes before each key in messages (a nested object's
    own key)."""

    def __init__(self, values: Mapping[str, Any], source: str | Path, label: str = "") -> None:
        self.values, self.source, self.label = values, str(source), label

    def under(self, prefix: str) -> Fields:
        """The keys that start with ``prefix``, by the rest of their name (``fields.under("llama.")``)."""
        return _Prefixed(self, prefix)

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def name(self, key: str) -> str:
        """The key as messages name it."""
        return self.label + key

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def refuse(self, key: str, expected: str, actual: Any, shown: str | None = None) -> ModelFileError:
        """The error for ``key``'s value ``actual`` where ``expected`` was (``shown``: how to say the value,
        where not by :func:`~batchgpu.models.files.describe`)."""
        return ModelFileError(f"{self.source}: {self.name(key)} must be {expected}, got {shown or describe(actual)}")

    def raw(self, key: str, default: Any = REQUIRED) -> Any:
        """The value as it is, ``default`` where absent (ModelFileError where required)."""
        value = self.get(key)
        if value is None:
            if default is REQUIRED:
                raise ModelFileError(f"{self.source}: {self.name(key)} is missing")
            return default
        return value

    def integer(self, key: str, default: Any = REQUIRED, *, low: int = 0, high: int = INT32_MAX) -> Any:
        """An integer in [low, high] (a default is checked too; None passes as None)."""
        value = self.raw(key, default)
        if value is None:
            return None
        if not _is_integer(value) or not low <= value <= high:
            raise self.refuse(key, f"an integer in [{low}, {high}]", value)
        return int(value)

    def number(self, key: str, default: Any = REQUIRED, *, positive: bool = False) -> float:
        """A finite number (``positive``: above 0)."""
        value = self.raw(key, default)
        if not _is_number(value) or not math.isfinite(value) or (positive and value <= 0):
            raise self.refuse(key, "a finite number" + (" above 0" if positive else ""), value)
        return float(value)

    def text(self, key: str, default: Any = REQUIRED, choices: Collection[str] | None = None) -> Any:
        """A string (one of ``choices`` where given; a default passes as it is)."""
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, str):
            raise self.refuse(key, "a string", value)
        if choices is not None and value not in choices:
            raise self.refuse(key, f"one of {', '.join(choices)}", value)
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, (bool, np.bool_)):
            raise self.refuse(key, "true or false", value)
        return bool(value)

    def texts(self, key: str, default: Any = REQUIRED) -> Any:
        """An array of strings (a default passes as it is)."""
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise self.refuse(key, "an array of strings", value)
        return value

    def integers(
        self, key: str, default: Any = REQUIRED, *, low: int = 0, high: int = INT32_MAX, single: bool = False
    ) -> Any:
        """An array of integers in [low, high] as int64 (``single``: one integer is an array of one; a
        default passes as it is)."""
        value = self.raw(key, default)
        if value is default:
            return value
        items = [value] if single and _is_integer(value) else value
        expected = f"{'an integer or ' if single else ''}an array of integers in [{low}, {high}]"
        if isinstance(items, np.ndarray) and items.ndim == 1 and items.dtype.kind in "iu":
            array = items.astype(np.int64)
        elif isinstance(items, list) and all(_is_integer(item) for item in items):
            array = np.array([int(item) for item in items if low <= item <= high], np.int64)
            if len(array) != len(items):
                raise self.refuse(key, expected, value)
        else:
            raise self.refuse(key, expected, value)
        if len(array) and (array.min() < low or array.max() > high):
            raise self.refuse(key, expected, value)
        return array

    def numbers(self, key: str, default: Any = REQUIRED) -> Any:
        """An array of finite numbers as float64 (a default passes as it is)."""
        value = self.raw(key, default)
        if value is default:
            return value
        if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iuf":
            array = value.astype(np.float64)
        elif isinstance(value, list) and all(_is_number(item) for item in value):
            array = np.array(value, np.float64)
        else:
            raise self.refuse(key, "an array of numbers", value)
        if not np.isfinite(array).all():
            raise self.refuse(key, "an array of finite numbers", value)
        return array

    def mapping(self, key: str) -> Fields | None:
        """A nested object's fields (None where absent), its keys named ``key.inner`` in messages."""
        value = self.raw(key, None)
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise self.refuse(key, "an object", value)
        return Fields(value, self.source, f"{self.name(key)}.")


class _Prefixed(Fields):
    """The keys of ``fields`` under ``prefix``."""

    def __init__(self, fields: Fields, prefix: str) -> None:
        super().__init__(fields.values, fields.source, fields.label)
        self.base, self.prefix = fields, prefix

    def get(self, key: str) -> Any:
        return self.base.get(self.prefix + key)

    def name(self, key: str) -> str:
        return self.base.name(self.prefix + key)
