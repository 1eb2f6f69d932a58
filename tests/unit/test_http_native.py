"""POST /generate (SGLang's native API) through build_app and httpx.ASGITransport."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from app.protocol import TextDelta
from tests.unit.test_http_fakes import (
    PIECES,
    FakeEngine,
    asgi_client,
    assert_error,
    hold,
    script_error,
    script_pieces,
    sse,
)

pytestmark = pytest.mark.anyio
FULL = "".join(PIECES)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_generate_text() -> None:
    engine = FakeEngine()
    async with asgi_client(engine, weight_version="v7") as c:
        r = await c.post("/generate", json={"text": "The sky is", "sampling_params": {"temperature": 0}})
    body = r.json()
    assert body["text"] == FULL and body["output_ids"] == list(range(100, 107))
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 7, 0)
    assert meta["weight_version"] == "v7" and meta["e2e_latency"] >= 0
    (req,) = engine.generates
    assert meta["id"] == req.rid and req.text == "The sky is"
    assert req.sampling.temperature == 0 and req.sampling.max_new_tokens == 128  # SGLang's default


async def test_generate_sampling_parameters_and_rid() -> None:
    engine = FakeEngine()
    params = {"max_new_tokens": 2, "min_new_tokens": 1, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "stop": "x",
              "stop_token_ids": [9], "ignore_eos": True, "sampling_seed": 3, "no_stop_trim": True,
              "repetition_penalty": 1.2, "spaces_between_special_tokens": False, "n": 1}
    async with asgi_client(engine) as c:
        r = await c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": params, "rid": "my-rid"})
    body = r.json()
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert body["meta_info"]["id"] == "my-rid"
    (req,) = engine.generates
    s = req.sampling
    assert req.rid == "my-rid" and req.input_ids == [1, 2, 3]
    assert (s.max_new_tokens, s.min_new_tokens, s.top_p, s.top_k, s.min_p) == (2, 1, 0.5, 5, 0.1)
    assert s.stop == ["x"] and s.stop_token_ids == [9] and s.ignore_eos and s.seed == 3 and s.no_stop_trim
    assert s.repetition_penalty == 1.2 and not s.spaces_between_special_tokens


async def test_generate_batch() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/generate", json={"text": ["a", "b c"], "rid": ["r1", "r2"],
                                            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]})
    body = r.json()
    assert isinstance(body, list) and [b["text"] for b in body] == ["Hello", "Hello world"]
    assert [b["meta_info"]["id"] for b in body] == ["r1", "r2"]
    assert [b["index"] for b in body] == [0, 1]
    assert [g.sampling.max_new_tokens for g in engine.generates] == [1, 2]


async def test_generate_stream_cumulative_text_and_delta_ids() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["text"] for c in chunks] == ["Hello", "Hello world", "Hello world,"]
    assert [c["output_ids"] for c in chunks] == [[100], [101], [102]]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [None, None, {"type": "length", "length": 3}]
    assert "e2e_latency" in chunks[-1]["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]


async def test_generate_stream_output_sends_segments() -> None:
    async with asgi_client(FakeEngine(), stream_output=True) as c:
        r = await c.post("/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 3}})
    assert [c["text"] for c in sse(r.text)[:-1]] == ["Hello", " world", ","]


async def test_generate_batch_stream_carries_indices() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/generate", json={"input_ids": [[1], [2]], "stream": True,
                                            "sampling_params": {"max_new_tokens": 2}})
    chunks = sse(r.text)[:-1]
    assert sorted(c["index"] for c in chunks) == [0, 0, 1, 1]
    final = {c["index"]: c["text"] for c in chunks if c["meta_info"]["finish_reason"]}
    assert final == {0: "Hello world", 1: "Hello world"}


async def test_generate_logprobs() -> None:
    async with asgi_client(FakeEngine()) as c:
        r = await c.post("/generate", json={"text": "a", "return_logprob": True, "top_logprobs_num": 2,
                                            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 1}})
    meta = r.json()["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 100, "Hello"]]
    assert meta["output_top_logprobs"] == [[[-0.5, 100, "<100>"], [-0.75, 300, "<300>"]]]


async def test_generate_abort_finish_reason() -> None:
    engine = FakeEngine(script=hold)
    async with asgi_client(engine) as c:
        task = asyncio.create_task(c.post("/generate", json={"text": "a", "rid": "victim"}))
        while not engine.generates:
            await asyncio.sleep(0.01)
        ok = await c.post("/abort_request", json={"rid": "victim"})
        r = await task
    assert ok.json() == {"success": True}
    assert r.status_code == 200
    assert r.json()["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted by /abort_request"}


@pytest.mark.parametrize(("body", "param"), [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
    ({"text": ["a", 3]}, "text[1]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "x"]}, "input_ids"),
    ({"input_ids": [1, 600]}, "input_ids[1]"),
    ({"input_ids": [[1], [600]]}, "input_ids[1][0]"),
    ({"text": "a", "sampling_params": {"temperature": 3}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"text": "a", "sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [999]}}, "sampling_params.stop_token_ids[0]"),
    ({"text": "a", "sampling_params": {"seed": 1, "sampling_seed": 2}}, "sampling_params.seed"),
    ({"text": "a", "sampling_params": {"min_new_tokens": 200}}, "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_k": 0}]}, "sampling_params[1].top_k"),
    ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
    ({"text": ["a", "b"], "rid": "one"}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ({"text": "a", "stream": 1}, "stream"),
    ({"text": "a", "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"text": "a", "logprob_start_len": 0}, "logprob_start_len"),  # without return_logprob
    ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "lora_path": "x"}, "lora_path"),
    ({"text": "a", "image_data": "x"}, "image_data"),
])
async def test_generate_rejects_bad_input(body: dict[str, Any], param: str) -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.post("/generate", json=body)
    assert_error(r, 400, param)
    assert not engine.generates


async def test_generate_duplicate_rid_in_flight_is_400() -> None:
    engine = FakeEngine(script=hold)
    async with asgi_client(engine) as c:
        first = asyncio.create_task(c.post("/generate", json={"text": "a", "rid": "dup"}))
        while not engine.generates:
            await asyncio.sleep(0.01)
        second = await c.post("/generate", json={"text": "a", "rid": "dup"})
        engine.deliver(TextDelta(rid="dup", text="x", token_ids=[5], finish_reason="length", completion_tokens=1))
        assert (await first).json()["text"] == "x"
    assert_error(second, 400, "rid")


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_errors_from_the_engine(stream: bool) -> None:
    async with asgi_client(FakeEngine(script=script_error(400, "prompt too long"))) as c:
        too_long = await c.post("/generate", json={"text": "a", "stream": stream})
    async with asgi_client(FakeEngine(script=script_error(500, "worker died"))) as c:
        failed = await c.post("/generate", json={"text": "a", "stream": stream})
    assert assert_error(too_long, 400)["message"] == "prompt too long"
    assert assert_error(failed, 500)["message"] == "worker died"


async def test_generate_not_ready() -> None:
    async with asgi_client(FakeEngine(ready=False)) as c:
        assert_error(await c.post("/generate", json={"text": "a"}), 503)


async def test_generate_weight_version_follows_updates() -> None:
    async with asgi_client(FakeEngine(script=script_pieces())) as c:
        await c.post("/update_weight_version", json={"new_version": "step-42"})
        r = await c.post("/generate", json={"text": "a"})
    assert r.json()["meta_info"]["weight_version"] == "step-42"
