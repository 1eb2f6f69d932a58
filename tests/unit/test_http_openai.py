"""/v1/completions, /v1/chat/completions and /v1/models through build_app and httpx.ASGITransport."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.unit.test_http_fakes import (
    MODEL,
    MODEL_PATH,
    PIECES,
    FakeEngine,
    asgi_client,
    assert_error,
    script_error,
    script_pieces,
    sse,
)

pytestmark = pytest.mark.anyio
FULL = "".join(PIECES)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------- completions


async def test_completion_basic() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Say hello to me"})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": FULL, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    (req,) = engine.generates
    assert req.rid == body["id"] and req.text == "Say hello to me" and not req.stream
    assert req.sampling.max_new_tokens == 16  # OpenAI's completions default


async def test_completion_maps_every_sampling_parameter() -> None:
    engine = FakeEngine()
    payload = {
        "model": MODEL_PATH, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
        "logit_bias": {"11": -100, "12": 5.5}, "seed": 7, "stop": "\n", "stop_token_ids": [2, 3],
        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "user": "someone",
    }
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json=payload)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    (req,) = engine.generates
    s = req.sampling
    assert req.input_ids == [5, 6, 7] and req.text is None
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (3, 0.5, 0.9, 40, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logit_bias == {11: -100.0, 12: 5.5} and s.seed == 7 and s.stop == ["\n"]
    assert s.stop_token_ids == [2, 3] and s.ignore_eos and s.min_new_tokens == 2 and not s.skip_special_tokens
    assert not s.logprobs


async def test_completion_prompts_and_n_fan_out() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["one two", "three"], "n": 2,
                                                  "seed": 10, "max_tokens": 2})
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert all(ch["text"] == "Hello world" for ch in body["choices"])
    rids = [g.rid for g in engine.generates]
    assert rids == [f"{body['id']}-{i}" for i in range(4)]
    assert [g.text for g in engine.generates] == ["one two", "one two", "three", "three"]
    assert [g.sampling.seed for g in engine.generates] == [10, 11, 10, 11]
    # the prompt counts once per prompt, completions for every choice
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


async def test_completion_token_id_batches() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3, 4, 5]]})
    assert len(r.json()["choices"]) == 2
    assert [g.input_ids for g in engine.generates] == [[1, 2], [3, 4, 5]]


async def test_completion_echo() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        text = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi there", "echo": True})
        ids = await c.post("/v1/completions", json={"model": MODEL, "prompt": [4, 5], "echo": True})
    assert text.json()["choices"][0]["text"] == "Hi there" + FULL
    assert ids.json()["choices"][0]["text"] == "<decoded prompt>" + FULL
    assert all(g.return_prompt_ids for g in engine.generates)


async def test_completion_logprobs_format() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 2, "max_tokens": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert engine.generates[0].sampling.logprobs and engine.generates[0].sampling.top_logprobs == 2
    assert lp["tokens"] == ["Hello", " world"]
    assert lp["token_logprobs"] == [-0.5, -1.0]
    assert lp["text_offset"] == [0, 5]
    assert lp["top_logprobs"] == [{"<100>": -0.5, "<300>": -0.75, "Hello": -0.5},
                                  {"<101>": -1.0, "<300>": -1.25, " world": -1.0}]


async def test_completion_logprobs_zero_lists_the_sampled_token() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 0, "max_tokens": 1})
    assert r.json()["choices"][0]["logprobs"]["top_logprobs"] == [{"Hello": -0.5}]


async def test_completion_stream_with_usage() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "stream": True, "max_tokens": 3,
                                                  "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["Hello", " world", ","]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, "length"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert engine.generates[0].stream


async def test_completion_stream_without_usage_has_no_usage_field() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True})
    chunks = sse(r.text)[:-1]
    assert chunks and all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == FULL


async def test_stream_lines_survive_text_that_splitlines_breaks_at() -> None:
    """Token text may hold U+0085, U+2028 or U+2029, which JSON keeps raw but str.splitlines (httpx's
    aiter_lines, many SSE readers) breaks a line at: each data line must still parse whole."""
    pieces = ["a\x85", "b\u2028", "c\u2029", "d\x1c", "\ne\r"]
    async with asgi_client(FakeEngine(script_pieces(pieces))) as c:
        async with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(pieces)


async def test_completion_stream_echo_and_logprob_offsets() -> None:
    async with asgi_client(FakeEngine()) as c:
        echo = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True, "echo": True,
                                                     "max_tokens": 2})
        lps = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True, "logprobs": 1,
                                                    "max_tokens": 3})
    texts = [c["choices"][0]["text"] for c in sse(echo.text)[:-1]]
    assert texts == ["HiHello", " world"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in sse(lps.text)[:-1]]
    assert offsets == [[0], [5], [11]]


async def test_cache_report() -> None:
    engine = FakeEngine(script=script_pieces(cached=3))
    body = {"model": MODEL, "prompt": "a b c d"}
    async with asgi_client(engine) as c:
        plain = (await c.post("/v1/completions", json=body)).json()["usage"]
    async with asgi_client(engine, enable_cache_report=True) as c:
        reported = (await c.post("/v1/completions", json=body)).json()["usage"]
    assert "prompt_tokens_details" not in plain
    assert reported["prompt_tokens_details"] == {"cached_tokens": 3}


# ---------------------------------------------------------------- chat


async def test_chat_basic() -> None:
    engine = FakeEngine()
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi there", "name": "bob"}]
    async with asgi_client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": FULL}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    (req,) = engine.generates
    assert req.messages == messages and req.chat_template_kwargs == {"enable_thinking": False}
    assert req.sampling.max_new_tokens is None  # up to the context, as OpenAI chat does


async def test_chat_content_parts_and_copied_back_fields() -> None:
    engine = FakeEngine()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "refusal": None, "tool_calls": None, "annotations": []},
        {"role": "user", "content": "c"},
    ]
    async with asgi_client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    assert engine.generates[0].messages == [{"role": "user", "content": "a\nb"},
                                            {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": "c"}]


async def test_chat_max_completion_tokens_wins() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                   "max_tokens": 5, "max_completion_tokens": 2})
    assert engine.generates[0].sampling.max_new_tokens == 2


async def test_chat_logprobs_format() -> None:
    engine = FakeEngine()
    msgs = [{"role": "user", "content": "x"}]
    async with asgi_client(engine) as c:
        top = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "logprobs": True,
                                                         "top_logprobs": 2, "max_tokens": 2})
        bare = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "logprobs": True,
                                                          "max_tokens": 1})
    content = top.json()["choices"][0]["logprobs"]["content"]
    assert content[0] == {
        "token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
        "top_logprobs": [{"token": "<100>", "logprob": -0.5, "bytes": list(b"<100>")},
                         {"token": "<300>", "logprob": -0.75, "bytes": list(b"<300>")}],
    }
    assert content[1]["token"] == " world" and content[1]["bytes"] == list(b" world")
    assert bare.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert engine.generates[1].sampling.logprobs and engine.generates[1].sampling.top_logprobs == 0


async def test_chat_stream_role_first_then_content_then_usage() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "n": 2, "max_tokens": 2,
            "stream_options": {"include_usage": True}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    roles = chunks[:2]
    assert [c["choices"][0]["index"] for c in roles] == [0, 1]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in roles)
    per_choice: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for c in chunks[2:-1]:
        choice = c["choices"][0]
        per_choice[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert per_choice == {0: "Hello world", 1: "Hello world"}
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert [g.rid for g in engine.generates] == [f"{chunks[0]['id']}-0", f"{chunks[0]['id']}-1"]


async def test_chat_stream_logprobs_chunks() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True, "logprobs": True,
            "top_logprobs": 1, "max_tokens": 2})
    chunks = sse(r.text)[:-1]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    tokens = [c["choices"][0]["logprobs"]["content"][0]["token"] for c in chunks[1:]]
    assert tokens == ["Hello", " world"]


# ---------------------------------------------------------------- models


async def test_models_list() -> None:
    async with asgi_client(FakeEngine()) as c:
        body = (await c.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 2048
    assert card["root"] == MODEL_PATH


# ---------------------------------------------------------------- errors


def _many_stops() -> list[str]:
    return [f"s{i}" for i in range(17)]


@pytest.mark.parametrize(("patch", "param"), [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"stop": _many_stops()}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 3]}, "stop[1]"),
    ({"seed": 2**64}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ({"logit_bias": {"600": 1}}, "logit_bias.600"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"stop_token_ids": [600]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"prompt": [1, 600]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"model": 3}, "model"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"continuous_usage_stat": True}}, "stream_options.continuous_usage_stat"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),  # vLLM's field is not built: use echo with logprobs
])
async def test_completion_rejects_bad_input(patch: dict[str, Any], param: str) -> None:
    engine = FakeEngine()
    body = {"model": MODEL, "prompt": "hi", **patch}
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json=body)
    assert_error(r, 400, param)
    assert not engine.generates


@pytest.mark.parametrize(("patch", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
])
async def test_chat_rejects_bad_input(patch: dict[str, Any], param: str) -> None:
    engine = FakeEngine()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **patch}
    async with asgi_client(engine) as c:
        r = await c.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param)
    assert not engine.generates


async def test_values_too_big_for_the_wire_are_400() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "chat_template_kwargs": {"x": 2**70}})
    assert_error(r, 400, "chat_template_kwargs")
    assert not engine.generates


async def test_chat_accepts_neutral_values_of_unbuilt_parameters() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "store": False, "modalities": ["text"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("content", "fragment"), [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": "tiny-model", "prompt": "x", "temperature": NaN}', "malformed JSON"),
    (b"\xff\xfe\x00", "malformed JSON"),
])
async def test_malformed_bodies(content: bytes, fragment: str) -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert fragment in assert_error(r, 400)["message"]


async def test_missing_fields_are_named() -> None:
    async with asgi_client(FakeEngine()) as c:
        no_model = await c.post("/v1/completions", json={"prompt": "x"})  # the served model answers
        no_prompt = await c.post("/v1/completions", json={"model": MODEL})
        no_messages = await c.post("/v1/chat/completions", json={"model": MODEL})
    assert no_model.status_code == 200 and no_model.json()["model"] == MODEL
    assert_error(no_prompt, 400, "prompt")
    assert_error(no_messages, 400, "messages")


async def test_unknown_model_is_404() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        chat = await c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [
            {"role": "user", "content": "x"}]})
    assert assert_error(r, 404, "model")["code"] == "model_not_found"
    assert_error(chat, 404, "model")
    assert not engine.generates


async def test_body_too_large_is_413() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/v1/completions", content=b"x" * (32 * 1024 * 1024 + 1))
    assert_error(r, 413)


async def test_not_ready_is_503() -> None:
    engine = FakeEngine(ready=False)
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_error(r, 503)
    assert_error(chat, 503)
    assert r.headers["retry-after"]


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_too_long_is_400_before_any_stream(stream: bool) -> None:
    engine = FakeEngine(script=script_error(400, "the prompt has 5000 tokens; max_model_len is 2048"))
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
        chat = await c.post("/v1/chat/completions", json={"model": MODEL, "stream": stream,
                                                          "messages": [{"role": "user", "content": "x"}]})
    assert "5000 tokens" in assert_error(r, 400)["message"]
    assert_error(chat, 400)
    assert not r.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_failure_is_500_with_its_message(stream: bool) -> None:
    engine = FakeEngine(script=script_error(500, "CUDA error: device-side assert"))
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
    err = assert_error(r, 500)
    assert err["message"] == "CUDA error: device-side assert" and err["type"] == "server_error"


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failing_choice_fails_the_request_and_aborts_the_others(stream: bool) -> None:
    fail = script_error(400, "too long")
    engine = FakeEngine(script=lambda req: fail(req) if req.rid.endswith("-1") else None)
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "stream": stream})
    assert_error(r, 400)
    assert [a.rid for a in engine.aborts] == [engine.generates[0].rid]
