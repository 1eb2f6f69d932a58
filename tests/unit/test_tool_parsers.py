"""Tool-call parsers over each family's real output format, chunked at every boundary."""

from __future__ import annotations

import json

import pytest

from app.tokenizer.tool_parsers import TOOL_FORMATS, ToolCallExtractor, extract_tool_calls

NAMES = {"get_weather", "get_time"}

# (parser, model output, expected content, expected [(name, arguments)], expected ids or None)
CASES = [
    ("qwen", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})], None),
    ("qwen", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})], None),
    # Unclosed at the end of the answer (stopped on EOS right after the JSON): still a call.
    ("qwen", '<tool_call>\n{"name": "get_time", "arguments": {}}', "", [("get_time", {})], None),
    # Malformed JSON, an unknown tool: the text comes back as content.
    ("qwen", '<tool_call>\n{"name": "get_time", "arguments": {</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {</tool_call>', [], None),
    ("qwen", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> done',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>done', [], None),
    ("qwen", "No tools needed: 3 < 4.", "No tools needed: 3 < 4.", [], None),
    ("json", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]',
     "", [("get_weather", {"city": "Oslo"}), ("get_time", {})], None),
    ("json", ' {"name": "get_time", "arguments": {"tz": "UTC"}}', "", [("get_time", {"tz": "UTC"})], None),
    ("json", "Plain text {not a call}", "Plain text {not a call}", [], None),
    ("json", '{"name": "get_time"', '{"name": "get_time"', [], None),
    ("kimik2", "I will look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     '<|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
     '<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>',
     "I will look.", [("get_weather", {"city": "Beijing"}), ("get_time", {})],
     ["functions.get_weather:0", "functions.get_time:1"]),
    ("deepseek_v4", 'Checking.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
     '<｜DSML｜parameter name="city" string="true">San Francisco</｜DSML｜parameter>\n'
     '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
     "</｜DSML｜function_calls>", "Checking.", [("get_weather", {"city": "San Francisco", "days": 3})], None),
]


def _run(name: str, chunks: list[str], parallel: bool = True) -> tuple[str, list]:
    fmt = TOOL_FORMATS[name]
    assert fmt is not None
    extractor = ToolCallExtractor(fmt, NAMES, parallel=parallel)
    content, calls = "", []
    for chunk in chunks:
        c, k = extractor.feed(chunk)
        content += c
        calls += k
    c, k = extractor.flush()
    return content + c, calls + k


def _plain(calls: list) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "output", "content", "calls", "ids"), CASES)
def test_whole_output(name: str, output: str, content: str, calls: list, ids: list | None) -> None:
    fmt = TOOL_FORMATS[name]
    assert fmt is not None
    got_content, got = extract_tool_calls(fmt, NAMES, output)
    assert (got_content, _plain(got)) == (content, calls)
    if ids is not None:
        assert [c.id for c in got] == ids
    assert all(c.id for c in got) and len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("name", "output", "content", "calls", "ids"), CASES)
def test_every_chunking_gives_the_same_calls(name: str, output: str, content: str, calls: list,
                                             ids: list | None) -> None:
    got_content, got = _run(name, list(output))
    assert (got_content, _plain(got)) == (content, calls)
    for i in range(len(output) + 1):
        got_content, got = _run(name, [output[:i], output[i:]])
        assert (got_content, _plain(got)) == (content, calls), i


def test_a_call_is_sent_as_soon_as_its_block_closes() -> None:
    fmt = TOOL_FORMATS["qwen"]
    assert fmt is not None
    extractor = ToolCallExtractor(fmt, NAMES)
    assert extractor.feed("Sure. <tool_") == ("Sure.", [])
    content, calls = extractor.feed('call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "" and _plain(calls) == [("get_time", {})]
    assert extractor.num_calls == 1


def test_parallel_false_keeps_the_first_call() -> None:
    _, output, _, calls, _ = CASES[1]
    assert _plain(_run("qwen", [output], parallel=False)[1]) == calls[:1]


def test_passthrough_has_no_parser() -> None:
    assert TOOL_FORMATS["passthrough"] is None
