"""The real EngineClient against a fake tokenizer made of real ZMQ sockets (ipc:// in a temp dir), and the
whole HTTP process (run_http) started as a child: ProcessReady, readiness, SIGINT ignored, SIGTERM
draining, the supervisor's Shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from app import ipc, protocol
from app.http.engine_client import EngineClient
from app.http.server import run_http
from app.ipc import Endpoints
from app.protocol import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineReady,
    GenerateRequest,
    GetLoads,
    PauseGeneration,
    ProcessReady,
    SamplingParams,
    Shutdown,
    TextDelta,
    TextDeltas,
)
from tests.unit.test_http_fakes import ENGINE, INFO, MODEL, settings

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid=rid, sampling=SamplingParams(max_new_tokens=2), text="hi")


async def test_engine_client_over_zmq(tmp_path: Path) -> None:
    endpoints = Endpoints(str(tmp_path))
    ctx = zmq.asyncio.Context()
    tokenizer = ipc.bind_pull(ctx, endpoints.inbox("tokenizer"))
    shutdowns: list[str] = []
    client = EngineClient(endpoints, on_shutdown=shutdowns.append)
    await client.start()
    to_http = ipc.connect_push(ctx, endpoints.inbox("http"))

    async def engine_says(msg: Any) -> None:
        await to_http.send(protocol.encode(msg))

    async def tokenizer_gets() -> Any:
        return protocol.decode(await asyncio.wait_for(tokenizer.recv(), 2))

    try:
        assert not client.ready
        await to_http.send(b"\xc1 not msgpack")  # dropped with a log line; the reader carries on
        await engine_says(EngineReady(INFO, ENGINE))
        await _until(lambda: client.ready)
        assert client.info == INFO and client.engine == ENGINE

        # a whole request: deltas routed by rid, the stream ends after the terminal one
        seen: list[TextDelta] = []

        async def consume() -> None:
            async for delta in client.generate(_request("r1")):
                seen.append(delta)

        consumer = asyncio.create_task(consume())
        assert (await tokenizer_gets()).rid == "r1"
        await engine_says(TextDeltas([TextDelta("r1", "a", [5], completion_tokens=1),
                                      TextDelta("other", "x", [6])]))
        await engine_says(TextDeltas([TextDelta("r1", "b", [7], finish_reason="length", completion_tokens=2)]))
        await asyncio.wait_for(consumer, 2)
        assert [d.text for d in seen] == ["a", "b"] and client.num_inflight == 0

        # a consumer that stops early aborts its request
        early = client.generate(_request("r2"))
        first = asyncio.create_task(early.__anext__())
        await tokenizer_gets()
        await engine_says(TextDeltas([TextDelta("r2", "a", [5])]))
        assert (await first).text == "a"
        await early.aclose()
        assert await tokenizer_gets() == AbortRequest(rid="r2", reason="the client closed the request")

        # so does a cancelled one
        waiting = asyncio.create_task(client.generate(_request("r3")).__anext__())
        await tokenizer_gets()
        waiting.cancel()
        assert (await tokenizer_gets()).rid == "r3"
        assert client.num_inflight == 0

        # control round trip, and a control the engine never answers
        flush = asyncio.create_task(client.control(PauseGeneration("abort"), timeout=2))
        ctl = await tokenizer_gets()
        assert isinstance(ctl, ControlRequest) and ctl.op == PauseGeneration("abort")
        await engine_says(ControlReply(ctl.req_id, True, "flushed"))
        assert (await flush).message == "flushed"
        with pytest.raises(TimeoutError):
            await client.control(GetLoads(), timeout=0.05)
        await tokenizer_gets()

        await client.abort(abort_all=True, reason="bye")
        assert await tokenizer_gets() == AbortRequest(abort_all=True, reason="bye")
        await engine_says(Shutdown("supervisor stops"))
        await _until(lambda: shutdowns == ["supervisor stops"])
    finally:
        await client.close()
        to_http.close()
        tokenizer.close()
        ctx.term()


async def _until(condition: Any, timeout: float = 2.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


# ---------------------------------------------------------------- the process


class Peers:
    """The supervisor's and the tokenizer's inboxes, and a way to talk to the HTTP process."""

    def __init__(self, runtime_dir: Path) -> None:
        self.endpoints = Endpoints(str(runtime_dir))
        self.ctx = zmq.Context()
        self.supervisor = ipc.bind_pull(self.ctx, self.endpoints.inbox("supervisor"))
        self.tokenizer = ipc.bind_pull(self.ctx, self.endpoints.inbox("tokenizer"))
        self.to_http = ipc.connect_push(self.ctx, self.endpoints.inbox("http"))

    def recv(self, sock: zmq.Socket, timeout_s: float = 20) -> Any:
        assert sock.poll(int(timeout_s * 1000)), "nothing received"
        return ipc.recv(sock)

    def close(self) -> None:
        for sock in (self.supervisor, self.tokenizer, self.to_http):
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[Peers, multiprocessing.Process, str]]:
    peers = Peers(tmp_path)
    proc = multiprocessing.get_context("spawn").Process(
        target=run_http, args=(settings(drain_timeout=0.5), peers.endpoints), daemon=True)
    proc.start()
    try:
        ready = peers.recv(peers.supervisor)
        assert isinstance(ready, ProcessReady) and ready.name == "http" and ready.pid == proc.pid
        yield peers, proc, f"http://127.0.0.1:{ready.info['port']}"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        peers.close()


def _post_in_thread(url: str, results: list[httpx.Response]) -> threading.Thread:
    def run() -> None:
        results.append(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=20))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_process_readiness_sigint_and_sigterm_drain(child: tuple[Peers, multiprocessing.Process, str]) -> None:
    peers, proc, url = child
    assert httpx.get(url + "/readiness").status_code == 503
    ipc.send(peers.to_http, EngineReady(INFO, ENGINE))
    for _ in range(200):
        if httpx.get(url + "/readiness").status_code == 200:
            break
        threading.Event().wait(0.01)
    assert httpx.get(url + "/readiness").status_code == 200

    os.kill(proc.pid, signal.SIGINT)  # the supervisor coordinates: SIGINT alone does nothing
    threading.Event().wait(0.2)
    assert proc.is_alive() and httpx.get(url + "/health").text == "OK"

    results: list[httpx.Response] = []
    poster = _post_in_thread(url, results)
    request = peers.recv(peers.tokenizer)
    assert isinstance(request, GenerateRequest)
    os.kill(proc.pid, signal.SIGTERM)  # drain: the request never finishes, so after 0.5 s it is aborted
    poster.join(10)
    assert results[0].status_code == 200
    assert results[0].json()["choices"][0]["finish_reason"] == "abort"
    assert peers.recv(peers.tokenizer) == AbortRequest(abort_all=True, reason="the server is shutting down")
    proc.join(10)
    assert proc.exitcode == 0


def test_process_drain_lets_requests_finish(child: tuple[Peers, multiprocessing.Process, str]) -> None:
    peers, proc, url = child
    ipc.send(peers.to_http, EngineReady(INFO, ENGINE))
    for _ in range(200):
        if httpx.get(url + "/readiness").status_code == 200:
            break
        threading.Event().wait(0.01)
    results: list[httpx.Response] = []
    poster = _post_in_thread(url, results)
    request = peers.recv(peers.tokenizer)
    os.kill(proc.pid, signal.SIGTERM)
    threading.Event().wait(0.1)
    ipc.send(peers.to_http, TextDeltas([TextDelta(request.rid, "fine", [5], finish_reason="stop")]))
    poster.join(10)
    assert results[0].json()["choices"][0]["text"] == "fine"
    proc.join(10)
    assert proc.exitcode == 0


def test_process_stops_on_shutdown_message(child: tuple[Peers, multiprocessing.Process, str]) -> None:
    peers, proc, _ = child
    ipc.send(peers.to_http, Shutdown("stop"))
    proc.join(10)
    assert proc.exitcode == 0


def test_process_exits_non_zero_when_the_port_is_taken(tmp_path: Path) -> None:
    peers = Peers(tmp_path)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    proc = multiprocessing.get_context("spawn").Process(
        target=run_http, args=(settings(port=taken.getsockname()[1]), peers.endpoints), daemon=True)
    proc.start()
    try:
        proc.join(20)
        assert proc.exitcode not in (None, 0)
        assert not peers.supervisor.poll(0)  # never announced itself ready
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        taken.close()
        peers.close()
