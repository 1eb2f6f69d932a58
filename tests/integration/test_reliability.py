"""Faults, timeouts, admission control and keys through the whole appliance.

The worker runs with the test-only fault switch (TOKENSPEED_TEST_FAULT): requests whose id starts with
boom- make their step raise, nan- get NaN logits, slow- make every step they are in sleep 0.1 s, fatal-
raise like boom-. Policy under test (docs/operations.md): a failed step fails its requests with 500 and
the appliance recovers; five failed steps in a row bring it down (exit 1, no orphans); a wedged worker
is detected by its heartbeat; timeouts answer 504; beyond --max-num-seqs + --max-queued-requests, 503
with Retry-After; every route but the open ones needs a key, control routes the admin key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.support.appliance import REPO, Appliance

FAULTS = "raise:rid=boom-,nan:rid=nan-,delay:rid=slow-:0.1,raise:rid=fatal-"
API_KEY, ADMIN_KEY = "sk-reliability-api-7f3a9", "sk-reliability-admin-91c2e"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"x-api-key": ADMIN_KEY}
FLAGS = ("--max-num-seqs", "4", "--max-queued-requests", "4", "--request-timeout", "5", "--ttft-timeout", "1",
         "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir):
    appliance = Appliance(tiny_model_dirs["llama"], *FLAGS, env={"TOKENSPEED_TEST_FAULT": FAULTS},
                          log_dir=log_dir).wait_ready()
    try:
        yield appliance
    finally:
        appliance.stop()
        for proc in appliance.leftover_processes():
            proc.kill()


def rid(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def generate(app: Appliance, request_id: str, max_new_tokens: int = 4, stream: bool = False,
             timeout: float = 60) -> httpx.Response:
    body = {"rid": request_id, "input_ids": [5, 6, 7, 8], "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    return httpx.post(f"{app.base_url}/generate", json=body, headers=API, timeout=timeout)


def events(response: httpx.Response) -> list[Any]:
    """The SSE payloads of a stream, [DONE] as the string."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(app: Appliance) -> dict[str, Any]:
    return app.wait_idle(timeout=10.0, headers=API)


def in_threads(*calls: Any) -> list[Any]:
    """Run the calls concurrently; their results in order."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


# ---------------------------------------------------------------- engine faults


def test_a_failing_step_fails_its_request_with_500_and_the_appliance_recovers(app: Appliance) -> None:
    failed = generate(app, rid("boom-"))
    assert failed.status_code == 500, failed.text
    message = failed.json()["error"]["message"]
    assert "engine step failed" in message and "InjectedFault" in message
    ok = generate(app, rid("ok-"))
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 4
    assert httpx.get(f"{app.base_url}/readiness").status_code == 200
    wait_idle(app)
    assert "failed:" in app.logs()  # the worker logged the step's traceback


def test_nan_logits_fail_only_the_poisoned_request(app: Appliance) -> None:
    healthy, poisoned = in_threads(lambda: generate(app, rid("slow-"), max_new_tokens=20),
                                   lambda: (time.sleep(0.3), generate(app, rid("nan-")))[1])
    assert poisoned.status_code == 500 and "NaN or inf logits" in poisoned.json()["error"]["message"]
    assert healthy.status_code == 200 and len(healthy.json()["output_ids"]) == 20
    wait_idle(app)


# ---------------------------------------------------------------- timeouts and admission


def test_request_timeout_answers_504_and_ends_a_stream_with_a_terminal_error(app: Appliance) -> None:
    started = time.monotonic()
    stream, whole = in_threads(lambda: generate(app, rid("slow-"), max_new_tokens=200, stream=True),
                               lambda: generate(app, rid("slow-"), max_new_tokens=200))
    assert 4.5 < time.monotonic() - started < 15
    assert whole.status_code == 504 and "--request-timeout 5" in whole.json()["error"]["message"]
    assert stream.status_code == 200
    payloads = events(stream)
    assert payloads[-1] == "[DONE]"
    error = payloads[-2]["error"]
    assert error["type"] == "timeout_error" and "--request-timeout" in error["message"]
    assert any("text" in p for p in payloads[:-2])  # it streamed output before the deadline
    wait_idle(app)


def test_admission_control_and_ttft_timeout(app: Appliance) -> None:
    """4 run (2.5 s each), 4 wait past --ttft-timeout 1 (504), 4 find the appliance full (503)."""
    calls = [lambda: generate(app, rid("slow-"), max_new_tokens=25) for _ in range(12)]
    responses = in_threads(*calls)
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 4, 504: 4, 503: 4}, [(r.status_code, r.text[:200]) for r in responses]
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"] and "--max-queued-requests 4" in r.json()["error"]["message"]
        if r.status_code == 504:
            assert "--ttft-timeout" in r.json()["error"]["message"]
    wait_idle(app)


# ---------------------------------------------------------------- keys


def _call(app: Appliance, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    # POST bodies carry an unknown field: every route refuses it (400) once past the key check, so no
    # control operation runs (no pause, no weight update).
    body = {"__probe__": True} if method == "post" else None
    return httpx.request(method.upper(), f"{app.base_url}{path}", json=body, headers=headers, timeout=60)


def test_every_route_needs_the_right_key(app: Appliance) -> None:
    assert httpx.get(f"{app.base_url}/openapi.json").status_code == 401
    document = httpx.get(f"{app.base_url}/openapi.json", headers=API).json()
    checked = Counter()
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            access = op["x-access"]
            checked[access] += 1
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": API_KEY + "x"}):
                status = _call(app, method, path, headers).status_code
                assert (status == 401) == (access != "open"), (method, path, headers, status)
            with_api = _call(app, method, path, API).status_code
            assert with_api == 403 if access == "admin" else with_api not in (401, 403), (method, path, with_api)
            with_admin = _call(app, method, path, ADMIN).status_code
            assert with_admin not in (401, 403), (method, path, with_admin)
            if method == "post" and path != "/flush_cache":  # flush takes no body (and is harmless)
                assert with_admin == 400, (path, with_admin)
    assert checked["open"] >= 4 and checked["api"] >= 8 and checked["admin"] >= 10


def test_keys_are_masked_in_server_info_and_config_show(app: Appliance) -> None:
    info = httpx.get(f"{app.base_url}/get_server_info", headers=API).json()
    assert info["api_key"] == info["admin_api_key"] == "**********"
    shown = subprocess.run([sys.executable, "-m", "app.cli", "config", "show", "m", "--api-key", API_KEY,
                            "--admin-api-key", ADMIN_KEY], cwd=REPO, capture_output=True, text=True, check=True)
    assert "admin_api_key" in shown.stdout
    assert API_KEY not in shown.stdout + shown.stderr and ADMIN_KEY not in shown.stdout + shown.stderr


# ---------------------------------------------------------------- the end of this appliance


def test_consecutive_step_failures_bring_the_appliance_down(app: Appliance) -> None:
    statuses = []
    for _ in range(8):
        try:
            statuses.append(generate(app, rid("fatal-"), timeout=30).status_code)
        except httpx.TransportError:
            break  # the appliance is gone
        if app.proc.poll() is not None:
            break
    assert app.proc.wait(timeout=30) == 1
    assert set(statuses) <= {500, 503} and statuses[0] == 500, statuses
    logs = app.logs()
    assert "consecutive steps failed" in logs and "worker0 (pid" in logs and "died with exit code 1" in logs
    time.sleep(0.5)
    assert app.leftover_processes() == []
    assert API_KEY not in logs and ADMIN_KEY not in logs


def test_a_wedged_worker_is_detected_and_its_requests_get_503(tiny_model_dirs, log_dir) -> None:
    app = Appliance(tiny_model_dirs["llama"], "--worker-heartbeat-timeout", "4",
                    env={"TOKENSPEED_TEST_FAULT": "wedge:rid=wedge-"}, log_dir=log_dir).wait_ready()
    try:
        result: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: result.append(generate(app, rid("wedge-"))))
        waiting.start()
        deadline = time.monotonic() + 4
        readiness = httpx.get(f"{app.base_url}/readiness")
        while readiness.status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            readiness = httpx.get(f"{app.base_url}/readiness")
        assert readiness.status_code == 503 and "worker0" in readiness.json()["reason"]
        waiting.join(30)
        assert result and result[0].status_code == 503, result
        assert "wedged" in result[0].json()["error"]["message"]
        assert app.proc.wait(timeout=30) == 1
        assert "worker0 (pid" in app.logs() and "is wedged: no heartbeat" in app.logs()
        time.sleep(0.5)
        assert app.leftover_processes() == []
    finally:
        app.kill()
