"""Tools in a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, validated; and the JSON schema a
forced tool choice constrains decoding to.

The tokenizer process parses the calls (app/tokenizer/tool_parsers.py); here the request is checked
and its tools travel on as plain dicts for the chat template.
"""

from __future__ import annotations

from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import Field, ValidationError, field_validator

from app.http.body import StrictBody, fits_the_wire
from app.http.errors import bad_request

TOOL_CHOICE_MODES = ("none", "auto", "required")


class FunctionDef(StrictBody):
    # OpenAI: letters, digits, underscores and dashes, at most 64; dots and colons are allowed too
    # (namespaced names such as Kimi's).
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        fits_the_wire(value)
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path)
            raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
        return value


class ToolDef(StrictBody):
    type: Literal["function"]
    function: FunctionDef

    def to_engine(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
TOOL_CHOICE_SCHEMA: dict[str, Any] = {"anyOf": [
    {"enum": list(TOOL_CHOICE_MODES)}, {"type": "null"},
    {"type": "object", "additionalProperties": False, "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {
            "type": "object", "additionalProperties": False, "required": ["name"],
            "properties": {"name": {"type": "string"}}}}}]}


def parse_tool_choice(value: Any) -> ToolChoice | None:
    """A field validator: one message for every wrong shape (a union's errors would name its branches)."""
    if value is None or value in TOOL_CHOICE_MODES:
        return value
    if isinstance(value, dict):
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError:
            pass
    raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def check_tools(tools: list[ToolDef] | None, tool_choice: ToolChoice | None) -> None:
    """The cross-field rules pydantic cannot state: names unique, a choice needs tools and names one."""
    names = [t.function.name for t in tools or []]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"invalid value for 'tools': two tools are named {duplicate!r}", param="tools")
    if tool_choice is None or tool_choice == "none":
        return
    if not names:
        raise bad_request("'tool_choice' needs 'tools': list the tools the model may call", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise bad_request(f"invalid value for 'tool_choice': no tool in 'tools' is named "
                          f"{tool_choice.function.name!r} (tools: {', '.join(names)})", param="tool_choice")


def _parameters(tool: ToolDef) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_call_schema(tools: list[ToolDef], tool_choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema that decoding is constrained to for `required` or a named function (None otherwise).

    required: a non-empty array of {"name", "parameters"} objects, each a listed tool with arguments
    valid against its schema (what the json tool parser reads back); a named function: its arguments
    object alone (the call's name is known)."""
    if isinstance(tool_choice, NamedToolChoice):
        chosen = next(t for t in tools if t.function.name == tool_choice.function.name)
        return _parameters(chosen)
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)}} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
