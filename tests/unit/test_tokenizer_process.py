"""run_tokenizer in a real spawned process, over real ipc:// ZMQ sockets in a temp dir.

The test plays the supervisor, http and the scheduler: it binds their inboxes, starts the process,
and talks to it only through messages and signals.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from transformers import AutoTokenizer

from app import ipc
from app.config.settings import Settings
from app.ipc import Endpoints
from app.protocol import (
    ControlRequest,
    EngineInfo,
    EngineReady,
    FinishRequest,
    GenerateRequest,
    GetLoads,
    ProcessReady,
    SamplingParams,
    Shutdown,
    TextDeltas,
    TokenDelta,
    TokenDeltas,
    TokenizedRequest,
)
from app.tokenizer.process import run_tokenizer
from tests.support.tokenizer_factory import build_tokenizer

TIMEOUT_MS = 60_000  # spawn + imports + tokenizer load, on a busy 2-core machine


@dataclass
class Harness:
    proc: Any
    to_tokenizer: zmq.Socket
    inbox: dict[str, zmq.Socket]  # supervisor, http, scheduler
    tok_dir: str

    def recv(self, name: str) -> Any:
        sock = self.inbox[name]
        assert sock.poll(TIMEOUT_MS), f"nothing arrived on the {name} inbox"
        return ipc.recv(sock)

    def send(self, msg: Any) -> None:
        ipc.send(self.to_tokenizer, msg)

    def collect_text(self, rid: str) -> list:
        """TextDeltas for rid from the http inbox, up to and including its terminal one."""
        deltas = []
        while not deltas or deltas[-1].finish_reason is None:
            msg = self.recv("http")
            assert isinstance(msg, TextDeltas)
            deltas += [d for d in msg.deltas if d.rid == rid]
        return deltas


@pytest.fixture
def harness(tmp_path, request) -> Iterator[Harness]:
    tok_dir = tmp_path / "tok"
    build_tokenizer(tok_dir)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    endpoints = Endpoints(str(runtime))
    settings = Settings(model=str(tok_dir), stream_interval=1, **getattr(request, "param", {}))
    ctx = zmq.Context()
    inbox = {name: ipc.bind_pull(ctx, endpoints.inbox(name)) for name in ("supervisor", "http", "scheduler")}
    to_tokenizer = ipc.connect_push(ctx, endpoints.inbox("tokenizer"))
    proc = mp.get_context("spawn").Process(target=run_tokenizer, args=(settings, endpoints), daemon=True)
    proc.start()
    try:
        yield Harness(proc, to_tokenizer, inbox, str(tok_dir))
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        for sock in [to_tokenizer, *inbox.values()]:
            sock.close(linger=0)
        ctx.term()


def wait_ready(h: Harness) -> ProcessReady:
    ready = h.recv("supervisor")
    assert isinstance(ready, ProcessReady) and ready.name == "tokenizer" and ready.pid == h.proc.pid
    h.send(EngineReady(engine=EngineInfo(max_model_len=128, vocab_size=512, eos_token_ids=[2])))
    assert isinstance(h.recv("http"), EngineReady)  # forwarded: http learns readiness from the tokenizer
    return ready


@pytest.mark.slow  # a tokenizer process
def test_round_trip_stop_string_and_sigterm(harness):
    h = harness
    ready = wait_ready(h)
    assert ready.engine is not None and ready.engine.max_token_chars >= 1

    sampling = SamplingParams(max_new_tokens=20, stop=["fox"])
    h.send(GenerateRequest(rid="r1", sampling=sampling, text="Once upon a time", stream=True))
    tokenized = h.recv("scheduler")
    assert isinstance(tokenized, TokenizedRequest) and tokenized.rid == "r1" and len(tokenized.prompt_ids) > 2

    # Generated text, one token per message, as the scheduler would send it.
    tok = AutoTokenizer.from_pretrained(h.tok_dir)
    ids = tok.encode(" The quick brown fox jumps")
    for i, tid in enumerate(ids):
        h.send(TokenDeltas([TokenDelta("r1", [tid], prompt_tokens=len(tokenized.prompt_ids), completion_tokens=i + 1)]))
    deltas = h.collect_text("r1")
    assert "".join(d.text for d in deltas) == " The quick brown "
    assert (deltas[-1].finish_reason, deltas[-1].matched_stop) == ("stop", "fox")
    assert h.recv("scheduler") == FinishRequest("r1")

    # A malformed message is dropped; the process keeps serving. SIGINT is ignored.
    h.to_tokenizer.send(b"\xc1 not msgpack")
    os.kill(h.proc.pid, signal.SIGINT)
    h.send(ControlRequest(req_id="c1", op=GetLoads()))
    assert h.recv("scheduler") == ControlRequest(req_id="c1", op=GetLoads())
    assert h.proc.is_alive()

    h.proc.terminate()  # SIGTERM: a clean exit
    h.proc.join(30)
    assert h.proc.exitcode == 0


@pytest.mark.parametrize("harness", [{"skip_tokenizer_init": True}], indirect=True)
def test_skip_tokenizer_init_and_shutdown(harness):
    h = harness
    ready = wait_ready(h)
    assert ready.engine == EngineInfo()
    h.send(GenerateRequest(rid="t", sampling=SamplingParams(), text="hi"))
    [err] = h.collect_text("t")
    assert err.error_code == 400 and "--skip-tokenizer-init" in err.error

    h.send(GenerateRequest(rid="i", sampling=SamplingParams(max_new_tokens=2), input_ids=[5, 6], stream=False))
    assert h.recv("scheduler") == TokenizedRequest("i", [5, 6], SamplingParams(max_new_tokens=2))
    h.send(TokenDeltas([TokenDelta("i", [7], completion_tokens=1)]))
    h.send(TokenDeltas([TokenDelta("i", [8], finish_reason="length", completion_tokens=2)]))
    [final] = h.collect_text("i")
    assert (final.token_ids, final.text, final.finish_reason) == ([7, 8], "", "length")

    h.send(Shutdown(reason="test"))
    h.proc.join(30)
    assert h.proc.exitcode == 0
