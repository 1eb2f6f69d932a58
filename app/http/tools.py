"""Tools in a chat request: `tools`, `tool_choice`, `parallel_tool_calls`, validated; and the JSON schema a
forced tool choice constrains decoding to.

The tokenizer process parses the calls (app/tokenizer/tool_parsers.py); here the request is checked
and its tools travel on as plain dicts for the chat template. A forced choice (`required` or a named
function) becomes a json_schema GrammarSpec, param "tool_choice", that the structured-output engine
compiles and masks like any other (app/grammar).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import Field, ValidationError, field_validator

from app.grammar import JSON_SCHEMA
from app.http.body import StrictBody, fits_the_wire
from app.http.errors import bad_request
from app.protocol import GrammarSpec

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
    """The arguments schema a forced call follows: always an object (arguments are a JSON object)."""
    params = tool.function.parameters
    if params is None:
        return {"type": "object", "properties": {}}
    return params if "type" in params else {**params, "type": "object"}


def check_forced_tools(tools: list[ToolDef], tool_choice: ToolChoice | None) -> None:
    """A forced choice decodes arguments as their schema says: a schema for something other than an object
    could never be a call's arguments."""
    named = forced_tool_name(tool_choice)
    for i, tool in enumerate(tools):
        if named and tool.function.name != named:
            continue
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(f"invalid value for 'tools[{i}].function.parameters': a forced 'tool_choice' needs "
                              f"an object schema (arguments are a JSON object), not type {kind!r}",
                              param=f"tools[{i}].function.parameters")


def is_forced(tool_choice: ToolChoice | None) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)


def forced_call_schema(tools: list[ToolDef], tool_choice: ToolChoice | None, *,
                       parallel: bool = True) -> dict[str, Any] | None:
    """The JSON schema that decoding is constrained to for `required` or a named function (None otherwise).

    required: a non-empty array of {"name", "parameters"} objects, each a listed tool with arguments
    valid against its schema (what the json tool parser reads back), at most one when parallel is False;
    a named function: its arguments object alone (the call's name is known)."""
    if isinstance(tool_choice, NamedToolChoice):
        chosen = next(t for t in tools if t.function.name == tool_choice.function.name)
        return _parameters(chosen)
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)}} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_grammar(tools: list[ToolDef], tool_choice: ToolChoice | None, *, parallel: bool) -> GrammarSpec | None:
    """The structured-output constraint of a forced tool choice (compiled like a json_schema response_format)."""
    schema = forced_call_schema(tools, tool_choice, parallel=parallel)
    if schema is None:
        return None
    check_forced_tools(tools, tool_choice)
    return GrammarSpec(JSON_SCHEMA, json.dumps(schema), "tool_choice")


def forced_tool_name(tool_choice: ToolChoice | None) -> str:
    return tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else ""
