"""What a structured request constrains its output to: :class:`StructuredOutput` (a JSON schema, any JSON
object, a Lark grammar or a regular expression), checked for its shape when the request is made. The
grammar engine (:mod:`~batchgpu.llm.grammar`) compiles it for the model's vocabulary; the sampler then
draws only tokens the grammar allows, on the device."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..arguments import brief
from ..errors import RequestError

MAX_GRAMMAR_CHARS = 1 << 20
"""The longest schema, grammar or expression a request may give, in characters (1 Mi: thousands of times a
typical tool's schema); the grammar engine's own limits bound the work a shorter one can ask for."""


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON output is laid out: one line, with ``json.dumps``' separators (free whitespace lets a small model
wander into blank lines and spend tokens on them; a schema's own ``x-guidance`` settings win)."""


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: ``json_schema`` (a JSON schema, as a mapping or its JSON text: the output is a JSON
    value it accepts), ``json_object`` (any JSON object), ``lark`` (a grammar in llguidance's Lark syntax,
    which may embed ``%json {schema}``) or ``regex`` (a regular expression the whole output matches).
    ``param``: the request field to name when the constraint is refused (``response_format``, ``tools``)."""

    json_schema: str | Mapping[str, Any] | None = None
    json_object: bool = False
    lark: str | None = None
    regex: str | None = None
    param: str = "response_format"

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, Mapping):
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema, separators=(",", ":")))
            except (TypeError, ValueError) as exc:
                raise RequestError(f"json_schema is not JSON: {exc}", self.param) from None
        given = [name for name in ("json_schema", "lark", "regex") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            shown = ", ".join(given) or "none"
            raise RequestError(
                f"a structured output needs exactly one of json_schema, json_object, lark, regex; got {shown}",
                self.param,
            )
        text = getattr(self, given[0])
        if given[0] != "json_object" and not isinstance(text, str):
            raise RequestError(f"{given[0]} must be a str, got {brief(text)}", self.param)
        if isinstance(text, str) and len(text) > MAX_GRAMMAR_CHARS:
            message = f"the {given[0]} is {len(text)} characters long; at most {MAX_GRAMMAR_CHARS}"
            raise RequestError(message, self.param)
