"""Tools and reasoning through the whole appliance (SmolLM2, a tools-aware chat template, both parsers on),
with the openai client."""

from __future__ import annotations

import json

import httpx
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
