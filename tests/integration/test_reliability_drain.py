"""SIGTERM under load: new requests get 503, the requests in flight finish, those still running at
--drain-timeout end with a terminal abort, and the appliance exits 0 with no process left behind."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from tests.support.appliance import Appliance

DRAIN_S = 8.0  # the short requests need ~2 s; the long ones ~25 s


def _run(app: Appliance, rid: str, tokens: int, stream: bool, out: dict[str, Any]) -> None:
    body = {"rid": rid, "input_ids": [5, 6, 7, 8], "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    try:
        r = httpx.post(f"{app.base_url}/generate", json=body, timeout=60)
    except httpx.TransportError as exc:  # never acceptable: every request gets a response
        out[rid] = exc
        return
    if not stream:
        out[rid] = (r.status_code, r.json())
        return
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    out[rid] = (r.status_code, [json.loads(x) for x in lines[:-1]], lines[-1] if lines else None)


def _finish(item: dict[str, Any]) -> str | None:
    reason = item["meta_info"]["finish_reason"]
    return reason["type"] if reason else None


def test_sigterm_under_load_drains_then_aborts_the_rest_and_exits_zero(tiny_model_dirs, log_dir) -> None:
    app = Appliance(tiny_model_dirs["llama"], "--drain-timeout", str(DRAIN_S), "--max-num-seqs", "32",
                    env={"TOKENSPEED_TEST_FAULT": "delay:rid=slow-:0.05"}, log_dir=log_dir).wait_ready()
    out: dict[str, Any] = {}
    work = [(f"slow-short-stream-{i}", 30, True) for i in range(10)]
    work += [(f"slow-short-whole-{i}", 30, False) for i in range(6)]
    work += [(f"slow-long-{i}", 400, True) for i in range(4)]
    threads = [threading.Thread(target=_run, args=(app, rid, n, stream, out)) for rid, n, stream in work]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while httpx.get(f"{app.base_url}/get_loads").json()["loads"][0]["num_running"] < len(work):
            assert time.monotonic() < deadline, "the load never got going"
            time.sleep(0.05)
        signalled = time.monotonic()
        app.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(f"{app.base_url}/generate", json={"input_ids": [5]}, timeout=10)
            assert late.status_code == 503 and late.headers["retry-after"]
            assert httpx.get(f"{app.base_url}/readiness").json() == {"status": "draining"}
        except httpx.ConnectError:
            pass  # already closed: also a refusal
        for t in threads:
            t.join(60)
        assert app.proc.wait(timeout=30) == 0, app.logs()[-3000:]
        assert time.monotonic() - signalled < DRAIN_S + 10
        time.sleep(0.5)  # multiprocessing's resource tracker leaves right after the supervisor
        assert app.leftover_processes() == []
    finally:
        app.kill()

    assert not [v for v in out.values() if isinstance(v, Exception)], out
    for rid, _, stream in work:
        status, *rest = out[rid]
        assert status == 200, (rid, rest)
        if not stream:
            assert _finish(rest[0]) == "length" and len(rest[0]["output_ids"]) == 30
            continue
        items, last = rest
        assert last == "[DONE]", rid
        expected = "abort" if "long" in rid else "length"
        assert _finish(items[-1]) == expected, (rid, items[-1]["meta_info"])
    assert "still in flight" in app.logs() and "stopped (exit code 0)" in app.logs()
