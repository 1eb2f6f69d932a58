"""The official openai client against a real uvicorn (in a thread) serving build_app with a fake engine;
and client disconnects over real sockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.protocol import TextDelta
from tests.unit.test_http_fakes import MODEL, PIECES, FakeEngine, LiveServer, hold, script_error

FULL = "".join(PIECES)


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    with LiveServer(FakeEngine()) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="EMPTY", max_retries=0, timeout=10)


def wait_for(condition: object, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_openai_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Say something nice", max_tokens=4, logprobs=1)
    assert out.choices[0].text == "Hello world, how" and out.choices[0].finish_reason == "length"
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.tokens == PIECES[:4]
    assert out.usage is not None and (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 4)


def test_openai_completions_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="x", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == FULL
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 8


def test_openai_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}], n=2,
                                         logprobs=True, top_logprobs=2, seed=1)
    assert [c.message.content for c in out.choices] == [FULL, FULL]
    assert [c.index for c in out.choices] == [0, 1]
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and content[0].token == "Hello" and len(content[0].top_logprobs) == 2


def test_openai_chat_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True,
                                            max_tokens=3, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world,"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_openai_extra_body_parameters(client: openai.OpenAI, live: LiveServer) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True,
                                               "chat_template_kwargs": {"enable_thinking": False}})
    req = live.engine.generates[-1]
    assert req.sampling.top_k == 5 and req.sampling.ignore_eos and req.chat_template_kwargs


def test_openai_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=3)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x")
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert "tools" in tools.value.message


def test_openai_auth() -> None:
    with LiveServer(FakeEngine(), api_key="sk-live") as server:
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-nope", max_retries=0)
        right = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-live", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert [m.id for m in right.models.list()] == [MODEL]
        assert httpx.get(server.url + "/health").status_code == 200


def test_openai_prompt_too_long_is_bad_request() -> None:
    with LiveServer(FakeEngine(script=script_error(400, "prompt too long"))) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError):
            list(c.completions.create(model=MODEL, prompt="x", stream=True))


def test_socket_disconnects_abort_engine_requests() -> None:
    engine = FakeEngine(script=hold, answer_aborts=False)
    with LiveServer(engine) as server:
        # a non-streaming request whose client gives up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.3)
        wait_for(lambda: len(engine.aborts) == 1)
        assert engine.aborts[0].rid == engine.generates[0].rid

        # a streaming request closed after its first chunk (headers come with the first delta)
        def first_token() -> None:
            wait_for(lambda: len(engine.generates) == 2)
            engine.deliver(TextDelta(rid="s1", text="Hi", token_ids=[5], completion_tokens=1))

        feeder = threading.Thread(target=first_token)
        feeder.start()
        with httpx.Client(timeout=5) as c, c.stream("POST", server.url + "/generate",
                                                    json={"text": "x", "stream": True, "rid": "s1"}) as r:
            first = next(r.iter_lines())
            feeder.join()
            assert first.startswith("data: ") and '"Hi"' in first
        wait_for(lambda: len(engine.aborts) == 2)
        assert engine.aborts[1].rid == "s1"
        wait_for(lambda: server.app.state.http.inflight == 0)
