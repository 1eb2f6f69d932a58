"""Process-wide HTTP state: admission (ready / draining), in-flight generation requests, and the served
weights' identity (version and model path): the one place every route reads them from."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.requests import Request

from app.http.config import HttpConfig
from app.http.engine_client import BaseEngineClient
from app.http.errors import APIError
from app.http.request_log import RequestLog
from app.protocol import ControlReply, WeightIdentity

RETRY_AFTER_S = "5"


class ServerState:
    def __init__(self, config: HttpConfig, client: BaseEngineClient, health_generate_timeout: float) -> None:
        self.config = config
        self.client = client
        self.request_log = RequestLog(config.enable_log_requests, config.log_requests_level)
        self.health_generate_timeout = health_generate_timeout
        # Changed by /update_weight_version and by the engine's replies to weight updates.
        self.weight_version = config.weight_version
        self.model_path = config.model_path
        client.on_control_reply = self.apply_engine_reply
        self.started = int(time.time())
        self.draining = False
        # Set when the supervisor reports an engine failure: the appliance is going down.
        self.engine_failure: str | None = None
        # Why the engine cannot serve right now (a process stopped reporting liveness), or None.
        self.engine_problem: Callable[[], str | None] = lambda: None
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def apply_engine_reply(self, reply: ControlReply) -> None:
        """A successful weight update reports the version (if one was given) and model path it set."""
        identity = reply.result
        if not reply.success or not isinstance(identity, WeightIdentity):
            return
        if identity.weight_version is not None:
            self.weight_version = identity.weight_version
        if identity.model_path is not None:
            self.model_path = identity.model_path

    @property
    def inflight(self) -> int:
        return self._inflight

    def ready(self) -> bool:
        return self.unready_reason() is None

    def unready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if self.engine_failure is not None:
            return f"the engine failed: {self.engine_failure}"
        if not self.client.ready:
            return "not ready"
        return self.engine_problem()

    def begin_drain(self) -> None:
        """New generation requests get 503 from now on and readiness turns 503."""
        self.draining = True

    async def wait_drained(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; False if timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def check_admission(self) -> None:
        """Raise the 503 a new generation request gets while the engine is not ready or we drain."""
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S})
        if self.engine_failure is not None:
            raise APIError(503, f"the engine failed ({self.engine_failure}); the server is restarting",
                           headers={"Retry-After": RETRY_AFTER_S})
        if not self.client.ready:
            raise APIError(503, "the engine is not ready yet", headers={"Retry-After": RETRY_AFTER_S})

    def check_capacity(self, size: int) -> None:
        """A request of `size` engine requests (prompts x n) must fit the appliance: 400 if it never can,
        503 with Retry-After while the running and queued requests leave no room."""
        cfg = self.config
        limits = f"--max-num-seqs {cfg.max_num_seqs} + --max-queued-requests {cfg.max_queued_requests}"
        if cfg.data_parallel_size > 1:
            limits = f"({limits}) x --data-parallel-size {cfg.data_parallel_size}"
        if size > cfg.capacity:
            raise APIError(400, f"this request needs {size} sequences (prompts x n) but the server holds at most "
                           f"{cfg.capacity} at once ({limits})", code="too_many_sequences")
        inflight = self.client.num_inflight
        if inflight + size > cfg.capacity:
            raise APIError(503, f"the server is at capacity: {inflight} requests are running or queued ({limits}); "
                           "retry later", code="queue_full", headers={"Retry-After": RETRY_AFTER_S})

    def acquire(self) -> None:
        """Count one generation request as in flight; pair with exactly one release()."""
        self._inflight += 1
        self._idle.clear()

    def release(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()


def server_state(request: Request) -> ServerState:
    return request.app.state.http
