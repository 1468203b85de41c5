"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): the functions a chat request offers, how the model's
chat template writes them and the calls (:class:`ToolFormat`), the grammar that holds the output to a call
where the request requires one, and the calls parsed out of the finished text.

Three formats, as vLLM's and llama.cpp's parsers read them:

- ``hermes`` (Qwen2.5, Qwen3, Hermes: templates that write ``<tool_call>``): the template lists the tools;
  the model writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, possibly several;
- ``llama3_json`` (Llama 3.1-3.3: templates that take ``tools`` and ask for ``"parameters"``): the
  template lists them; the model writes one ``{"name": ..., "parameters": {...}}``, possibly after
  ``<|python_tag|>``;
- ``generic`` (every other template, SmolLM2's among them; llama.cpp's generic format): a system message
  lists the tools and asks for ``{"tool_calls": [{"name", "arguments"}]}`` or ``{"response": "..."}``,
  and the output is always held to that JSON.

``tool_choice`` ``"auto"`` lets a hermes or llama3 model answer in text or call (the output is parsed
afterwards, as vLLM does); ``"required"`` or a function's name holds the output to calls (of that
function) with their parameters' schemas."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..arguments import brief
from ..errors import RequestError
from .structured import JSON_LAYOUT, StructuredOutput, check_finite_schema

MAX_TOOLS = 128
"""The most functions one request may offer (OpenAI's limit)."""

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name as OpenAI takes it."""

ANY_PARAMETERS: dict[str, Any] = {"type": "object"}
"""The parameters' schema of a function that gives none."""


class ToolFormat(Enum):
    """How a chat template writes tools and calls (see the module docstring)."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    GENERIC = "generic"


def tool_format(chat_template: str | None) -> ToolFormat:
    """The tool format of a model's chat template."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "tools" in template and '"parameters"' in template:
        return ToolFormat.LLAMA3_JSON
    return ToolFormat.GENERIC


@dataclass(frozen=True)
class Function:
    """One function a request offers: its ``name``, ``description`` and ``parameters`` (a JSON schema of
    its arguments object, as JSON text)."""

    name: str
    description: str | None = None
    parameters: str | Mapping[str, Any] = json.dumps(ANY_PARAMETERS)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not FUNCTION_NAME.fullmatch(self.name):
            raise RequestError(f"a function name must match [A-Za-z0-9_-]{{1,64}}, got {brief(self.name)}", "tools")
        if self.description is not None and not isinstance(self.description, str):
            raise RequestError(
                f"function {self.name}: description must be a str, got {brief(self.description)}", "tools"
            )
        parameters = self.parameters
        try:
            parsed = json.loads(parameters) if isinstance(parameters, str) else parameters
            text = json.dumps(parsed, separators=(",", ":")) if isinstance(parsed, Mapping) else None
        except (ValueError, TypeError, RecursionError):
            text = None
        if text is None:
            message = f"function {self.name}: parameters must be a JSON schema object, got {brief(parameters)}"
            raise RequestError(message, "tools")
        try:  # written into the prompt: no lone surrogate (JSON's \\ud800 escape alone), as in messages
            json.dumps([self.description, parsed], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            message = f"function {self.name}: its description or parameters are not valid Unicode ({exc.reason})"
            raise RequestError(message, "tools") from None
        check_finite_schema(parsed, "tools", f"function {self.name}: the parameters' JSON schema")
        object.__setattr__(self, "parameters", text)

    @property
    def schema(self) -> dict[str, Any]:
        """Its parameters' schema, parsed."""
        assert isinstance(self.parameters, str)
        return json.loads(self.parameters)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request writes it (what chat templates are given)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCalling:
    """The tools of a request: ``functions`` (1 to :data:`MAX_TOOLS`, distinct names), ``choice``
    (``"auto"``, ``"required"`` or one function's name) and ``parallel`` (several calls in one answer)."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        functions = tuple(self.functions)
        object.__setattr__(self, "functions", functions)
        if not 1 <= len(functions) <= MAX_TOOLS or not all(isinstance(f, Function) for f in functions):
            raise RequestError(f"tools must hold 1 to {MAX_TOOLS} functions, got {brief(self.functions)}", "tools")
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise RequestError(f"tools must have distinct function names, got {names[:8]}", "tools")
        if self.choice not in ("auto", "required") and self.choice not in names:
            message = (
                f"tool_choice must be auto, required or one of the tools' names {names[:8]}, got {brief(self.choice)}"
            )
            raise RequestError(message, "tool_choice")

    @property
    def offered(self) -> tuple[Function, ...]:
        """The functions the answer may call (the named one, where ``choice`` names one)."""
        return tuple(f for f in self.functions if self.choice in ("auto", "required", f.name))


@dataclass
class ToolCall:
    """A call the model made: the function's ``name`` and its ``arguments`` as JSON text (OpenAI's form)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# the prompt -------------------------------------------------------------------------------------------


def tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: ToolCalling, form: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument to render ``messages`` with: for hermes and llama3 templates
    the messages as they are and the tools in OpenAI's form; for the generic format, the messages after a
    system message that describes the tools and the JSON to answer with (joined to the first system message
    where there is one), and no ``tools`` argument."""
    messages = [dict(message) for message in messages]
    if form is not ToolFormat.GENERIC:
        return messages, [f.openai() for f in tools.offered]
    instructions = generic_instructions(tools)
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{instructions}"
        return messages, None
    return [{"role": "system", "content": instructions}, *messages], None


def generic_instructions(tools: ToolCalling) -> str:
    """The generic format's system text: the tools, one JSON line each, and the answer's JSON shapes."""
    lines = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in tools.offered)
    calls = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    answer = f"Answer with a JSON object: {calls} to call tools"
    if tools.choice == "auto":
        answer += ', or {"response": "<your answer>"} to answer directly'
    return f"You can call these tools:\n{lines}\n{answer}."


def plain_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template without tools: an assistant message's ``tool_calls`` written as the generic
    format's JSON in its content."""
    plain = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if calls:
            written = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
            message["content"] = json.dumps({"tool_calls": written}, ensure_ascii=False)
        message.pop("tool_call_id", None)
        plain.append(message)
    return plain


# the grammar --------------------------------------------------------------------------------------------


def call_schema(function: Function, arguments: str) -> dict[str, Any]:
    """The JSON schema of one call of ``function``, its arguments under the key ``arguments``."""
    properties = {"name": {"const": function.name}, arguments: function.schema}
    return {"type": "object", "properties": properties, "required": ["name", arguments], "additionalProperties": False}


def calls_schema(tools: ToolCalling, arguments: str = "arguments") -> dict[str, Any]:
    """A call of any offered function."""
    options = [call_schema(f, arguments) for f in tools.offered]
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_constraint(tools: ToolCalling, form: ToolFormat) -> StructuredOutput | None:
    """The grammar the output is held to (None: free text, parsed afterwards: ``auto`` with hermes or llama3)."""
    if tools.choice == "auto" and form is not ToolFormat.GENERIC:
        return None
    if form is ToolFormat.LLAMA3_JSON:
        return StructuredOutput(json_schema=calls_schema(tools, "parameters"), param="tools")
    if form is ToolFormat.HERMES:
        schema = {**calls_schema(tools), "x-guidance": JSON_LAYOUT}
        call = f'"<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
        more = ' ("\\n" call)*' if tools.parallel else ""
        return StructuredOutput(lark=f"start: call{more}\ncall: {call}\n", param="tools")
    array = {
        "type": "array",
        "items": calls_schema(tools),
        "minItems": 1,
        **({} if tools.parallel else {"maxItems": 1}),
    }
    answer = {
        "type": "object",
        "properties": {"tool_calls": array},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if tools.choice == "auto":
        text = {
            "type": "object",
            "properties": {"response": {"type": "string"}},
            "required": ["response"],
            "additionalProperties": False,
        }
        answer = {"anyOf": [answer, text]}
    return StructuredOutput(json_schema=answer, param="tools")


# the answer ---------------------------------------------------------------------------------------------

HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_tool_calls(text: str, form: ToolFormat) -> tuple[str | None, list[ToolCall]]:
    """The message content and the tool calls in a finished output ``text`` (no calls: the whole text is
    the content; an output that does not parse as calls is content too, as vLLM's parsers do)."""
    try:
        if form is ToolFormat.HERMES:
            return hermes_calls(text)
        if form is ToolFormat.LLAMA3_JSON:
            return llama3_calls(text)
        return generic_calls(text)
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []


def hermes_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = [json.loads(a or b) for a, b in HERMES_CALL.findall(text)]
    content = text[:start].strip() or None
    return content, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]


def llama3_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = [json.loads(part) for part in body.split(";") if part.strip()]
    found = [
        ToolCall(c["name"], json.dumps(c.get("parameters", c.get("arguments")), ensure_ascii=False)) for c in calls
    ]
    return None, found


def generic_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    answer = json.loads(text)
    if "tool_calls" in answer:
        calls = answer["tool_calls"]
        return None, [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls]
    return str(answer["response"]), []
