"""Process supervision: a dead child takes the appliance down; SIGTERM drains; no orphans."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.support.appliance import Appliance

CHILDREN = ["http", "worker0"]  # the supervisor watches every child alike: the front and the GPU one


@pytest.mark.parametrize("child", CHILDREN)
def test_killing_a_child_stops_the_appliance(child, tiny_model_dirs, log_dir) -> None:
    app = Appliance(tiny_model_dirs["llama"], log_dir=log_dir).wait_ready()
    try:
        os.kill(app.child_pid(child), signal.SIGKILL)
        app.proc.wait(timeout=20)
        assert app.proc.returncode not in (0, None)
        assert f"{child} (pid" in app.logs() and "died" in app.logs()
        time.sleep(0.5)
        assert app.leftover_processes() == []
    finally:
        app.kill()


def test_sigterm_drains_in_flight_requests_then_exits_zero(tiny_model_dirs, log_dir) -> None:
    app = Appliance(tiny_model_dirs["llama"], "--drain-timeout", "60", log_dir=log_dir).wait_ready()
    results: list[httpx.Response] = []
    started = threading.Event()

    def long_request() -> None:
        body = {
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True},
        }
        started.set()
        results.append(httpx.post(f"{app.base_url}/generate", json=body, timeout=120))

    threads = [threading.Thread(target=long_request) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        started.wait(10)
        time.sleep(0.5)  # the requests are in flight
        app.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(f"{app.base_url}/generate", json={"input_ids": [5], "sampling_params": {}}, timeout=10)
            assert late.status_code == 503
        except httpx.ConnectError:
            pass  # the listener may already be closed: also a refusal
        for t in threads:
            t.join(120)
        assert app.proc.wait(timeout=60) == 0, app.logs()[-3000:]
        assert [r.status_code for r in results] == [200, 200, 200]
        assert all(len(r.json()["output_ids"]) == 300 for r in results)
        assert app.leftover_processes() == []
    finally:
        app.kill()


def test_api_key_guards_api_routes_but_not_health(tiny_model_dirs, log_dir) -> None:
    with Appliance(tiny_model_dirs["llama"], "--api-key", "sekrit-key-123", log_dir=log_dir) as app:
        url = app.base_url
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/readiness").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekrit-key-123"})
        assert ok.status_code == 200
        body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{url}/generate", json=body).status_code == 401
        logs = app.logs()
    assert "sekrit-key-123" not in logs
