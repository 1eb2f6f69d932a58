"""Reading request bodies: size limit, strict JSON, and pydantic errors turned into messages naming the field."""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect, Request

from app.http.errors import APIError, ClientGone, bad_request

MAX_BODY_BYTES = 32 * 1024 * 1024

Model = TypeVar("Model", bound=BaseModel)


class StrictBody(BaseModel):
    """Request bodies: unknown fields and loose types (\"1\" for 1, 1 for true) are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


def fits_the_wire(value: Any) -> Any:
    """A field validator: what the chat template gets must be msgpack-encodable (no JSON integer
    beyond 64 bits), or the request would fail on its way to the tokenizer."""
    try:
        msgpack.packb(value)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"cannot be passed to the chat template: {exc}") from None
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: Any) -> bool:
    """A \\ud800-\\udfff escape without its pair decodes to a string that is not Unicode (it cannot be
    encoded, so it would fail deep inside the engine, or while rendering an error that echoes it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


async def read_json(request: Request) -> Any:
    """The parsed JSON body; 413 past MAX_BODY_BYTES, 400 when empty or malformed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ClientGone() from exc
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as exc:
        raise bad_request(f"malformed JSON body: not valid UTF-8 ({exc})") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from exc
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise bad_request("the body has a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair): "
                          "that is not valid Unicode")
    return body


async def read_object(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_json_type(body)}")
    return body


def _too_large() -> APIError:
    return APIError(413, f"the request body exceeds {MAX_BODY_BYTES // (1024 * 1024)} MiB",
                    code="request_too_large")


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def field_path(loc: tuple[Any, ...], prefix: str = "") -> str:
    """('messages', 0, 'content') -> messages[0].content"""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(exc: ValidationError, prefix: str = "") -> APIError:
    """The first problem pydantic found, as a 400 that names the field."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    path = field_path(tuple(err["loc"]), prefix)
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = f"unknown parameter '{path}'"
    elif err["type"] == "missing":
        message = f"'{path}' is required"
    elif path:
        message = f"invalid value for '{path}': {msg}"
    else:
        message = msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param=path or None)


def validate(model: type[Model], data: Any, prefix: str = "") -> Model:
    if not isinstance(data, dict):
        raise bad_request(f"'{prefix or 'body'}' must be a JSON object, not {_json_type(data)}",
                          param=prefix or None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, prefix) from exc
