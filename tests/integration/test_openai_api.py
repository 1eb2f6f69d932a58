"""The OpenAI API of the whole appliance, through the official openai client, on SmolLM2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def client(smollm2) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smollm2.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_name(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_answers_paris(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=40,
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 10
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streaming_equals_non_streaming_at_temperature_zero(client) -> None:
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=24)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streaming_equals_non_streaming(client) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], temperature=0, max_tokens=16)
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    assert streamed == full


def test_stop_string_trims_and_reports_stop(client) -> None:
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=30)
    free = client.completions.create(**kw).choices[0].text
    assert " 6" in free, free
    stopped = client.completions.create(stop=[" 6"], **kw).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(" 6")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[" 6"], stream=True, **kw))
    assert streamed == stopped.text


def test_max_tokens_gives_length(client) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=5)
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5


def test_concurrent_clients_get_their_own_answers(client) -> None:
    prompts = [f"Count from {i}:" for i in range(8)]

    def one(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0].text

    alone = [one(p) for p in prompts[:2]]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, prompts))
    assert together[:2] == alone


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "max_tokens": 100000}, "max"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_input_is_a_4xx_with_an_openai_error(smollm2, body, param) -> None:
    r = httpx.post(f"{smollm2.base_url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert param in err["message"] or param == err["param"]


def test_unknown_model_and_malformed_json(smollm2) -> None:
    r = httpx.post(f"{smollm2.base_url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    r = httpx.post(
        f"{smollm2.base_url}/v1/chat/completions", content=b"{not json", timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    # The appliance still serves after bad input.
    assert httpx.get(f"{smollm2.base_url}/health_generate", timeout=30).status_code == 200


def test_native_generate_carries_meta_info(smollm2) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    out = httpx.post(f"{smollm2.base_url}/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 4 and meta["weight_version"] == "default"
    assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 4


def test_echo_with_logprobs_returns_the_prompt_logprobs_first(client, smollm2) -> None:
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=2, echo=True, logprobs=2)
    resp = client.completions.create(**kw)
    choice = resp.choices[0]
    lp = choice.logprobs
    n_prompt = resp.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2 and choice.text.startswith("The capital of France is")
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert value <= 0 and top[token] == value and len(top) <= 3
        assert max(top.values()) >= value
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    streamed = list(client.completions.create(stream=True, **kw))
    first = streamed[0].choices[0].logprobs
    assert first.tokens[:n_prompt] == lp.tokens[:n_prompt] and first.token_logprobs[0] is None
    assert first.token_logprobs[1:n_prompt] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1}
    meta = httpx.post(f"{smollm2.base_url}/generate", json=body, timeout=60).json()["meta_info"]
    assert [v for v, _, _ in meta["input_token_logprobs"]] == pytest.approx(lp.token_logprobs[2:n_prompt], abs=1e-4)
    assert len(meta["input_top_logprobs"]) == n_prompt - 2
