"""Engine features through the whole appliance: prefix cache, n, logprobs, echo, stop ids,
min_tokens, ignore_eos, seeds, abort on disconnect (blocks freed)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.appliance import Appliance

SHARED = list(range(10, 74))  # 64 tokens: 4 full blocks of 16


@pytest.fixture(scope="module")
def llama(tiny_model_dirs, log_dir):
    # A long context (rope does not depend on it) lets the abort tests run requests that take
    # far longer than an abort's round trip.
    flags = ("--block-size", "16", "--enable-cache-report", "--max-total-tokens", "32768",
             "--hf-overrides", '{"max_position_embeddings": 32768}')
    with Appliance(tiny_model_dirs["llama"], *flags, log_dir=log_dir) as app:
        yield app


@pytest.fixture(scope="module")
def client(llama) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{llama.base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def generate(app: Appliance, ids: list[int], **sampling) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, **sampling}}
    r = httpx.post(f"{app.base_url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_prefix_cache_hit_reports_cached_tokens_and_keeps_output(llama, tiny_model_dirs, log_dir) -> None:
    httpx.post(f"{llama.base_url}/flush_cache", timeout=10)
    first = generate(llama, SHARED + [5, 6, 7])
    second = generate(llama, SHARED + [8, 9])
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == 64
    with Appliance(tiny_model_dirs["llama"], "--no-enable-prefix-caching", log_dir=log_dir) as cold:
        uncached = generate(cold, SHARED + [8, 9])
    assert uncached["meta_info"]["cached_tokens"] == 0
    assert second["output_ids"] == uncached["output_ids"]


def test_cache_report_in_openai_usage(client, model_name) -> None:
    client.completions.create(model=model_name, prompt=SHARED + [1, 2], max_tokens=2, temperature=0)
    resp = client.completions.create(model=model_name, prompt=SHARED + [3, 4], max_tokens=2, temperature=0)
    assert resp.usage.prompt_tokens_details.cached_tokens == 64


def test_logprobs_equal_the_reference_log_softmax(client, model_name, tiny_model_dirs) -> None:
    prompt = [11, 22, 33, 44, 55]
    resp = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=4, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        generate_ids = gen[0, len(prompt) :].tolist()
        logits = model(gen).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(lp.token_logprobs) == 4
    for i, tok in enumerate(generate_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-3)
        top = torch.topk(ref[i], 3).values.tolist()
        # OpenAI keys alternatives by their text: byte-level pieces that decode alike collapse.
        assert 1 <= len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(top[0], abs=1e-3)
        for value in lp.top_logprobs[i].values():
            assert min(abs(value - t) for t in top) < 1e-3


def test_n_choices_and_seeds(client, model_name) -> None:
    greedy = client.completions.create(model=model_name, prompt=[1, 2, 3], max_tokens=6, temperature=0, n=3)
    assert len({c.text for c in greedy.choices}) == 1 and sorted(c.index for c in greedy.choices) == [0, 1, 2]
    kw = dict(model=model_name, prompt=[1, 2, 3], max_tokens=12, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    sampled = client.completions.create(n=4, **kw)
    assert len({c.text for c in sampled.choices}) > 1


def test_echo_prepends_the_prompt(client, model_name) -> None:
    resp = client.completions.create(model=model_name, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=model_name, prompt="Hello world", max_tokens=3, temperature=0)
    assert resp.choices[0].text == "Hello world" + plain.choices[0].text


def test_stop_token_ids_min_tokens_and_ignore_eos(llama) -> None:
    free = generate(llama, [7, 8, 9], max_new_tokens=12)["output_ids"]
    stop_id = free[2]
    stopped = generate(llama, [7, 8, 9], max_new_tokens=12, stop_token_ids=[stop_id])
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped["output_ids"] == free[: free.index(stop_id) + 1]
    held = generate(llama, [7, 8, 9], max_new_tokens=12, stop_token_ids=[stop_id], min_new_tokens=6)
    assert stop_id not in held["output_ids"][:6] and len(held["output_ids"]) >= 6
    long = generate(llama, [7, 8, 9], max_new_tokens=40, ignore_eos=True)
    assert len(long["output_ids"]) == 40 and long["meta_info"]["finish_reason"]["type"] == "length"


def test_client_disconnect_aborts_and_frees_blocks(llama, model_name) -> None:
    body = {
        "model": model_name,
        "prompt": [5, 6, 7],
        "max_tokens": 20000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{llama.base_url}/v1/completions", json=body, timeout=60) as r:
        chunks = r.iter_lines()
        for _ in range(3):
            next(chunks)
        assert llama.loads()[0]["num_reqs"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = llama.loads()[0]
        if now["num_reqs"] == 0 and now["num_waiting_reqs"] == 0 and now["num_pages"] == 0:
            break
        time.sleep(0.1)
    assert now["num_reqs"] == 0 and now["num_pages"] == 0, now


def test_abort_request_route_ends_a_request(llama) -> None:
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True},
        "rid": "victim",
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{llama.base_url}/generate", json=body, timeout=60) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        events.append(next(lines))  # in flight now
        assert httpx.post(f"{llama.base_url}/abort_request", json={"rid": "victim"}).json() == {"success": True}
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 20000
    assert llama.loads()[0]["num_pages"] == 0
