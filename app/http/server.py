"""The HTTP process: build_app (the Starlette app) and run_http (the process entry).

run_http serves until SIGTERM or the supervisor's Shutdown. SIGINT is ignored (the supervisor
coordinates shutdown). SIGTERM drains: new generation requests get 503 while the ones in flight may
finish for up to drain_timeout seconds; what is left is aborted, each request still getting a
terminal response, and then uvicorn stops. Shutdown means an engine process failed: every request in
flight fails at once with 503, and uvicorn stops. The event loop beats the http heartbeat; readiness
follows the engine processes' heartbeats (app/http/liveness.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import uvicorn
import zmq
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from app import ipc
from app.config.settings import Settings
from app.http import control, health, native, openai_routes, openapi, rl_control, tokenize_routes
from app.http.auth import ADMIN, ApiKeyMiddleware
from app.http.config import HttpConfig, is_loopback
from app.http.engine_client import BaseEngineClient, EngineClient
from app.http.errors import CLIENT_CLOSED, APIError, ClientGone, error_body
from app.http.liveness import EngineLiveness, beat_forever
from app.http.state import ServerState
from app.http.streaming import JSON
from app.ipc import Endpoints
from app.lifecycle import Heartbeat, settle_heap
from app.metrics.exposition import metrics_route
from app.protocol import ProcessReady

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
FLUSH_TIMEOUT_S = 5.0  # after an abort, time for the terminal responses to go out
STARTUP_POLL_S = 0.02


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return JSON(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED)  # nobody reads it


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSON(error_body(500, "internal server error"), status_code=500)


def build_app(
    settings: Settings,
    client: BaseEngineClient,
    *,
    extra_routes: Sequence[BaseRoute] = (),
    health_generate_timeout: float = HEALTH_GENERATE_TIMEOUT_S,
) -> Starlette:
    """The app for these settings. Its lifespan opens and closes
    the engine client; `app.state.http` is the ServerState (drain control, in-flight count)."""
    config = HttpConfig.from_settings(settings)
    state = ServerState(config, client, health_generate_timeout)
    routes = [*health.ROUTES, *openai_routes.ROUTES, *tokenize_routes.ROUTES, *native.ROUTES, *control.ROUTES,
              *rl_control.ROUTES,
              *openapi.ROUTES, *extra_routes]
    open_paths = health.OPEN_PATHS
    if config.enable_metrics:  # scrapers carry no key; without --enable-metrics /metrics is a 404
        routes.append(metrics_route(config.served_model_name, lambda: client.info if client.ready else None))
        open_paths = (*open_paths, "/metrics")
    middleware = []
    if config.api_key or config.admin_api_key or config.admin_closed:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=open_paths,
                                     admin_key=config.admin_api_key, admin_paths=openapi.paths_with(ADMIN),
                                     admin_closed=config.admin_closed))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            ClientGone: _client_gone,
            Exception: _internal_error,
        },
    )
    app.state.http = state
    return app


# ---------------------------------------------------------------- the process


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


def run_http(settings: Settings, endpoints: Endpoints) -> None:
    config = HttpConfig.from_settings(settings)
    configure_logging(config)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_admin_access(config)
    asyncio.run(_serve(settings, config, endpoints))


def log_admin_access(config: HttpConfig) -> None:
    """Say at start-up who can reach the control routes when the bind is public."""
    if config.admin_api_key or is_loopback(config.host):
        return
    if config.admin_closed:
        log.info("control routes closed on %s without --admin-api-key (403; see docs/operations.md)", config.host)
    else:
        log.warning("--allow-remote-admin: the control routes (abort, pause, weight updates) are open on %s to "
                    "%s; set --admin-api-key to guard them", config.host,
                    "--api-key holders" if config.api_key else "anyone who can reach the port")


async def drain_and_stop(state: ServerState, server: uvicorn.Server, timeout: float,
                         failure: str | None = None) -> None:
    """Drain for up to `timeout` s; after an engine failure, fail everything in flight with 503 at once."""
    if failure is not None:
        state.engine_failure = failure
        log.error("the engine failed (%s): failing %d request(s) in flight", failure, state.inflight)
        state.client.fail_all(f"the engine failed ({failure}); the server is restarting", error_code=503)
        await state.wait_drained(FLUSH_TIMEOUT_S)
        server.should_exit = True
        return
    state.begin_drain()
    if not await state.wait_drained(timeout):
        log.warning("%d request(s) still in flight after %g s: aborting them", state.inflight, timeout)
        await state.client.abort(abort_all=True, reason="the server is shutting down")
        state.client.fail_all("the server is shutting down")
        await state.wait_drained(FLUSH_TIMEOUT_S)
    server.should_exit = True


async def _serve(settings: Settings, config: HttpConfig, endpoints: Endpoints) -> None:
    loop = asyncio.get_running_loop()
    # (drain timeout, engine failure): SIGTERM drains; the supervisor's Shutdown reports a failure.
    stop_after: asyncio.Queue[tuple[float, str | None]] = asyncio.Queue()
    client = EngineClient(endpoints, on_shutdown=lambda reason: stop_after.put_nowait(
        (0.0, reason or "an engine process failed")))
    app = build_app(settings, client)
    liveness = EngineLiveness.of(endpoints.runtime_dir, config)
    app.state.http.engine_problem = liveness.problem
    heartbeat = Heartbeat.attach(endpoints.runtime_dir, "http")
    beating = asyncio.create_task(beat_forever(heartbeat, liveness), name="heartbeat")
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on", log_config=None,
        access_log=config.log_level_http == "debug", timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
    ))
    loop.add_signal_handler(signal.SIGTERM, stop_after.put_nowait, (config.drain_timeout, None))
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
            await drain_and_stop(app.state.http, server, *stopping.result())
        else:
            stopping.cancel()
    loop.remove_signal_handler(signal.SIGTERM)
    beating.cancel()
    await serving  # re-raises a start-up failure (uvicorn exits 1 when it cannot bind)
    if not server.started:
        raise RuntimeError("the HTTP server did not start (lifespan start-up failed: see the log above)")


def _announce(endpoints: Endpoints, info: dict[str, Any]) -> None:
    settle_heap()
    ctx = zmq.Context()
    try:
        sock = ipc.connect_push(ctx, endpoints.inbox("supervisor"))
        ipc.send(sock, ProcessReady(name="http", pid=os.getpid(), info=info))
        sock.close()
    finally:
        ctx.term()
