"""The HTTP process: run_http(settings, endpoints) serves until SIGTERM or the supervisor's Shutdown.

SIGINT is ignored (the supervisor coordinates shutdown). SIGTERM drains: new generation requests get
503 while the ones in flight may finish for up to drain_timeout seconds; what is left is aborted, each
request still getting a terminal response, and then uvicorn stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn
import zmq

from app import ipc
from app.http.config import HttpConfig
from app.http.engine_client import EngineClient
from app.http.server import build_app
from app.http.state import ServerState
from app.ipc import Endpoints
from app.protocol import ProcessReady

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 5.0  # after an abort, time for the terminal responses to go out
STARTUP_POLL_S = 0.02


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # run_http owns SIGINT/SIGTERM; uvicorn's handlers would exit without draining


def configure_logging(config: HttpConfig) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s http %(name)s: %(message)s")
    logging.getLogger("app").setLevel(config.log_level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(config.log_level_http.upper())
    if config.enable_log_requests:
        logging.getLogger("app.http.requests").setLevel(logging.INFO)


def run_http(settings: Any, endpoints: Endpoints) -> None:
    config = HttpConfig.from_settings(settings)
    configure_logging(config)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(settings, config, endpoints))


async def drain_and_stop(state: ServerState, server: uvicorn.Server, timeout: float) -> None:
    state.begin_drain()
    if not await state.wait_drained(timeout):
        log.warning("%d request(s) still in flight after %g s: aborting them", state.inflight, timeout)
        await state.client.abort(abort_all=True, reason="the server is shutting down")
        state.client.fail_all("the server is shutting down")
        await state.wait_drained(FLUSH_TIMEOUT_S)
    server.should_exit = True


async def _serve(settings: Any, config: HttpConfig, endpoints: Endpoints) -> None:
    loop = asyncio.get_running_loop()
    stop_after: asyncio.Queue[float] = asyncio.Queue()
    client = EngineClient(endpoints, on_shutdown=lambda reason: stop_after.put_nowait(0.0))
    app = build_app(settings, client)
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on", log_config=None,
        access_log=config.log_level_http == "debug", timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
    ))
    loop.add_signal_handler(signal.SIGTERM, stop_after.put_nowait, config.drain_timeout)
    serving = asyncio.create_task(server.serve(), name="uvicorn")
    while not server.started and not serving.done():
        await asyncio.sleep(STARTUP_POLL_S)
    if server.started:
        port = server.servers[0].sockets[0].getsockname()[1]
        _announce(endpoints, {"port": port})
        log.info("http listening on %s:%d", config.host, port)
        stopping = asyncio.create_task(stop_after.get())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if stopping.done():
            await drain_and_stop(app.state.http, server, stopping.result())
        else:
            stopping.cancel()
    loop.remove_signal_handler(signal.SIGTERM)
    await serving  # re-raises a start-up failure (uvicorn exits 1 when it cannot bind)


def _announce(endpoints: Endpoints, info: dict[str, Any]) -> None:
    ctx = zmq.Context()
    try:
        sock = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
        ipc.send(sock, ProcessReady(name="http", pid=os.getpid(), info=info))
        sock.close()
    finally:
        ctx.term()
