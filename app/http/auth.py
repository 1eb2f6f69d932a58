"""API-key checks (ASGI middleware). Every route needs the API key except the open ones (health probes,
/metrics); with --admin-api-key the control routes need the admin key instead, which also opens every
other route. Bound to a non-loopback address without an admin key, the control routes are closed (403
whatever the key) unless --allow-remote-admin opens them. Keys are compared in constant time, as SHA-256 digests so that not even a key's length
shows in the timing; they are never logged."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

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


OPEN, API, ADMIN = "open", "api", "admin"  # who may call a route: anyone, API-key holders, admins
ADMIN_CLOSED = APIError(
    403, "the control routes are closed: the appliance listens on a non-loopback address without an admin key. "
    "Set --admin-api-key (TOKENSPEED_ADMIN_API_KEY) and send it, or start with --allow-remote-admin to open them",
    code="admin_routes_closed")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_matches(presented: str | None, expected: bytes | None) -> bool:
    """Constant time in the presented key's value and length."""
    if presented is None or expected is None:
        return False
    return hmac.compare_digest(key_digest(presented), expected)


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, open_paths: Iterable[str], *,
                 admin_key: str | None = None, admin_paths: Iterable[str] = (), admin_closed: bool = False) -> None:
        self.app = app
        self._api = key_digest(api_key) if api_key else None
        self._admin = key_digest(admin_key) if admin_key else None
        self._open = frozenset(open_paths)
        self._admin_paths = frozenset(admin_paths)
        self._admin_closed = admin_closed

    def access(self, path: str) -> str:
        if path in self._open:
            return OPEN
        admin = self._admin is not None or self._admin_closed
        return ADMIN if admin and path in self._admin_paths else API

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        level = self.access(scope["path"])
        if level == ADMIN and self._admin_closed:
            await ADMIN_CLOSED.response()(scope, receive, send)
            return
        key = presented_key(Headers(scope=scope)) if level != OPEN else None
        if level == OPEN or key_matches(key, self._admin) or (level == API and self._api_allows(key)):
            await self.app(scope, receive, send)
            return
        if level == ADMIN and key_matches(key, self._api):
            error = APIError(403, "this control route needs the admin API key (--admin-api-key)",
                             code="admin_key_required")
        else:
            error = APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _api_allows(self, key: str | None) -> bool:
        return self._api is None or key_matches(key, self._api)
