"""Process-wide HTTP state: admission (ready / draining), in-flight generation requests, weight version."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request

from app.http.config import HttpConfig
from app.http.engine_client import BaseEngineClient
from app.http.errors import APIError
from app.http.request_log import RequestLog

RETRY_AFTER_S = "5"


class ServerState:
    def __init__(self, config: HttpConfig, client: BaseEngineClient, health_generate_timeout: float) -> None:
        self.config = config
        self.client = client
        self.request_log = RequestLog(config.enable_log_requests, config.log_requests_level)
        self.health_generate_timeout = health_generate_timeout
        self.weight_version = config.weight_version
        self.started = int(time.time())
        self.draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def inflight(self) -> int:
        return self._inflight

    def ready(self) -> bool:
        return self.client.ready and not self.draining

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
        if not self.client.ready:
            raise APIError(503, "the engine is not ready yet", headers={"Retry-After": RETRY_AFTER_S})

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
