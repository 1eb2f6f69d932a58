"""Tools and reasoning through the whole appliance (SmolLM2, a tools-aware chat template, both parsers on),
with the openai client; a forced tool_choice constrains the real model's decoding to a valid call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.support.agent_template import AGENT_TEMPLATE
from tests.support.appliance import Appliance

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
]


@pytest.fixture(scope="module")
def agents(smollm2_dir, log_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("agent-template") / "agent.jinja"
    template.write_text(AGENT_TEMPLATE)
    with Appliance(smollm2_dir, "--config", "configs/recipes/smollm2-135m-instruct.yaml", "--dtype", "float32",
                   "--chat-template", str(template), "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen",
                   log_dir=log_dir) as app:
        yield app


@pytest.fixture(scope="module")
def client(agents) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{agents.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_conversation_with_tool_results_is_rendered_and_answered(agents, client) -> None:
    ids = httpx.post(f"{agents.base_url}/tokenize", json={"messages": CONVERSATION, "tools": [WEATHER]},
                     timeout=60).json()["tokens"]
    prompt = httpx.post(f"{agents.base_url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tools, in the system turn
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert prompt.endswith("<tool_response>22 C and sunny</tool_response><|im_end|>\n<|im_start|>assistant\n")
    resp = client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=[WEATHER], temperature=0,
                                          max_tokens=8)
    choice = resp.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert resp.usage.prompt_tokens == len(ids)


def test_a_template_that_opens_the_block_makes_the_answer_reasoning(client) -> None:
    # Greedy output is the same text either way: split when the prompt opened <think>, whole otherwise.
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], temperature=0, max_tokens=8,
              extra_body={"chat_template_kwargs": {"open_thinking": True}})
    whole = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}})
    split = client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    assert split.choices[0].finish_reason == "length"  # the block never closed: all of it is reasoning
    assert split.choices[0].message.reasoning_content == text.strip() and not split.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == text.strip()


def test_tokenize_counts_what_the_engine_counts(agents, client) -> None:
    r = httpx.post(f"{agents.base_url}/v1/tokenize", json={"model": MODEL, "prompt": "The sky is"}, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    out = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == len(ids) == r.json()["count"]
    back = httpx.post(f"{agents.base_url}/detokenize", json={"tokens": ids}, timeout=60).json()
    assert back["text"] == "The sky is"
    body = json.loads(httpx.post(f"{agents.base_url}/tokenize", json={"prompt": "x", "messages": []},
                                 timeout=60).text)
    assert body["error"]["param"]


# Bounded strings keep the greedy 135M model's arguments short (a cut call would come back as content).
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False, "properties": {
        "city": {"type": "string", "maxLength": 24}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
FORCED_TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (FORECAST, TIME)}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
# A question the 135M model answers with one call (on ASK it repeats calls until max_tokens).
ASK_TIME = [{"role": "user", "content": "What time is it in UTC?"}]


def _valid_calls(calls) -> list[tuple[str, dict]]:
    """Each call names a listed tool and its arguments validate against that tool's schema."""
    out = []
    for call in calls or []:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, FORCED_TOOLS[call.function.name])
        out.append((call.function.name, args))
    assert out, "no tool call"
    return out


def test_tool_choice_required_returns_a_valid_call_streaming_or_not(client) -> None:
    """The server's parser is qwen; the forced answer is read with the json parser all the same."""
    kw = dict(model=MODEL, messages=ASK_TIME, tools=[TIME, FORECAST], tool_choice="required", temperature=0,
              max_tokens=64)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    calls = _valid_calls(whole.message.tool_calls)
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert _valid_calls(streamed.message.tool_calls) == calls  # greedy: the same call, assembled by the SDK
    # maxItems 1: the call array closes after one call where the model would have gone on.
    one = client.chat.completions.create(**{**kw, "messages": ASK}, parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls" and len(_valid_calls(one.message.tool_calls)) == 1


def test_a_named_tool_choice_returns_a_call_to_that_function(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = client.chat.completions.create(model=MODEL, messages=ASK, tools=[FORECAST, TIME], tool_choice=named,
                                            temperature=0, max_tokens=32).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [name for name, _ in _valid_calls(choice.message.tool_calls)] == ["get_time"]
