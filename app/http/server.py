"""build_app: the Starlette application of the HTTP process."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from app.http import control, health, native, openai_routes
from app.http.auth import ApiKeyMiddleware
from app.http.config import HttpConfig
from app.http.engine_client import BaseEngineClient
from app.http.errors import APIError, ClientGone, error_body
from app.http.runner import CLIENT_CLOSED
from app.http.state import ServerState
from app.http.streaming import JSON

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


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
    settings: Any,
    client: BaseEngineClient,
    *,
    extra_routes: Sequence[BaseRoute] = (),
    health_generate_timeout: float = HEALTH_GENERATE_TIMEOUT_S,
) -> Starlette:
    """The app; `settings` is app.config.Settings (or an HttpConfig). Its lifespan opens and closes
    the engine client; `app.state.http` is the ServerState (drain control, in-flight count)."""
    config = HttpConfig.from_settings(settings)
    state = ServerState(config, client, health_generate_timeout)
    routes = [*health.ROUTES, *openai_routes.ROUTES, *native.ROUTES, *control.ROUTES, *extra_routes]
    middleware = []
    if config.api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key, open_paths=health.OPEN_PATHS))

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
