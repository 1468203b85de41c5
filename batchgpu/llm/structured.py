"""What a structured request constrains its output to: :class:`StructuredOutput` (a JSON schema, any JSON
object, a Lark grammar or a regular expression), checked for its shape when the request is made, a JSON
schema also for a finite value (:func:`infinite_schema`). The grammar engine (:mod:`~batchgpu.llm.grammar`)
compiles it for the model's vocabulary; the sampler then draws only tokens the grammar allows, on the
device."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

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
            except (TypeError, ValueError, RecursionError) as exc:
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
        if given[0] == "json_schema":
            check_finite_schema(text, self.param)


def check_finite_schema(schema: str | Mapping[str, Any], param: str, what: str | None = None) -> None:
    """RequestError naming ``param`` where the JSON ``schema`` (or its JSON text; text that is not JSON is
    left to the grammar engine, which refuses it) has no finite value (:func:`infinite_schema`); ``what``:
    the schema's name in the message (default: the ``param`` JSON schema)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return
    where = infinite_schema(schema)
    if where is not None:
        message = (
            f"{what or f'the {param} JSON schema'} has no finite value: {where} cannot be completed (every value "
            "it allows holds itself again, as in a $ref to itself or a cycle of $refs with no way out); give "
            "the recursion an end, such as an optional property, an array that may be empty or an anyOf branch"
        )
        raise RequestError(message, param)


# a JSON schema's finite values ---------------------------------------------------------------------------

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
"""JSON schema's types (a schema without ``type`` allows each)."""


class _Goals:
    """An and/or graph of what a JSON schema's values need: a goal is met once all (``and``) or one
    (``or``) of its parts is; a schema's goal is that it has a finite value."""

    def __init__(self) -> None:
        self.parts: list[list[int]] = []
        self.any: list[bool] = []

    def add(self, parts: list[int], any_part: bool = False) -> int:
        self.parts.append(parts)
        self.any.append(any_part)
        return len(self.parts) - 1

    def met(self) -> list[bool]:
        """Which goals are met: the least fixed point, each goal and part looked at once."""
        users = defaultdict(list)
        missing = [1 if any_part else len(parts) for parts, any_part in zip(self.parts, self.any)]
        for goal, parts in enumerate(self.parts):
            for part in parts:
                users[part].append(goal)
        done = [False] * len(self.parts)
        ready = [goal for goal, count in enumerate(missing) if count == 0]
        while ready:
            goal = ready.pop()
            if done[goal]:
                continue
            done[goal] = True
            for user in users[goal]:
                missing[user] -= 1
                if missing[user] == 0:
                    ready.append(user)
        return done


def infinite_schema(schema: Any) -> str | None:
    """Where the JSON ``schema`` cannot be completed (the JSON pointer of a subschema without a finite
    value, ``#`` the whole schema), or None where every subschema a value may hold has a finite value.

    A schema's value is finite where its ``$ref`` target, every ``allOf`` member, one ``anyOf`` and one
    ``oneOf`` member and one of its types have one; an object needs a finite value of each ``required``
    property (and of one more property per ``minProperties`` past them), an array one of each of its first
    ``minItems`` items; ``const``, ``enum`` and the other types are finite. That is the least fixed point
    over the schema's (local) references, so ``{"$ref": "#"}``, a cycle of ``$ref``s and a required
    property holding the schema again have none, while a tree whose children are optional (or an array
    that may be empty) has. Every subschema a value may hold is judged, optional ones too: the grammar
    engine lets an output enter an optional property or an ``anyOf`` branch that can never end, then it is
    stuck. Only structure is judged: a schema whose constraints contradict is left to the grammar engine
    (it refuses what it finds unsatisfiable), as are references it resolves and this does not (taken as
    finite)."""
    if not isinstance(schema, Mapping):
        return None
    goals = _Goals()
    nodes = _SchemaNodes(schema, goals)
    nodes.goal(schema, "#")
    while nodes.pending:
        value, pointer, goal = nodes.pending.pop()
        goals.parts[goal] = _needs(value, pointer, nodes, goals)
    met = goals.met()
    unmet = [pointer for goal, pointer in nodes.pointers.items() if not met[goal]]
    return next((pointer for pointer in unmet if pointer != "#"), "#") if unmet else None


class _SchemaNodes:
    """The goal of each subschema of ``root`` (by identity), made on first sight and filled later
    (``pending``), its JSON pointer kept for the refusal; local ``$ref``s resolved (JSON pointers,
    ``$anchor`` names)."""

    def __init__(self, root: Mapping[str, Any], goals: _Goals) -> None:
        self.root, self.goals = root, goals
        self.ids: dict[int, int] = {}
        self.pointers: dict[int, str] = {}
        self.pending: list[tuple[Any, str, int]] = []
        self.anchors = _anchors(root)

    def goal(self, value: Any, pointer: str) -> int:
        """The goal of the subschema ``value`` (at ``pointer``): made, its parts filled later, on first sight."""
        key = id(value)
        if key not in self.ids:
            self.ids[key] = goal = self.goals.add([])
            self.pointers[goal] = pointer
            self.pending.append((value, pointer, goal))
        return self.ids[key]

    def resolve(self, ref: str) -> tuple[Any, str] | None:
        """The subschema a local ``$ref`` names, or None (not local, or not there)."""
        if ref in self.anchors:
            return self.anchors[ref], ref
        if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
            return None
        value: Any = self.root
        for step in ref[2:].split("/") if len(ref) > 1 else ():
            step = unquote(step).replace("~1", "/").replace("~0", "~")
            if isinstance(value, Mapping) and step in value:
                value = value[step]
            elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
                value = value[int(step)]
            else:
                return None
        return value, ref


def _anchors(root: Mapping[str, Any]) -> dict[str, Any]:
    """``#name`` -> the subschema with ``"$anchor": "name"``, anywhere in ``root``."""
    found, stack = {}, [root]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            if isinstance(value.get("$anchor"), str):
                found.setdefault(f"#{value['$anchor']}", value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found


def _needs(schema: Any, pointer: str, nodes: _SchemaNodes, goals: _Goals) -> list[int]:
    """The goals a finite value of ``schema`` (at ``pointer``) needs, all of them (new goals for its
    either-or parts). Only recursion leaves a goal unmet: ``false`` and contradictions count as met here
    (the grammar engine refuses an unsatisfiable schema with its own reason)."""
    if not isinstance(schema, Mapping):
        return []
    needs = []
    ref = schema.get("$ref")
    target = nodes.resolve(ref) if isinstance(ref, str) else None
    if target is not None:
        needs.append(nodes.goal(*target))
    for key in ("allOf", "anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and members:
            parts = [nodes.goal(member, f"{pointer}/{key}/{i}") for i, member in enumerate(members)]
            needs += parts if key == "allOf" else [goals.add(parts, any_part=True)]
    if "const" not in schema and "enum" not in schema:  # (a literal's value is finite)
        given = schema.get("type", TYPES)
        kinds = {kind for kind in (given if isinstance(given, list) else [given]) if isinstance(kind, str)}
        kinds = kinds or set(TYPES)
        branches = [goals.add(_object_needs(schema, pointer, nodes, goals))] if "object" in kinds else []
        branches += [goals.add(_array_needs(schema, pointer, nodes))] if "array" in kinds else []
        if len(branches) == len(kinds):  # no other type, whose values are all finite
            needs.append(goals.add(branches, any_part=True))
    return needs


def _object_needs(schema: Mapping[str, Any], pointer: str, nodes: _SchemaNodes, goals: _Goals) -> list[int]:
    """An object value's needs: each required property's value, and one more property per
    ``minProperties`` past the required ones (every property schema is looked at: a value may hold any)."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    named = {key: nodes.goal(value, f"{pointer}/properties/{_escape(key)}") for key, value in properties.items()}
    patterns = schema.get("patternProperties")
    patterns = patterns if isinstance(patterns, Mapping) else {}
    matched = [nodes.goal(value, f"{pointer}/patternProperties/{_escape(key)}") for key, value in patterns.items()]
    extra = nodes.goal(schema.get("additionalProperties", True), f"{pointer}/additionalProperties")
    listed = schema.get("required")
    required = list(dict.fromkeys(key for key in listed if isinstance(key, str))) if isinstance(listed, list) else []
    needs = [named.get(key, extra) for key in required if key in named or not patterns]
    least = schema.get("minProperties")
    if isinstance(least, int) and least > len(required):
        others = [goal for key, goal in named.items() if key not in required] + matched + [extra]
        needs.append(goals.add(others, any_part=True))
    return needs


def _array_needs(schema: Mapping[str, Any], pointer: str, nodes: _SchemaNodes) -> list[int]:
    """An array value's needs: a value of each of its first ``minItems`` items (every item schema is looked
    at: a value may hold any)."""
    prefix, items, rest = schema.get("prefixItems"), schema.get("items", True), "items"
    if isinstance(items, list):  # draft 4-7's tuple form
        prefix, items, rest = items, schema.get("additionalItems", True), "additionalItems"
    prefix = prefix if isinstance(prefix, list) else []
    firsts = [nodes.goal(item, f"{pointer}/prefixItems/{i}") for i, item in enumerate(prefix)]
    others = nodes.goal(items, f"{pointer}/{rest}")
    least = schema.get("minItems")
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    return firsts[:least] + ([others] if least > len(prefix) else [])


def _escape(key: str) -> str:
    """A key as a JSON pointer writes it."""
    return key.replace("~", "~0").replace("/", "~1")
