"""The tokenizer core runs the parsers over real token ids: families whose tags are special tokens
(Kimi K2) are detokenized with them, so the calls parse; without tools the tags stay skipped."""

from __future__ import annotations

import json

import pytest

from app.protocol import (
    EngineInfo,
    EngineReady,
    GenerateRequest,
    SamplingParams,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
)
from app.tokenizer.core import TokenizerCore
from tests.support.agent_template import AGENT_TEMPLATE
from tests.support.tokenizer_factory import build_tokenizer

KIMI_TAGS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
             "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
ANSWER = ("<think>Look it up.</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
          '<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|><|tool_calls_section_end|>')
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": KIMI_TAGS})
    return tok


def _answer(tokenizer, *, tools: list, stream: bool) -> list:
    core = TokenizerCore(tokenizer, chat_template=AGENT_TEMPLATE, reasoning_parser="kimi_k25",
                         tool_call_parser="kimik2")
    core.handle(EngineReady(engine=EngineInfo(max_model_len=4096, vocab_size=len(tokenizer))))
    req = GenerateRequest("r", SamplingParams(max_new_tokens=200), messages=[{"role": "user", "content": "time?"}],
                          tools=tools, parse_tool_calls=bool(tools), separate_reasoning=True, stream=stream)
    core.handle(req)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    assert set(tokenizer.convert_tokens_to_ids(KIMI_TAGS)) <= set(ids)  # the tags are single special tokens
    deltas = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        for out in core.handle(TokenDeltas([TokenDelta("r", [tid], finish_reason="stop" if last else None,
                                                       completion_tokens=i + 1)])):
            if isinstance(out.msg, TextDeltas):
                deltas.extend(out.msg.deltas)
    return deltas


@pytest.mark.parametrize("stream", [True, False])
def test_special_token_tags_are_kept_for_the_tool_parser(tokenizer, stream: bool) -> None:
    deltas = _answer(tokenizer, tools=[TIME], stream=stream)
    assert "".join(d.reasoning_text for d in deltas) == "Look it up."
    assert "".join(d.text for d in deltas) == "Checking."
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [("functions.get_time:0", "get_time",
                                                                          {"tz": "UTC"})]
    assert len(deltas) > 1 if stream else len(deltas) == 1


def test_without_tools_special_tokens_stay_skipped(tokenizer) -> None:
    deltas = _answer(tokenizer, tools=[], stream=False)
    assert deltas[0].reasoning_text == "Look it up." and not deltas[0].tool_calls
    assert deltas[0].text == 'Checking.functions.get_time:0{"tz": "UTC"}'
