"""Tools, reasoning, /tokenize and client extensions through a real uvicorn and the openai client.

Behind the HTTP process runs the real TokenizerCore (with a real byte-level tokenizer, the parsers
and the chat template), fed a scripted answer one token per delta: the answer is known, so each
reasoning/content/tool-call split is checked exactly, streaming and not.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from app.protocol import (
    EngineInfo,
    EngineReady,
    GenerateRequest,
    TextDelta,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
    TokenizedRequest,
)
from app.tokenizer import tokenize_ops
from app.tokenizer.core import TokenizerCore
from tests.support.agent_template import AGENT_TEMPLATE
from tests.support.tokenizer_factory import build_tokenizer
from tests.unit.test_http_fakes import MODEL, FakeEngine, LiveServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ONE_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
THINKING = "<think>\nThe user wants a number.\n</think>\n\nIt is 42."


class CoreEngine(FakeEngine):
    """Answers each request with `answer` through a real TokenizerCore; keeps each rendered prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.answer = ""
        self.prompts: list[str] = []
        self.grammars: list[Any] = []  # each request's output constraint
        super().__init__(script=self._run)
        self.control_reply = lambda msg: tokenize_ops.handle(msg, tokenizer, chat_template=AGENT_TEMPLATE,
                                                             vocab_size=len(tokenizer))

    def _core(self) -> TokenizerCore:
        core = TokenizerCore(self.tokenizer, chat_template=AGENT_TEMPLATE, reasoning_parser="qwen3",
                             tool_call_parser="qwen")
        core.handle(EngineReady(engine=EngineInfo(max_model_len=2048, vocab_size=len(self.tokenizer), max_top_logprobs=20)))
        return core

    def _run(self, req: GenerateRequest) -> list[TextDelta]:
        core = self._core()
        # The scripted answer stands for the constrained model (masking is the appliance tests' part):
        # keep the constraint to check it, and let the core go on without compiling it.
        self.grammars.append(req.sampling.grammar)
        req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, grammar=None))
        (first,) = core.handle(req)
        if not isinstance(first.msg, TokenizedRequest):
            return first.msg.deltas  # the tokenizer refused it
        self.prompts.append(self.tokenizer.decode(first.msg.prompt_ids))
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ids = [*self.tokenizer.encode(self.answer, add_special_tokens=False), eos]
        out: list[TextDelta] = []
        for i, tid in enumerate(ids):
            last = i == len(ids) - 1
            delta = TokenDelta(req.rid, [tid], finish_reason="stop" if last else None, matched_stop=eos if last else None,
                               prompt_tokens=len(first.msg.prompt_ids), completion_tokens=i + 1)
            for sent in core.handle(TokenDeltas([delta])):
                if isinstance(sent.msg, TextDeltas):
                    out.extend(sent.msg.deltas)
        return out


@pytest.fixture(scope="module")
def engine() -> CoreEngine:
    return CoreEngine(build_tokenizer())


@pytest.fixture(scope="module")
def server(engine: CoreEngine) -> Iterator[LiveServer]:
    with LiveServer(engine, reasoning_parser="qwen3", tool_call_parser="qwen") as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def _ask(engine: CoreEngine, client: openai.OpenAI, answer: str, **kw: Any) -> Any:
    engine.answer = answer
    kw.setdefault("messages", [{"role": "user", "content": "What is the weather in Paris?"}])
    return client.chat.completions.create(model=MODEL, **kw)


def _calls(calls: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []]


# ---------------------------------------------------------------- tools


def test_a_call_with_text_before_it(engine: CoreEngine, client: openai.OpenAI) -> None:
    choice = _ask(engine, client, ONE_CALL, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert '"name": "get_weather"' in engine.prompts[-1]  # the template listed the tools


def test_the_sdk_stream_helper_assembles_the_same_calls(engine: CoreEngine, client: openai.OpenAI) -> None:
    whole = _ask(engine, client, TWO_CALLS, tools=[WEATHER, TIME]).choices[0]
    engine.answer = TWO_CALLS
    messages = [{"role": "user", "content": "Weather and time?"}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER, TIME]) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert _calls(streamed.message.tool_calls) == _calls(whole.message.tool_calls) == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert not streamed.message.content and whole.message.content is None


def test_stream_deltas_follow_openai(engine: CoreEngine, client: openai.OpenAI) -> None:
    chunks = list(_ask(engine, client, TWO_CALLS, tools=[WEATHER, TIME], stream=True))
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    firsts = [p for p in parts if p.id]
    assert [(p.index, p.function.name, p.type) for p in firsts] == [(0, "get_weather", "function"),
                                                                     (1, "get_time", "function")]
    for p in parts:  # later deltas of a call carry only argument fragments
        assert p.id or (p.function.name is None and p.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_parallel_tool_calls_false_keeps_one(engine: CoreEngine, client: openai.OpenAI) -> None:
    msg = _ask(engine, client, TWO_CALLS, tools=[WEATHER, TIME], parallel_tool_calls=False).choices[0].message
    assert _calls(msg.tool_calls) == [("get_weather", {"city": "Paris"})]


def test_malformed_or_unknown_calls_come_back_as_content(engine: CoreEngine, client: openai.OpenAI) -> None:
    for answer in ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
                   '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'):
        choice = _ask(engine, client, answer, tools=[WEATHER]).choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (answer, None, "stop")


def test_tool_choice_none_leaves_the_text_alone(engine: CoreEngine, client: openai.OpenAI) -> None:
    choice = _ask(engine, client, ONE_CALL, tools=[WEATHER], tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (ONE_CALL, None, "stop")


def test_a_conversation_with_tool_results_is_rendered(engine: CoreEngine, client: openai.OpenAI) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"},
    ]
    choice = _ask(engine, client, "It is 22 C and sunny in Paris.", tools=[WEATHER], messages=messages).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("It is 22 C and sunny in Paris.", "stop")
    prompt = engine.prompts[-1]
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool_response>22 C and sunny</tool_response>" in prompt


def _forced_schema(engine: CoreEngine) -> dict:
    spec = engine.grammars[-1]
    assert spec is not None and (spec.kind, spec.param) == ("json_schema", "tool_choice")
    return json.loads(spec.value)


def test_required_is_constrained_and_read_with_the_json_parser(engine: CoreEngine, client: openai.OpenAI) -> None:
    """The server's parser is qwen: the forced answer (a JSON array of calls) is still read as calls."""
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    choice = _ask(engine, client, answer, tools=[WEATHER, TIME], tool_choice="required").choices[0]
    schema = _forced_schema(engine)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    _ask(engine, client, answer, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert _forced_schema(engine)["maxItems"] == 1
    engine.answer = answer
    messages = [{"role": "user", "content": "Weather and time?"}]
    with client.chat.completions.stream(model=MODEL, messages=messages, tools=[WEATHER, TIME],
                                        tool_choice="required") as stream:
        chunks = list(stream)
        streamed = stream.get_final_completion().choices[0]
    assert _calls(streamed.message.tool_calls) == _calls(choice.message.tool_calls)
    assert streamed.finish_reason == "tool_calls"
    firsts = [tc for c in chunks if c.type == "chunk" for tc in (c.chunk.choices[0].delta.tool_calls or []) if tc.id]
    assert [(p.index, p.function.name) for p in firsts] == [(0, "get_weather"), (1, "get_time")]


def test_a_named_choice_makes_the_answer_its_arguments(engine: CoreEngine, client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = _ask(engine, client, '{"city": "Oslo"}', tools=[WEATHER, TIME], tool_choice=named).choices[0]
    assert _forced_schema(engine) == WEATHER["function"]["parameters"]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Oslo"})]
    chunks = list(_ask(engine, client, '{"city": "Oslo"}', tools=[WEATHER, TIME], tool_choice=named, stream=True))
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(p.index, p.id is not None, p.function.name) for p in parts] == [(0, True, "get_weather"), (0, False, None)]
    assert json.loads(parts[1].function.arguments) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    cut = _ask(engine, client, '{"city": "Os', tools=[WEATHER], tool_choice=named).choices[0]
    assert (cut.message.content, cut.message.tool_calls) == ('{"city": "Os', None)  # a cut call stays text
    # The server runs the qwen3 reasoning parser, but a forced answer is a call from its first token:
    # nothing is split off as reasoning.
    thought = _ask(engine, client, "<think>a</think>", tools=[WEATHER], tool_choice=named).choices[0].message
    assert thought.content == "<think>a</think>" and getattr(thought, "reasoning_content", None) is None


def test_forced_choices_need_no_server_parser(engine: CoreEngine) -> None:
    with LiveServer(engine) as live:
        engine.answer = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                "tool_choice": "required"}
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Rome"})


# ---------------------------------------------------------------- reasoning


def test_reasoning_is_split_streaming_and_not(engine: CoreEngine, client: openai.OpenAI) -> None:
    msg = _ask(engine, client, THINKING).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("The user wants a number.", "It is 42.")
    chunks = list(_ask(engine, client, THINKING, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants a number."
    assert "".join(d.content or "" for d in deltas) == "It is 42."


def test_enable_thinking_false_and_templates_that_open_the_block(engine: CoreEngine, client: openai.OpenAI) -> None:
    off = _ask(engine, client, "Just 42.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, "Just 42.")
    # The switch turns the parser off: even think tags stay in the content.
    raw = _ask(engine, client, "<think>a</think>b", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert raw.choices[0].message.content == "<think>a</think>b"
    opened = _ask(engine, client, "Counting.\n</think>\n\n42.", extra_body={"chat_template_kwargs":
                                                                          {"open_thinking": True}})
    assert (opened.choices[0].message.reasoning_content, opened.choices[0].message.content) == ("Counting.", "42.")


def test_reasoning_then_a_call(engine: CoreEngine, client: openai.OpenAI) -> None:
    choice = _ask(engine, client, "<think>Need the weather.</think>\n" + ONE_CALL, tools=[WEATHER]).choices[0]
    assert choice.message.reasoning_content == "Need the weather."
    assert _calls(choice.message.tool_calls) == [("get_weather", {"city": "Paris"})]


def test_separate_reasoning_false_keeps_the_text(engine: CoreEngine, client: openai.OpenAI) -> None:
    msg = _ask(engine, client, THINKING, extra_body={"separate_reasoning": False}).choices[0].message
    assert msg.content == THINKING and getattr(msg, "reasoning_content", None) is None


# ---------------------------------------------------------------- client extensions and /tokenize


def test_continuous_usage_stats_and_absent_model(engine: CoreEngine, server: LiveServer) -> None:
    engine.answer = "It is 42."
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages) and chunks[0]["model"] == MODEL
    completions = [u["completion_tokens"] for u in usages]
    assert completions == sorted(completions) and completions[-1] > 0
    assert usages[-1]["total_tokens"] == usages[-1]["prompt_tokens"] + completions[-1]


def test_tokenize_and_detokenize(engine: CoreEngine, server: LiveServer) -> None:
    tok = engine.tokenizer
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    r = httpx.post(f"{server.url}/v1/tokenize", json={"model": MODEL, "prompt": ["a b", "c"]}, timeout=30)
    assert r.json()["tokens"] == [tok.encode("a b"), tok.encode("c")]
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=30)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()
    assert text["prompt"] == text["text"] and '"name": "get_weather"' in text["prompt"]
    assert text["prompt"].endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # Ids outside the vocabulary, or beyond 64 bits (they could not cross the wire), are 400s naming them.
    for tokens, param in (([[10**9]], "tokens[0][0]"), ([2**70], "tokens[0]"), ([-1], "tokens[0]")):
        r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "chat_template_kwargs": {"a": 2**70}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(("patch", "param", "fragment"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice",
     "no tool in 'tools' is named 'other'"),
    ({"tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "'tool_choice' and 'response_format' cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "guided_regex": "a+"}, "guided_regex", "'tool_choice' and 'guided_regex' cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "needs an object schema"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**70}}}]},
     "tools[0].function.parameters", "cannot be passed"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", ""),
    ({"stream": True, "stream_options": {"continuous_usage_stat": True}},
     "stream_options.continuous_usage_stat", "unknown parameter"),
    ({"messages": [{"role": "tool", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0]", "only an assistant message may carry tool_calls"),
])
def test_bad_agent_input_is_a_400_naming_the_field(server: LiveServer, patch: dict, param: str, fragment: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **patch}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


def test_tools_need_a_parser(engine: CoreEngine) -> None:
    with LiveServer(engine) as live:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        engine.answer = THINKING  # without --reasoning-parser the text is the content
        r = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=30)
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": THINKING}


def test_vllm_and_sglang_extensions(engine: CoreEngine, client: openai.OpenAI) -> None:
    kept = _ask(engine, client, "One. Two. Three.", stop=["Two"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "One. Two"
    assert _ask(engine, client, "One. Two.", stop=["Two"]).choices[0].message.content == "One. "
    dropped = _ask(engine, client, THINKING, extra_body={"include_reasoning": False}).choices[0].message
    assert dropped.content == "It is 42." and getattr(dropped, "reasoning_content", None) is None
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One, two,"}]
    _ask(engine, client, " three.", messages=messages, extra_body={"continue_final_message": True})
    assert engine.prompts[-1].endswith("<|im_start|>assistant\nOne, two,")  # no end of turn, no new header
    _ask(engine, client, "ok", extra_body={"add_generation_prompt": False})
    assert engine.prompts[-1].endswith("What is the weather in Paris?<|im_end|>\n")


@pytest.mark.parametrize(("patch", "param"), [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"model": None}, "model"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
])
def test_unbuilt_extensions_are_refused_by_name(server: LiveServer, patch: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **patch}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_refuses_text_that_cannot_fit_the_context(engine: CoreEngine) -> None:
    import dataclasses

    from tests.unit.test_http_fakes import ENGINE

    with LiveServer(CoreEngine(engine.tokenizer)) as live:
        live.engine.become_ready(dataclasses.replace(ENGINE, max_token_chars=4))  # 2048 tokens of <= 4 chars
        r = httpx.post(f"{live.url}/tokenize", json={"prompt": ["ok", "x" * 9000]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1]", r.text
        r = httpx.post(f"{live.url}/tokenize", json={"messages": [{"role": "user", "content": "x" * 9000}]},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
