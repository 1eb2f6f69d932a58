"""The reliability pieces in-process, without starting the appliance: the scheduler's admission bound and
timeouts, the worker's failure policy and fault switch, heartbeats and liveness, the key checks."""

from __future__ import annotations

import asyncio
import gc
import struct
import time
from typing import Any

import httpx
import pytest
import zmq

from app import ipc, lifecycle
from app import protocol as p
from app.http import auth
from app.http.liveness import EngineLiveness
from app.http.server import build_app
from app.lifecycle import Heartbeat, HeartbeatWatch
from app.scheduler.scheduler import QueueFull, Scheduler, SchedulerConfig
from app.worker.faults import Fault, parse_faults
from app.worker.process import MAX_CONSECUTIVE_STEP_FAILURES, StepFailures, serve_steps
from tests.unit.test_http_fakes import FakeEngine, settings


def scheduler(**overrides: Any) -> Scheduler:
    config = dict(num_blocks=64, block_size=4, max_model_len=64, max_num_seqs=2, chunked_prefill_size=64,
                  max_prefill_tokens=64, enable_prefix_caching=True, eos_token_ids=(0,))
    return Scheduler(SchedulerConfig(**{**config, **overrides}))


def request(rid: str, arrival: float | None = None) -> p.TokenizedRequest:
    return p.TokenizedRequest(rid, [1, 2, 3, 4, 5], p.SamplingParams(max_new_tokens=8), arrival or time.time())


# ---------------------------------------------------------------- scheduler


def test_the_scheduler_holds_at_most_max_num_seqs_plus_max_queued_requests() -> None:
    sched = scheduler(max_queued_requests=3)
    for i in range(5):
        sched.add_request(request(f"r{i}"))
    with pytest.raises(QueueFull, match="--max-queued-requests 3"):
        sched.add_request(request("r5"))
    sched.abort("r0")
    sched.add_request(request("r5"))  # room again
    assert len(sched.requests) == 5


def test_timeouts_fail_requests_with_504_and_free_their_blocks() -> None:
    sched = scheduler(request_timeout=10.0, ttft_timeout=2.0)
    now = time.time()
    sched.add_request(request("old", arrival=now - 11))
    sched.add_request(request("waiting", arrival=now - 3))
    sched.add_request(request("fresh", arrival=now))
    plan = sched.schedule()  # old and waiting run (2 slots), fresh waits
    assert plan is not None and sched.kv.num_used_blocks > 0
    sched.process_result(p.StepResult(step=plan.step, slots=[c.slot for c in plan.chunks],
                                      token_ids=[7] * len(plan.chunks)))  # both got a first token
    deltas = {d.rid: d for d in sched.expire(time.time())}
    assert set(deltas) == {"old"}  # "waiting" has its first token, so only the total limit applies
    assert deltas["old"].error_code == 504 and "--request-timeout 10" in deltas["old"].error
    sched.add_request(request("late", arrival=now - 5))  # queued, no token, past --ttft-timeout
    deltas = {d.rid: d for d in sched.expire(time.time())}
    assert set(deltas) == {"late"} and "--ttft-timeout 2" in deltas["late"].error
    assert set(sched.requests) == {"waiting", "fresh"}
    sched.abort_all()
    assert sched.kv.num_used_blocks == 0


def test_no_timeout_by_default() -> None:
    sched = scheduler()
    sched.add_request(request("ancient", arrival=time.time() - 10_000))
    assert sched.expire(time.time()) == []


# ---------------------------------------------------------------- worker


def test_fault_specs() -> None:
    assert parse_faults("raise:rid=boom-, delay:after=3:0.5,nan:rid=x") == [
        Fault("raise", rid_prefix="boom-"), Fault("delay", after=3, seconds=0.5), Fault("nan", rid_prefix="x")]
    for bad in ("explode:rid=x", "raise", "raise:rid=", "raise:after=x", "delay:rid=x", "raise:rid=x:1"):
        with pytest.raises(ValueError, match="TOKENSPEED_TEST_FAULT"):
            parse_faults(bad)


class FlakyRunner:
    """Fails the steps whose number is in `failing`."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def execute(self, plan: p.StepPlan) -> p.StepResult:
        if plan.step in self.failing:
            raise RuntimeError(f"step {plan.step} broke")
        return p.StepResult(step=plan.step)


def _serve(runner: FlakyRunner, plans: list[p.StepPlan]) -> tuple[list[p.StepResult], BaseException | None]:
    ctx = zmq.Context()
    inbox, to_worker = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    results_in, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind("inproc://worker")
    to_worker.connect("inproc://worker")
    results_in.bind("inproc://results")
    results.connect("inproc://results")
    for plan in [*plans, p.Shutdown("done")]:
        ipc.send(to_worker, plan)
    error = None
    try:
        serve_steps(runner, inbox, results)
    except StepFailures as exc:
        error = exc
    out = []
    while results_in.poll(100):
        out.append(ipc.recv(results_in))
    ctx.destroy(linger=0)
    return out, error


def chunk_plan(step: int) -> p.StepPlan:
    return p.StepPlan(step=step, chunks=[p.SeqChunk(slot=0, token_ids=[1])])


def test_failed_steps_fail_their_requests_and_the_worker_recovers() -> None:
    plans = [chunk_plan(0), chunk_plan(1), p.StepPlan(step=2, free_slots=[0]), chunk_plan(3), chunk_plan(4)]
    results, error = _serve(FlakyRunner({0, 1, 3}), plans)
    assert error is None and [r.step for r in results] == [0, 1, 2, 3, 4]
    assert [r.error is not None for r in results] == [True, True, False, True, False]
    assert "RuntimeError: step 0 broke" in results[0].error


def test_consecutive_failures_end_the_worker_and_free_only_steps_do_not_count_as_success() -> None:
    n = MAX_CONSECUTIVE_STEP_FAILURES
    plans = [chunk_plan(0)] + [p.StepPlan(step=1, free_slots=[0])] + [chunk_plan(i) for i in range(2, n + 1)]
    plans.append(chunk_plan(n + 1))  # never reached
    results, error = _serve(FlakyRunner(set(range(n + 2)) - {1}), plans)
    assert isinstance(error, StepFailures) and f"{n} consecutive steps failed" in str(error)
    assert len(results) == n + 1 and all(r.error for r in results if r.step != 1)


# ---------------------------------------------------------------- heartbeats and liveness


def test_heartbeats_and_liveness(tmp_path) -> None:
    beats = {name: Heartbeat.create(str(tmp_path), name) for name in ("tokenizer", "scheduler", "worker0")}
    assert Heartbeat.attach(str(tmp_path), "nobody") is None
    liveness = EngineLiveness(beats, heartbeat_timeout=30.0, worker_heartbeat_timeout=0.4)
    time.sleep(0.3)  # before the first question: not timed (readiness asks only once the engine is ready)
    assert liveness.problem() is None
    time.sleep(0.3)
    beats["tokenizer"].beat()
    beats["scheduler"].beat()
    assert "worker0" in (liveness.problem() or "")  # silent for more than half of its 0.4 s timeout
    Heartbeat.attach(str(tmp_path), "worker0").beat()  # another process's beat lands in the same file
    assert liveness.problem() is None


def test_a_heartbeat_watch_times_silence_on_its_own_clock(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    heartbeat = Heartbeat.create(str(tmp_path), "scheduler")
    now = [1000.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    watch = HeartbeatWatch(heartbeat)
    now[0] += 2.0
    assert watch.silent_for() == 2.0
    now[0] += 1.0
    heartbeat.beat()
    assert watch.silent_for() == 0.0
    # The observer did not look for hours (a paused VM, a starved supervisor): that gap counts as at most
    # MAX_UNWATCHED_S, so the child is not declared wedged for time nobody watched it.
    now[0] += 19621.0
    assert watch.silent_for() == lifecycle.MAX_UNWATCHED_S
    for _ in range(10):
        now[0] += 0.5
        watch.silent_for()
    assert watch.silent_for() == lifecycle.MAX_UNWATCHED_S + 5.0
    # Whatever lands in the file (here a float stamp, as the old format held), a change is a beat, never
    # hours of silence.
    with open(heartbeat.path, "r+b") as f:
        f.write(struct.pack("d", 0.9))
    assert watch.silent_for() == 0.0


# ---------------------------------------------------------------- keys and capacity


def test_keys_are_compared_as_equal_length_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    expected = auth.key_digest("the-real-key")
    for presented in ("x", "the-real-key", "the-real-key" * 100, ""):
        auth.key_matches(presented, expected)
    assert seen == [(32, 32)] * 4  # no early exit on length: the key's length does not leak
    assert auth.key_matches("the-real-key", expected) and not auth.key_matches(None, expected)


def _status(app: Any, path: str, key: str | None, method: str = "GET") -> int:
    async def run() -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.request(method, path, headers=headers)).status_code

    return asyncio.run(run())


def test_admin_key_semantics() -> None:
    both = build_app(settings(api_key="api", admin_api_key="admin"), FakeEngine())
    assert _status(both, "/flush_cache", "api") == 403
    assert _status(both, "/flush_cache", "admin") == 200
    assert _status(both, "/v1/models", "admin") == 200 and _status(both, "/v1/models", "api") == 200
    assert _status(both, "/v1/models", None) == 401 and _status(both, "/health", None) == 200
    admin_only = build_app(settings(admin_api_key="admin"), FakeEngine())
    assert _status(admin_only, "/v1/models", None) == 200  # no --api-key: the API is open
    assert _status(admin_only, "/flush_cache", None) == 401 and _status(admin_only, "/flush_cache", "admin") == 200
    api_only = build_app(settings(api_key="api"), FakeEngine())
    assert _status(api_only, "/flush_cache", "api") == 200  # without an admin key the API key opens control


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-host"])
def test_control_routes_are_closed_on_a_public_bind_without_an_admin_key(host: str, caplog) -> None:
    """403 whatever the key, with a message that says how to open them; the API is unchanged."""
    for keys in ({}, {"api_key": "api"}):
        app = build_app(settings(host=host, **keys), FakeEngine())
        key = keys.get("api_key")
        for path in ("/flush_cache", "/abort_request", "/pause_generation", "/update_weights_from_disk",
                     "/init_weights_update_group"):
            assert _status(app, path, key, "POST") == 403, path
        assert _status(app, "/v1/models", key) == 200 and _status(app, "/health", None) == 200

    async def body() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=build_app(settings(host=host), FakeEngine()))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return (await client.post("/update_weights_from_disk", json={"model_path": "/etc"})).json()

    error = asyncio.run(body())["error"]
    assert error["code"] == "admin_routes_closed"
    assert "--admin-api-key" in error["message"] and "--allow-remote-admin" in error["message"]
    # An admin key, or the explicit flag (with a warning at start-up), opens them.
    assert _status(build_app(settings(host=host, admin_api_key="adm"), FakeEngine()), "/flush_cache", "adm", "POST") == 200
    opened = settings(host=host, allow_remote_admin=True)
    assert _status(build_app(opened, FakeEngine()), "/flush_cache", None, "POST") == 200
    from app.http.config import HttpConfig
    from app.http.server import log_admin_access

    caplog.set_level("WARNING")
    log_admin_access(HttpConfig.from_settings(opened))
    assert "--allow-remote-admin: the control routes" in caplog.text and "anyone who can reach the port" in caplog.text


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_control_routes_stay_open_on_loopback(host: str) -> None:
    assert _status(build_app(settings(host=host), FakeEngine()), "/flush_cache", None, "POST") == 200


def test_a_request_bigger_than_the_capacity_is_a_400_and_a_full_server_a_503() -> None:
    engine = FakeEngine(script=lambda req: None)  # never answers: requests stay in flight
    app = build_app(settings(max_num_seqs=2, max_queued_requests=1), engine)
    body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 2}

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            too_big = await client.post("/v1/completions", json={**body, "n": 4})
            pending = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)]
            while engine.num_inflight < 3:
                await asyncio.sleep(0.01)
            full = await client.post("/v1/completions", json=body)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return [too_big, full]

    too_big, full = asyncio.run(run())
    assert too_big.status_code == 400 and "at most 3" in too_big.json()["error"]["message"]
    assert full.status_code == 503 and full.headers["retry-after"] == "5"
    assert full.json()["error"]["code"] == "queue_full"


def test_capacity_counts_every_data_parallel_replica() -> None:
    engine = FakeEngine(script=lambda req: None)
    app = build_app(settings(max_num_seqs=2, max_queued_requests=1, data_parallel_size=2), engine)
    body = {"model": "tiny-model", "prompt": "hi", "max_tokens": 2, "n": 7}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/v1/completions", json=body)

    too_big = asyncio.run(run())
    message = too_big.json()["error"]["message"]
    assert too_big.status_code == 400 and "at most 6" in message and "x --data-parallel-size 2" in message


def test_settle_heap_freezes_what_is_alive() -> None:
    """Each process calls it at ready: the start-up heap leaves the collector's full passes."""
    gc.unfreeze()
    try:
        lifecycle.settle_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # leave the test process as it was


def test_text_size_limit_reads_the_engine_info() -> None:
    """EngineInfo.max_token_chars x max_model_len bounds a text prompt before it is tokenized."""
    from app.http.errors import APIError
    from app.http.limits import check_text_length, max_prompt_chars

    engine = p.EngineInfo(max_model_len=8, vocab_size=100, max_token_chars=3)
    assert max_prompt_chars(engine) == 24
    check_text_length(24, engine, "prompt")
    with pytest.raises(APIError) as refused:
        check_text_length(25, engine, "prompt")
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"
    assert "--max-model-len 8 tokens of at most 3 characters" in refused.value.message
    assert max_prompt_chars(p.EngineInfo(max_model_len=8)) is None  # --skip-tokenizer-init: not known
    assert max_prompt_chars(p.EngineInfo()) is None  # not ready
