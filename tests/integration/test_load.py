"""Load through the whole appliance: 200 concurrent streaming clients (some leaving mid-stream), and a
client that reads slowly. Every request ends with [DONE] or a clean error, nobody waits on the slow
reader, and the KV pool is back to no block in use afterwards (no leak)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.support.appliance import Appliance

CLIENTS = 200
LEAVERS = 40  # of them disconnect after their second chunk


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir):
    with Appliance(tiny_model_dirs["llama"], "--max-num-seqs", "160", log_dir=log_dir) as appliance:
        yield appliance


def inflight(app: Appliance) -> int:
    return httpx.get(f"{app.base_url}/get_server_info", timeout=10).json()["num_inflight_requests"]


async def one_stream(client: httpx.AsyncClient, model: str, index: int, leave: bool) -> str:
    """'done', 'left', or the clean error it got ('error:<status>')."""
    body = {"model": model, "prompt": f"client {index} says", "max_tokens": 200 if leave else 24,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            assert r.json()["error"]["message"], r.text
            return f"error:{r.status_code}"
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return "done"
            payload = json.loads(data)
            if "error" in payload:
                return f"error:{payload['error']['type']}"
            chunks += 1
            if leave and chunks == 2:
                return "left"  # leaving the block closes the connection mid-stream
    return "cut"  # the stream ended without [DONE]: never acceptable


async def many_streams(base_url: str, model: str) -> list[str]:
    limits = httpx.Limits(max_connections=CLIENTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=120) as client:
        return await asyncio.gather(*(one_stream(client, model, i, i < LEAVERS) for i in range(CLIENTS)))


def test_200_concurrent_streams_end_cleanly_and_leak_no_kv_block(app: Appliance) -> None:
    model = httpx.get(f"{app.base_url}/v1/models").json()["data"][0]["id"]
    outcomes = asyncio.run(many_streams(app.base_url, model))
    assert outcomes.count("left") == LEAVERS
    assert outcomes.count("done") == CLIENTS - LEAVERS, sorted(set(outcomes))
    after = app.wait_idle()
    assert after["num_blocks"] > 0
    assert inflight(app) == 0
    assert httpx.get(f"{app.base_url}/readiness").status_code == 200


def _slow_reader(port: int, body: dict[str, Any]) -> socket.socket:
    """A client that sends a request and then reads nothing: a 4 KiB receive buffer fills at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\nConnection: close\r\n\r\n" + payload)
    return sock


def test_slow_readers_block_nobody_and_hold_no_kv(app: Appliance) -> None:
    model = httpx.get(f"{app.base_url}/v1/models").json()["data"][0]["id"]
    big = {"model": model, "messages": [{"role": "user", "content": "tell me everything"}], "n": 4,
           "max_tokens": 200, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}
    patient, quitter = _slow_reader(app.port, big), _slow_reader(app.port, big)
    try:
        # Others are served meanwhile, and the engine finishes both readers' requests and frees their KV
        # while neither has read a byte: their output waits in the HTTP process and the socket buffers.
        started = time.monotonic()
        for _ in range(5):
            r = httpx.post(f"{app.base_url}/v1/completions", timeout=30,
                           json={"model": model, "prompt": "quick", "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - started < 20
        app.wait_idle(timeout=60)
        quitter.close()  # leaves without reading its answer
        received = bytearray()
        patient.settimeout(60)
        while chunk := patient.recv(65536):
            received += chunk
    finally:
        patient.close()
        quitter.close()
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b"0\r\n\r\n")  # the last chunk
    assert b"data: [DONE]\n\n" in received[-64:]
    deadline = time.monotonic() + 10
    while inflight(app) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert inflight(app) == 0
