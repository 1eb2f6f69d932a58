"""The JSON schema a forced tool choice constrains decoding to, and that the json parser reads its output."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from app.http.tools import NamedToolChoice, ToolDef, forced_call_schema, forced_grammar
from app.tokenizer.tool_parsers import TOOL_FORMATS, arguments_format, extract_tool_calls

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


def test_parallel_false_allows_one_call_and_arguments_are_objects() -> None:
    schema = forced_call_schema(TOOLS, "required", parallel=False)
    one = {"name": "get_time", "parameters": {}}
    assert _valid(schema, [one]) and not _valid(schema, [one, one])
    assert not _valid(schema, [{"name": "get_time", "parameters": 3}])  # no parameters: still an object
    untyped = ToolDef.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"x": {"type": "integer"}}}}})
    assert forced_call_schema([untyped], NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "f"}}))["type"] == "object"


def test_the_forced_grammar_is_a_json_schema_named_tool_choice() -> None:
    spec = forced_grammar(TOOLS, "required", parallel=True)
    assert spec is not None and (spec.kind, spec.param) == ("json_schema", "tool_choice")
    assert json.loads(spec.value) == forced_call_schema(TOOLS, "required")
    assert forced_grammar(TOOLS, "auto", parallel=True) is None


def test_a_named_answer_is_one_call_to_that_tool() -> None:
    fmt = arguments_format("get_weather")
    content, calls = extract_tool_calls(fmt, {"get_weather"}, '{"city": "Oslo"}')
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    for text in ('{"city": "Os', "[1]", "Oslo"):  # cut by max_tokens, or not an object: the text is content
        assert extract_tool_calls(fmt, {"get_weather"}, text) == (text, [])


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
