"""API-key check for every route but the health probes (ASGI middleware; the key is never logged)."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.errors import APIError


def presented_key(headers: Headers) -> str | None:
    """`Authorization: Bearer <key>` or `x-api-key: <key>`."""
    auth = headers.get("authorization")
    if auth is not None:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    return headers.get("x-api-key")


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...]) -> None:
        self.app = app
        self._key = api_key.encode()
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._allowed(Headers(scope=scope)):
            await self.app(scope, receive, send)
            return
        error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _allowed(self, headers: Headers) -> bool:
        key = presented_key(headers)
        return key is not None and hmac.compare_digest(key.encode(), self._key)
