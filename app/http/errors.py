"""OpenAI-style errors: every failure leaves the HTTP process as {"error": {message, type, param, code}}."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class APIError(Exception):
    """An error with its HTTP status; raised anywhere in a route, rendered by the app's handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> APIError:
    suffix = f": {detail}" if detail else ""
    return APIError(400, f"'{param}' is not supported by this server{suffix}", param=param,
                    code="unsupported_parameter")


CLIENT_CLOSED = 499  # the status logged for a request whose client went away (nginx's convention)


class ClientGone(Exception):
    """The client disconnected; its engine requests are already aborted and nobody reads a reply."""
