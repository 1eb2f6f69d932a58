"""The HTTP process's only door to the engine: generate, abort and control over ZMQ.

BaseEngineClient holds the routing logic (per-request sinks, control futures, readiness) and
leaves the transport to `_send`; EngineClient is the ZMQ transport. Route tests subclass the
base with an in-process fake, so they exercise the same routing and abort semantics.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from app import ipc
from app.ipc import Endpoints
from app.protocol import (
    FINISH_ABORT,
    AbortRequest,
    ControlOp,
    ControlReply,
    ControlRequest,
    EngineInfo,
    EngineReady,
    GenerateRequest,
    ProtocolError,
    Shutdown,
    StartupPhase,
    TextDelta,
    TextDeltas,
)
from app.startup_phases import StartupProgress

log = logging.getLogger(__name__)

DeltaSink = Callable[[TextDelta], None]


class EngineUnavailable(RuntimeError):
    """The engine connection is closed (shutting down) or was never opened."""


class DuplicateRequestId(ValueError):
    pass


def is_terminal(delta: TextDelta) -> bool:
    """Every engine request ends with exactly one delta that has a finish reason or an error."""
    return delta.finish_reason is not None or delta.error_code != 0 or delta.error is not None


def delta_error(delta: TextDelta) -> tuple[int, str] | None:
    """(HTTP status, message) when the delta reports a failure; None for normal and abort deltas.

    Errors arrive as finish_reason "abort" with an error message and error_code 400 (bad request,
    e.g. prompt too long) or 500 (engine failure). A plain abort has error_code 0 and its reason
    in `error`.
    """
    if delta.error_code:
        return delta.error_code, delta.error or "engine error"
    if delta.error is not None and delta.finish_reason != FINISH_ABORT:
        return 500, delta.error
    return None


class Submission:
    """One engine request in flight; close() aborts it unless it already finished."""

    def __init__(self, client: BaseEngineClient, rid: str) -> None:
        self._client = client
        self.rid = rid
        self.finished = False
        self.closed = False
        self.counts = (0, 0, 0)  # prompt, completion, cached tokens as last reported

    def close(self, reason: str = "the client closed the request") -> None:
        if self.closed:
            return
        self.closed = True
        self._client._unregister(self.rid)
        if not self.finished:
            self._client._send_abort(AbortRequest(rid=self.rid, reason=reason))


class BaseEngineClient(abc.ABC):
    def __init__(self, on_shutdown: Callable[[str], None] | None = None) -> None:
        self.ready = False
        self.info: dict[str, Any] = {}  # the engine's start-up figures (reports and metrics)
        self.engine = EngineInfo()  # what requests are checked against; its zeros until ready
        self.startup = StartupProgress()  # where start-up is, for /readiness until ready
        self.on_shutdown = on_shutdown
        self._sinks: dict[str, tuple[Submission, DeltaSink]] = {}
        self._controls: dict[str, asyncio.Future[ControlReply]] = {}
        # Sees every control reply as it arrives, before any later output is delivered (ServerState
        # applies a weight update's new version here, so no later response carries the old one).
        self.on_control_reply: Callable[[ControlReply], None] | None = None

    # ------------------------------------------------------------ transport

    @abc.abstractmethod
    def _send(self, msg: Any) -> None:
        """Send one message to the tokenizer; must not block."""

    async def start(self) -> None:  # noqa: B027 (in-process clients have nothing to open)
        """Open the transport."""

    async def close(self) -> None:
        self._fail_controls()

    # ------------------------------------------------------------ requests

    @property
    def num_inflight(self) -> int:
        return len(self._sinks)

    def inflight_rids(self) -> list[str]:
        return list(self._sinks)

    def submit(self, req: GenerateRequest, sink: DeltaSink) -> Submission:
        """Register rid and send the request now; every delta for it is handed to sink."""
        if req.rid in self._sinks:
            raise DuplicateRequestId(f"request id {req.rid!r} is already in flight")
        sub = Submission(self, req.rid)
        self._sinks[req.rid] = (sub, sink)
        try:
            self._send(req)
        except BaseException:
            self._sinks.pop(req.rid, None)
            raise
        return sub

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TextDelta]:
        """The request's deltas, ending after the terminal one; leaving early aborts it."""
        queue: asyncio.Queue[TextDelta] = asyncio.Queue()
        sub = self.submit(req, queue.put_nowait)
        try:
            while True:
                delta = await queue.get()
                yield delta
                if is_terminal(delta):
                    return
        finally:
            sub.close()

    async def abort(self, rid: str | None = None, abort_all: bool = False, reason: str = "aborted") -> None:
        """Ask the engine to abort; the aborted requests still end with their terminal delta."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort needs exactly one of rid or abort_all")
        self._send_abort(AbortRequest(rid=rid, abort_all=abort_all, reason=reason))

    def fail_all(self, reason: str, error_code: int = 0) -> int:
        """End every request in flight here, now, with an abort delta (the engine may be gone); with an
        error_code (e.g. 503 after an engine failure) the requests fail with that status."""
        subs = [sub for sub, _ in self._sinks.values()]
        for sub in subs:
            prompt, completion, cached = sub.counts
            self._deliver(TextDelta(rid=sub.rid, text="", token_ids=[], finish_reason=FINISH_ABORT,
                                    prompt_tokens=prompt, completion_tokens=completion,
                                    cached_tokens=cached, error=reason, error_code=error_code))
        return len(subs)

    async def control(self, op: ControlOp, timeout: float = 30.0) -> ControlReply:
        """Run a control operation in the engine; raises TimeoutError if no reply comes in time."""
        req_id = uuid.uuid4().hex
        future: asyncio.Future[ControlReply] = asyncio.get_running_loop().create_future()
        self._controls[req_id] = future
        try:
            self._send(ControlRequest(req_id=req_id, op=op))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._controls.pop(req_id, None)

    # ------------------------------------------------------------ inbound

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, TextDeltas):
            for delta in msg.deltas:
                self._deliver(delta)
        elif isinstance(msg, ControlReply):
            if self.on_control_reply is not None:
                self.on_control_reply(msg)
            future = self._controls.pop(msg.req_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, EngineReady):
            self.info = dict(msg.info)
            if msg.engine is not None:
                self.engine = msg.engine
            self.ready = True
            log.info("engine ready: %s", self.info)
        elif isinstance(msg, StartupPhase):
            self.startup.apply(msg)
        elif isinstance(msg, Shutdown):
            log.info("shutdown requested by the supervisor: %s", msg.reason or "no reason given")
            if self.on_shutdown is not None:
                self.on_shutdown(msg.reason)
        else:
            log.warning("dropping unexpected message %s", type(msg).__name__)

    def _deliver(self, delta: TextDelta) -> None:
        entry = self._sinks.get(delta.rid)
        if entry is None:
            return  # its consumer left (and aborted it) or a late duplicate: nobody reads it
        sub, sink = entry
        sub.counts = (delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens)
        if is_terminal(delta):
            sub.finished = True
            self._unregister(delta.rid)
        sink(delta)

    def _unregister(self, rid: str) -> None:
        self._sinks.pop(rid, None)

    def _send_abort(self, msg: AbortRequest) -> None:
        try:
            self._send(msg)
        except EngineUnavailable:
            log.debug("abort of %s not sent: the engine connection is closed", msg.rid)

    def _fail_controls(self) -> None:
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineUnavailable("the engine connection closed"))
        self._controls.clear()


class EngineClient(BaseEngineClient):
    """Binds PULL on the http inbox and pushes to the tokenizer's inbox."""

    def __init__(self, endpoints: Endpoints, on_shutdown: Callable[[str], None] | None = None) -> None:
        super().__init__(on_shutdown)
        self._endpoints = endpoints
        self._actx: zmq.asyncio.Context | None = None
        self._sctx: zmq.Context | None = None
        self._pull: Any = None
        self._push: zmq.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._actx = zmq.asyncio.Context()
        self._pull = ipc.bind_pull(self._actx, self._endpoints.inbox("http"))
        # Sends go through a plain socket: a connected PUSH with no HWM never blocks, so aborts can
        # be sent synchronously from cleanup code, even while the calling task is being cancelled.
        self._sctx = zmq.Context()
        self._push = ipc.connect_push(self._sctx, self._endpoints.inbox("tokenizer"))
        self._reader = asyncio.create_task(self._read_loop(), name="engine-client-reader")

    def _send(self, msg: Any) -> None:
        if self._push is None:
            raise EngineUnavailable("the engine connection is not open")
        ipc.send(self._push, msg)

    async def _read_loop(self) -> None:
        while True:
            try:
                msg = await ipc.recv_async(self._pull)
            except ProtocolError as exc:
                log.error("dropping a malformed message from the engine: %s", exc)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop the reader
                log.exception("failed to handle %s", type(msg).__name__)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        await super().close()
        push, self._push = self._push, None
        if push is not None:
            push.close()  # LINGER lets queued aborts out
        if self._pull is not None:
            self._pull.close()
            self._pull = None
        for ctx in (self._actx, self._sctx):
            if ctx is not None:
                ctx.term()
        self._actx = self._sctx = None
