"""An in-process engine for the HTTP tests: it answers GenerateRequests from a script, records every
message the HTTP process sends, and can hold requests so tests decide what happens next.

Fake tokenization, shared with the tests' expectations: a text prompt has one token per
whitespace-separated word, an input_ids prompt its ids, a chat one token per word of content plus
3 per message. Output piece i is token id 100 + i.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import httpx

from app import protocol
from app.config import Settings
from app.http.engine_client import BaseEngineClient
from app.http.server import build_app
from app.protocol import (
    FINISH_ABORT,
    AbortRequest,
    ControlReply,
    ControlRequest,
    EngineInfo,
    EngineReady,
    GenerateRequest,
    TextDelta,
    TextDeltas,
    TokenLogprobs,
)
from tests.support.settings import make_settings
from tests.support.threaded_server import ThreadedServer

MODEL = "tiny-model"
MODEL_PATH = "/models/tiny"
VOCAB = 512
INFO = {"weights_gb": 0.001, "startup_seconds": 1.5}  # the start-up figures of EngineReady.info
ENGINE = EngineInfo(max_model_len=2048, vocab_size=VOCAB, eos_token_ids=[2], num_blocks=64, block_size=16,
                    max_top_logprobs=20)
PIECES = ["Hello", " world", ",", " how", " are", " you", "?"]

Script = Callable[[GenerateRequest], list[TextDelta] | None]


def settings(**overrides: Any) -> Settings:
    """The HTTP tests' settings (tests/support/settings.py): the fake model's names, a short drain."""
    fields: dict[str, Any] = {"host": "127.0.0.1", "served_model_name": MODEL, "drain_timeout": 5.0, **overrides}
    return make_settings(fields.pop("model", MODEL_PATH), **fields)


def prompt_len(req: GenerateRequest) -> int:
    if req.text is not None:
        return len(req.text.split())
    if req.input_ids is not None:
        return len(req.input_ids)
    assert req.messages is not None
    return sum(len(m["content"].split()) + 3 for m in req.messages)


def _logprobs(req: GenerateRequest, index: int) -> tuple[TokenLogprobs, str, list[str]]:
    k = req.sampling.top_logprobs
    lp = -0.5 * (index + 1)
    top_ids = [100 + index] + [300 + j for j in range(k - 1)] if k else []
    top_lps = [lp - 0.25 * j for j in range(len(top_ids))]
    return TokenLogprobs(100 + index, lp, top_ids, top_lps), PIECES[index], [f"<{t}>" for t in top_ids]


def script_pieces(pieces: list[str] = PIECES, finish: str = "stop", cached: int = 0) -> Script:
    """Answer with the given pieces, one delta per token when streaming (one delta otherwise, as the
    tokenizer does), finishing with `finish`, or "length" when max_new_tokens cuts it short."""

    def run(req: GenerateRequest) -> list[TextDelta]:
        limit = req.sampling.max_new_tokens or len(pieces)
        used = pieces[:limit]
        reason = finish if len(used) == len(pieces) else "length"
        deltas = []
        for i, piece in enumerate(used):
            d = TextDelta(rid=req.rid, text=piece, token_ids=[100 + i], prompt_tokens=prompt_len(req),
                          completion_tokens=i + 1, cached_tokens=cached)
            if req.sampling.logprobs:
                lp, text, tops = _logprobs(req, i)
                d.logprobs, d.token_texts, d.top_token_texts = [lp], [text], [tops]
            deltas.append(d)
        if not req.stream:
            deltas = [_merge(deltas)]
        deltas[-1].finish_reason = reason
        deltas[-1].matched_stop = 2 if reason == "stop" else None
        if req.return_prompt_ids:
            deltas[0].prompt_ids = list(req.input_ids or [1, 2, 3])
            deltas[0].prompt_text = req.text if req.text is not None else "<decoded prompt>"
        return deltas

    return run


def _merge(deltas: list[TextDelta]) -> TextDelta:
    out = TextDelta(rid=deltas[0].rid, text="", token_ids=[])
    for d in deltas:
        out.text += d.text
        out.token_ids += d.token_ids
        out.logprobs += d.logprobs
        out.token_texts += d.token_texts
        out.top_token_texts += d.top_token_texts
        out.prompt_tokens, out.completion_tokens, out.cached_tokens = (
            d.prompt_tokens, d.completion_tokens, d.cached_tokens)
    return out


def script_error(code: int, message: str) -> Script:
    def run(req: GenerateRequest) -> list[TextDelta]:
        return [TextDelta(rid=req.rid, text="", token_ids=[], finish_reason=FINISH_ABORT, error=message,
                          error_code=code)]

    return run


def hold(req: GenerateRequest) -> None:
    """Never answer: the test delivers deltas itself (or expects an abort)."""
    return None


class FakeEngine(BaseEngineClient):
    def __init__(self, script: Script | None = None, ready: bool = True, answer_aborts: bool = True) -> None:
        super().__init__()
        self.script = script or script_pieces()
        self.answer_aborts = answer_aborts
        self.sent: list[Any] = []
        self.control_reply: Callable[[ControlRequest], ControlReply | None] = (
            lambda msg: ControlReply(msg.req_id, True, "Cache flushed."))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events = threading.Event()  # set on every message sent (tests wait on it)
        if ready:
            self.become_ready()

    def become_ready(self, engine: EngineInfo | None = None) -> None:
        self._dispatch(EngineReady(dict(INFO), engine or ENGINE))

    def _send(self, msg: Any) -> None:
        msg = protocol.decode(protocol.encode(msg))  # what the tokenizer would receive over the wire
        self.loop = asyncio.get_running_loop()
        self.sent.append(msg)
        self.events.set()
        if isinstance(msg, GenerateRequest):
            deltas = self.script(msg)
            for delta in deltas or []:
                self.loop.call_soon(self._dispatch, TextDeltas([delta]))
        elif isinstance(msg, ControlRequest):
            reply = self.control_reply(msg)
            if reply is not None:
                self.loop.call_soon(self._dispatch, reply)
        elif isinstance(msg, AbortRequest) and self.answer_aborts:
            rids = self.inflight_rids() if msg.abort_all else [msg.rid]
            aborted = [TextDelta(rid=r, text="", token_ids=[], finish_reason=FINISH_ABORT, error=msg.reason)
                       for r in rids if r in self._sinks]
            if aborted:
                self.loop.call_soon(self._dispatch, TextDeltas(aborted))

    def deliver(self, *deltas: TextDelta) -> None:
        """Hand deltas in from any thread."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._dispatch, TextDeltas(list(deltas)))

    @property
    def generates(self) -> list[GenerateRequest]:
        return [m for m in self.sent if isinstance(m, GenerateRequest)]

    @property
    def aborts(self) -> list[AbortRequest]:
        return [m for m in self.sent if isinstance(m, AbortRequest)]

    @property
    def controls(self) -> list[ControlRequest]:
        return [m for m in self.sent if isinstance(m, ControlRequest)]


class LiveServer(ThreadedServer):
    """A real uvicorn on a free port, in a thread, serving build_app around a FakeEngine."""

    def __init__(self, engine: FakeEngine, **setting_overrides: Any) -> None:
        self.engine = engine
        self.app = build_app(settings(**setting_overrides), engine)
        super().__init__(self.app)
        assert not self.thread.is_alive()


def asgi_client(engine: FakeEngine, **setting_overrides: Any) -> httpx.AsyncClient:
    """An httpx client that calls build_app in-process (no lifespan, no sockets)."""
    app = build_app(settings(**setting_overrides), engine)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse(text: str) -> list[Any]:
    """The payloads of an SSE body; [DONE] stays a string."""
    out = []
    for event in (e for e in text.split("\n\n") if e):
        assert event.startswith("data: "), event
        data = event[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body with this status; param, when given, is named in it."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param
        assert param in body["error"]["message"]
    return body["error"]
