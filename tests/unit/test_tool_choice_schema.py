"""The JSON schema a forced tool choice constrains decoding to, and that the json parser reads its output."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from app.http.tools import NamedToolChoice, ToolDef, forced_call_schema
from app.tokenizer.tool_parsers import TOOL_FORMATS, extract_tool_calls

TOOLS = [ToolDef.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
)]


def _valid(schema: dict, value: object) -> bool:
    return Draft202012Validator(schema).is_valid(value)


def test_required_is_a_non_empty_array_of_listed_calls() -> None:
    schema = forced_call_schema(TOOLS, "required")
    assert schema is not None
    Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    assert _valid(schema, good)
    assert not _valid(schema, [])
    assert not _valid(schema, [{"name": "get_weather", "parameters": {}}])  # city is required
    assert not _valid(schema, [{"name": "launch", "parameters": {}}])
    # What the constrained model writes, the json parser turns into the calls.
    content, calls = extract_tool_calls(TOOL_FORMATS["json"], {"get_weather", "get_time"}, json.dumps(good))
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_a_named_function_is_its_arguments_schema() -> None:
    choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    schema = forced_call_schema(TOOLS, choice)
    assert schema == TOOLS[0].function.parameters
    assert _valid(schema, {"city": "Oslo"}) and not _valid(schema, {})


@pytest.mark.parametrize("choice", ["auto", "none", None])
def test_other_choices_do_not_constrain(choice: str | None) -> None:
    assert forced_call_schema(TOOLS, choice) is None  # type: ignore[arg-type]


def test_the_config_accepts_exactly_the_parsers_the_tokenizer_builds() -> None:
    """app.config names the parsers without importing the tokenizer: the two lists must stay equal."""
    from app.config.support import REASONING_PARSERS, TOOL_CALL_PARSERS
    from app.tokenizer.reasoning import REASONING_FORMATS
    from app.tokenizer.tool_parsers import TOOL_FORMATS

    assert sorted(REASONING_PARSERS) == sorted(REASONING_FORMATS)
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_FORMATS)
