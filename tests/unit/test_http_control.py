"""Health, readiness, control routes, auth, draining, disconnects and mid-stream engine errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from app.http import control
from app.http.server import build_app
from app.protocol import FINISH_ABORT, AllLoads, ControlReply, GetLoads, Loads, StartupPhase, TextDelta
from tests.unit.test_http_fakes import (
    ENGINE,
    INFO,
    MODEL,
    MODEL_PATH,
    FakeEngine,
    asgi_client,
    assert_error,
    hold,
    settings,
    sse,
)

pytestmark = pytest.mark.anyio
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def until(condition: Any, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


# ---------------------------------------------------------------- health


async def test_health_and_readiness() -> None:
    engine = FakeEngine(ready=False)
    async with asgi_client(engine) as c:
        assert (await c.get("/health")).text == "OK"
        assert (await c.get("/liveness")).status_code == 200
        before = await c.get("/readiness")
        engine._dispatch(StartupPhase("worker0", "weights"))
        engine._dispatch(StartupPhase("worker0", "weights", 2.5, True))
        engine._dispatch(StartupPhase("worker0", "kernels"))
        engine._dispatch(StartupPhase("worker1", "weights"))
        during = await c.get("/readiness")
        engine.become_ready()
        after = await c.get("/readiness")
    assert before.status_code == 503 and before.json()["status"] == "not ready"
    assert before.json()["phase"] == "starting" and before.headers["Retry-After"]
    body = during.json()
    assert during.status_code == 503 and body["status"] == "not ready"
    # The phase readiness waits on is the earliest any process is in; finished phases keep their seconds.
    assert (body["phase"], body["processes"], body["phase_seconds"]) == (
        "weights", {"worker0": "kernels", "worker1": "weights"}, {"weights": 2.5})
    assert body["elapsed_seconds"] >= 0
    assert after.status_code == 200 and after.json() == {"status": "ready"}


async def test_health_generate_runs_a_one_token_greedy_probe() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    (probe,) = engine.generates
    s = probe.sampling
    assert probe.input_ids == [0] and s.max_new_tokens == 1 and s.temperature == 0 and s.ignore_eos


async def test_health_generate_failures_are_503() -> None:
    async with asgi_client(FakeEngine(ready=False)) as c:
        assert_error(await c.get("/health_generate"), 503)
    stuck = FakeEngine(script=hold)
    app = build_app(settings(), stuck, health_generate_timeout=0.05)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        timed_out = await c.get("/health_generate")
    assert "no token" in assert_error(timed_out, 503)["message"]
    assert [a.rid for a in stuck.aborts] == [stuck.generates[0].rid]  # the probe does not linger
    broken = FakeEngine(script=lambda req: [TextDelta(rid=req.rid, text="", token_ids=[], finish_reason=FINISH_ABORT,
                                                      error="scheduler crashed", error_code=500)])
    async with asgi_client(broken) as c:
        assert "scheduler crashed" in assert_error(await c.get("/health_generate"), 503)["message"]


# ---------------------------------------------------------------- control routes


async def test_abort_request_by_id_aborts_the_whole_fan_out() -> None:
    engine = FakeEngine(script=hold)
    async with asgi_client(engine) as c:
        task = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "n": 2}))
        await until(lambda: len(engine.generates) == 2)
        rid = engine.generates[0].rid.rsplit("-", 1)[0]
        assert (await c.post("/abort_request", json={"rid": rid})).json() == {"success": True}
        r = await task
    assert sorted(a.rid for a in engine.aborts) == [f"{rid}-0", f"{rid}-1"]
    assert [ch["finish_reason"] for ch in r.json()["choices"]] == ["abort", "abort"]


async def test_abort_all_and_bad_abort_bodies() -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        ok = await c.post("/abort_request", json={"abort_all": True})
        neither = await c.post("/abort_request", json={})
        both = await c.post("/abort_request", json={"rid": "x", "abort_all": True})
        typo = await c.post("/abort_request", json={"rids": ["x"]})
    assert ok.json() == {"success": True} and engine.aborts[0].abort_all
    assert_error(neither, 400, "rid")
    assert_error(both, 400, "rid")
    assert_error(typo, 400, "rids")


@pytest.mark.parametrize("method", ["GET", "POST"])
async def test_flush_cache(method: str) -> None:
    engine = FakeEngine()
    async with asgi_client(engine) as c:
        r = await c.request(method, "/flush_cache")
    assert r.status_code == 200 and r.json() == {"success": True, "message": "Cache flushed."}
    assert [m.kind for m in engine.controls] == ["flush_cache"]


async def test_loads_shape_one_entry_per_replica() -> None:
    engine = FakeEngine()
    loads = [Loads(d, 2 + d, 1, 0.25, 16, 4, 64, d, False, d == 1, 0) for d in range(2)]
    engine.control_reply = lambda msg: ControlReply(msg.req_id, True, "", AllLoads(loads))
    async with asgi_client(engine) as c:
        for path in ("/v1/loads", "/get_loads"):
            r = await c.get(path)
            assert r.status_code == 200
            first, second = r.json()["loads"]
            assert list(first)[:4] == ["dp_rank", "num_reqs", "num_waiting_reqs", "num_pages"]
            assert first == {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_pages": 16, "num_running": 2,
                             "num_waiting": 1, "kv_cache_usage": 0.25, "num_used_blocks": 16, "num_cached_blocks": 4,
                             "num_blocks": 64, "num_preemptions": 0, "paused": False,
                             "weight_update_in_progress": False, "queued_control_ops": 0}
            assert (second["dp_rank"], second["num_reqs"], second["weight_update_in_progress"]) == (1, 3, True)
    assert [m.op for m in engine.controls] == [GetLoads(), GetLoads()]


async def test_flush_cache_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = FakeEngine()
    refused.control_reply = lambda msg: ControlReply(msg.req_id, False, "requests are running")
    silent = FakeEngine()
    silent.control_reply = lambda msg: None
    monkeypatch.setattr(control, "CONTROL_TIMEOUT_S", 0.05)
    async with asgi_client(refused) as c:
        assert assert_error(await c.post("/flush_cache"), 400)["message"] == "requests are running"
    async with asgi_client(silent) as c:
        assert_error(await c.post("/flush_cache"), 504)
    async with asgi_client(FakeEngine(ready=False)) as c:
        assert_error(await c.post("/flush_cache"), 503)


async def test_info_routes() -> None:
    async with asgi_client(FakeEngine(), api_key="sk-very-secret", weight_version="w1") as c:
        auth = {"Authorization": "Bearer sk-very-secret"}
        model = (await c.get("/get_model_info", headers=auth)).json()
        server = await c.get("/get_server_info", headers=auth)
        version = (await c.get("/get_weight_version", headers=auth)).json()
        update = (await c.post("/update_weight_version", json={"new_version": "w2"}, headers=auth)).json()
        after = (await c.get("/model_info", headers=auth)).json()
        bad = await c.post("/update_weight_version", json={"new_version": ""}, headers=auth)
    assert model == {"model_path": MODEL_PATH, "tokenizer_path": MODEL_PATH, "served_model_name": MODEL,
                     "is_generation": True, "max_context_length": 2048, "vocab_size": 512, "eos_token_ids": [2],
                     "weight_version": "w1"}
    assert "sk-very-secret" not in server.text
    info = server.json()
    assert info["api_key"] == "**********" and info["engine_info"] == {**INFO, **dataclasses.asdict(ENGINE)} and info["port"] == settings().port
    assert version == {"weight_version": "w1"}
    assert update["success"] and update["new_version"] == "w2"
    assert after == {"model_path": MODEL_PATH, "weight_version": "w2"}
    assert_error(bad, 400, "new_version")


async def test_unknown_route_and_method_are_openai_errors() -> None:
    async with asgi_client(FakeEngine()) as c:
        missing = await c.get("/v1/nope")
        wrong = await c.get("/v1/completions")
    assert_error(missing, 404)
    assert_error(wrong, 405)


# ---------------------------------------------------------------- auth

PROTECTED = [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
    ("POST", "/abort_request"), ("GET", "/flush_cache"), ("POST", "/flush_cache"), ("GET", "/get_model_info"),
    ("GET", "/get_server_info"), ("GET", "/get_weight_version"), ("POST", "/update_weight_version"),
    ("GET", "/model_info"), ("GET", "/no/such/route"),
]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
async def test_protected_routes_need_the_key(method: str, path: str) -> None:
    engine = FakeEngine()
    async with asgi_client(engine, api_key="sk-right") as c:
        missing = await c.request(method, path)
        wrong = await c.request(method, path, headers={"Authorization": "Bearer sk-wrong"})
        wrong_header = await c.request(method, path, headers={"x-api-key": "sk-right-not"})
        assert not engine.sent  # refused before reaching any route
        bearer = await c.request(method, path, headers={"Authorization": "Bearer sk-right"})
        x_key = await c.request(method, path, headers={"x-api-key": "sk-right"})
    for r in (missing, wrong, wrong_header):
        assert assert_error(r, 401)["code"] == "invalid_api_key"
        assert "sk-right" not in r.text
    assert bearer.status_code != 401 and x_key.status_code != 401


@pytest.mark.parametrize("path", ["/health", "/liveness", "/readiness", "/health_generate"])
async def test_health_routes_are_open(path: str) -> None:
    async with asgi_client(FakeEngine(), api_key="sk-right") as c:
        assert (await c.get(path)).status_code == 200


async def test_server_info_masks_a_secret_str_key() -> None:
    async with asgi_client(FakeEngine(), api_key=SecretStr("sk-hidden")) as c:
        denied = await c.get("/get_server_info", headers={"Authorization": "Bearer nope"})
        r = await c.get("/get_server_info", headers={"Authorization": "Bearer sk-hidden"})
    assert denied.status_code == 401
    assert r.status_code == 200 and "sk-hidden" not in r.text


# ---------------------------------------------------------------- draining


async def test_drain_refuses_new_work_and_waits_for_the_old() -> None:
    engine = FakeEngine(script=hold)
    app = build_app(settings(), engine)
    state = app.state.http
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        task = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
        await until(lambda: engine.generates)
        state.begin_drain()
        refused = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        readiness = await c.get("/readiness")
        assert state.inflight == 1 and not await state.wait_drained(0.05)
        rid = engine.generates[0].rid
        engine.deliver(TextDelta(rid=rid, text="done", token_ids=[7], finish_reason="stop", completion_tokens=1))
        assert await state.wait_drained(1.0)
        finished = await task
    assert_error(refused, 503)
    assert refused.headers["retry-after"]
    assert readiness.status_code == 503 and readiness.json() == {"status": "draining"}
    assert finished.json()["choices"][0]["text"] == "done"


async def test_fail_all_gives_every_request_a_terminal_response() -> None:
    engine = FakeEngine(script=hold, answer_aborts=False)
    async with asgi_client(engine) as c:
        whole = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
        streamed = asyncio.create_task(c.post("/v1/chat/completions", json={**CHAT, "stream": True}))
        await until(lambda: len(engine.generates) == 2)
        assert engine.fail_all("the server is shutting down") == 2
        r1, r2 = await whole, await streamed
    assert r1.json()["choices"][0]["finish_reason"] == "abort"
    chunks = sse(r2.text)
    assert chunks[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "abort"


# ---------------------------------------------------------------- engine errors mid-stream


async def test_engine_error_mid_stream_sends_an_error_chunk_then_done() -> None:
    def script(req: Any) -> list[TextDelta]:
        return [TextDelta(rid=req.rid, text="Hel", token_ids=[5], completion_tokens=1),
                TextDelta(rid=req.rid, text="", token_ids=[], finish_reason=FINISH_ABORT, error="worker lost",
                          error_code=500)]

    async with asgi_client(FakeEngine(script=script)) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = sse(r.text)
    assert events[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert events[-2] == {"error": {"message": "worker lost", "type": "server_error", "param": None, "code": None}}
    assert events[-1] == "[DONE]"


async def test_mid_stream_error_aborts_the_other_choices() -> None:
    def script(req: Any) -> list[TextDelta] | None:
        first = TextDelta(rid=req.rid, text="a", token_ids=[5], completion_tokens=1)
        if req.rid.endswith("-1"):
            return [first, TextDelta(rid=req.rid, text="", token_ids=[], finish_reason=FINISH_ABORT,
                                     error="boom", error_code=500)]
        return [first]

    engine = FakeEngine(script=script)
    async with asgi_client(engine) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2, "stream": True})
    assert sse(r.text)[-2]["error"]["message"] == "boom"
    assert [a.rid for a in engine.aborts] == [engine.generates[0].rid]


# ---------------------------------------------------------------- client disconnects


async def call_until_disconnect(app: Any, path: str, body: dict[str, Any], gone: asyncio.Event,
                                sent: list[dict[str, Any]]) -> None:
    """Call the ASGI app as a server would, reporting http.disconnect once `gone` is set."""
    raw = json.dumps(body).encode()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "state": {},
    }
    await app(scope, receive, send)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3}),
    ("/v1/chat/completions", CHAT),
    ("/generate", {"text": "x"}),
])
async def test_disconnect_while_waiting_aborts(path: str, body: dict[str, Any]) -> None:
    engine = FakeEngine(script=hold, answer_aborts=False)
    app = build_app(settings(), engine)
    gone, sent = asyncio.Event(), []
    for stream in (False, True):
        engine.sent.clear()
        task = asyncio.create_task(call_until_disconnect(app, path, {**body, "stream": stream}, gone, sent))
        await until(lambda: engine.generates)
        gone.set()
        await asyncio.wait_for(task, 2)
        assert sorted(a.rid for a in engine.aborts) == sorted(g.rid for g in engine.generates)
        assert app.state.http.inflight == 0 and engine.num_inflight == 0
        gone.clear()


async def test_disconnect_mid_stream_aborts() -> None:
    engine = FakeEngine(script=hold, answer_aborts=False)
    app = build_app(settings(), engine)
    gone, sent = asyncio.Event(), []
    task = asyncio.create_task(call_until_disconnect(app, "/v1/chat/completions", {**CHAT, "stream": True},
                                                     gone, sent))
    await until(lambda: engine.generates)
    rid = engine.generates[0].rid
    engine.deliver(TextDelta(rid=rid, text="Hi", token_ids=[5], completion_tokens=1))
    await until(lambda: any(b"Hi" in m.get("body", b"") for m in sent))
    assert sent[0]["status"] == 200 and not engine.aborts
    gone.set()
    await asyncio.wait_for(task, 2)
    assert [a.rid for a in engine.aborts] == [rid]
    assert app.state.http.inflight == 0


async def test_request_logging_never_shows_the_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="app.http.requests")
    async with asgi_client(FakeEngine(), api_key="sk-log-secret", enable_log_requests=True,
                           log_requests_level=1) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "tell me"},
                     headers={"Authorization": "Bearer sk-log-secret"})
    text = caplog.text
    assert "route=/v1/completions" in text and "tell me" in text and "Hello world" in text
    assert "sk-log-secret" not in text


async def test_real_settings_object() -> None:
    from app.config.settings import Settings

    app = build_app(Settings(model="/models/real", served_model_name="real", api_key="sk-real"), FakeEngine())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        denied = await c.get("/v1/models")
        info = await c.get("/get_server_info", headers={"Authorization": "Bearer sk-real"})
        models = await c.get("/v1/models", headers={"x-api-key": "sk-real"})
    assert_error(denied, 401)
    assert info.status_code == 200 and "sk-real" not in info.text and info.json()["model"] == "/models/real"
    assert models.json()["data"][0]["id"] == "real"
