"""Running one HTTP request's engine requests: fan-out groups, disconnect watching and SSE responses."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.http.engine_client import DuplicateRequestId, EngineUnavailable, Submission, delta_error, is_terminal
from app.http.errors import CLIENT_CLOSED, APIError, ClientGone, bad_request, error_body
from app.http.state import RETRY_AFTER_S, ServerState
from app.protocol import GenerateRequest, TextDelta

log = logging.getLogger(__name__)

T = TypeVar("T")
Item = tuple[int, TextDelta]
DONE = b"data: [DONE]\n\n"


class RequestGroup:
    """The engine requests answering one HTTP request (prompts x n), their deltas merged in arrival
    order. Counts as one in-flight request until closed; closing aborts whatever has not finished."""

    def __init__(self, state: ServerState, requests: Sequence[GenerateRequest]) -> None:
        self._state = state
        self._queue: asyncio.Queue[Item] = asyncio.Queue()
        self._subs: list[Submission] = []
        self._pending = len(requests)
        self._closed = False
        self.size = len(requests)
        state.check_capacity(self.size)
        state.acquire()
        try:
            for i, req in enumerate(requests):
                self._subs.append(state.client.submit(req, functools.partial(self._on_delta, i)))
        except UnicodeEncodeError as exc:  # a lone surrogate the body check did not see
            self.close()
            raise bad_request(f"the request holds text that is not valid Unicode: {exc.reason}") from exc
        except DuplicateRequestId as exc:
            self.close()
            raise bad_request(f"invalid value for 'rid': {exc}", param="rid") from exc
        except EngineUnavailable as exc:
            self.close()
            raise APIError(503, f"the engine is unavailable: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def _on_delta(self, index: int, delta: TextDelta) -> None:
        self._queue.put_nowait((index, delta))

    async def next(self) -> Item | None:
        """The next (choice index, delta); None once every request has delivered its terminal delta."""
        if self._pending == 0:
            return None
        index, delta = await self._queue.get()
        if is_terminal(delta):
            self._pending -= 1
        return index, delta

    async def first_round(self) -> list[Item]:
        """Read until every request has answered once, or one failed (a prompt too long shows here)."""
        items: list[Item] = []
        seen: set[int] = set()
        while len(seen) < self.size:
            item = await self.next()
            if item is None:
                break
            items.append(item)
            seen.add(item[0])
            if delta_error(item[1]) is not None:
                break
        return items

    async def replay(self, prefix: Sequence[Item]) -> AsyncIterator[Item]:
        for item in prefix:
            yield item
        while (item := await self.next()) is not None:
            yield item

    def close(self, reason: str = "the client went away") -> None:
        if self._closed:
            return
        self._closed = True
        for sub in self._subs:
            sub.close(reason)
        self._state.release()


# ---------------------------------------------------------------- accumulating deltas


def copy_delta(delta: TextDelta) -> TextDelta:
    return dataclasses.replace(
        delta, token_ids=list(delta.token_ids), logprobs=list(delta.logprobs),
        token_texts=list(delta.token_texts), top_token_texts=list(delta.top_token_texts),
        tool_calls=list(delta.tool_calls), prompt_logprobs=list(delta.prompt_logprobs),
    )


def absorb(acc: TextDelta, delta: TextDelta) -> None:
    """Append delta's output to acc; counts and the finish state are the latest ones."""
    acc.text += delta.text
    acc.reasoning_text += delta.reasoning_text
    acc.tool_calls.extend(delta.tool_calls)
    acc.token_ids.extend(delta.token_ids)
    acc.logprobs.extend(delta.logprobs)
    acc.token_texts.extend(delta.token_texts)
    acc.top_token_texts.extend(delta.top_token_texts)
    for name in ("finish_reason", "matched_stop", "prompt_tokens", "completion_tokens", "cached_tokens",
                 "error", "error_code"):
        setattr(acc, name, getattr(delta, name))
    if not acc.prompt_ids:
        acc.prompt_ids = delta.prompt_ids
    if acc.prompt_text is None:
        acc.prompt_text = delta.prompt_text
    if delta.prompt_logprobs:  # they come once, on the first delta
        acc.prompt_logprobs = list(delta.prompt_logprobs)
        acc.prompt_token_texts = delta.prompt_token_texts
        acc.prompt_top_token_texts = delta.prompt_top_token_texts


class Outputs:
    """Per choice, everything received so far."""

    def __init__(self, size: int) -> None:
        self.items: list[TextDelta | None] = [None] * size

    def add(self, index: int, delta: TextDelta) -> None:
        current = self.items[index]
        if current is None:
            self.items[index] = copy_delta(delta)
        else:
            absorb(current, delta)

    def finals(self) -> list[TextDelta]:
        assert all(o is not None for o in self.items)
        return [o for o in self.items if o is not None]


def error_of(delta: TextDelta) -> APIError | None:
    err = delta_error(delta)
    if err is None:
        return None
    status, message = err
    status = status if 400 <= status < 600 else 500
    return APIError(status, message, headers={"Retry-After": RETRY_AFTER_S} if status == 503 else None)


async def collect(group: RequestGroup, outputs: Outputs) -> list[TextDelta]:
    """Every choice's whole output; an error delta raises (the caller's close aborts the rest)."""
    while (item := await group.next()) is not None:
        index, delta = item
        if (err := error_of(delta)) is not None:
            raise err
        outputs.add(index, delta)
    return outputs.finals()


# ---------------------------------------------------------------- client disconnects


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_or_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await work unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


# ---------------------------------------------------------------- server-sent events


def _finite(value: Any) -> Any:
    """JSON has no -inf/NaN: a -inf logprob is written as -9999.0, as OpenAI-compatible servers do."""
    if isinstance(value, float) and not math.isfinite(value):
        return -9999.0
    return value


def json_text(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), default=str)


# JSON may carry these three raw (it escapes the other characters str.splitlines breaks at: they are control
# characters), but SSE readers that split the stream with str.splitlines (httpx's aiter_lines among them)
# would cut a data line there. Escaped, they stay inside strings and every reader gets the same text.
_SPLITLINES_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sanitize(payload: Any) -> Any:
    if isinstance(payload, dict):
        return {k: sanitize(v) for k, v in payload.items()}
    if isinstance(payload, list):
        return [sanitize(v) for v in payload]
    return _finite(payload)


class JSON(Response):
    """application/json with -inf/NaN made finite (logprobs can be -inf; JSON cannot say so)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_text(sanitize(content)).encode()


def sse_event(payload: Any) -> bytes:
    return b"data: " + json_text(sanitize(payload)).translate(_SPLITLINES_ESCAPES).encode() + b"\n\n"


class StreamFormatter(Protocol):
    """Turns a group's deltas into the chunks of one API's stream."""

    def opening(self) -> list[dict[str, Any]]: ...

    def on_delta(self, index: int, delta: TextDelta) -> list[dict[str, Any]]: ...

    def closing(self) -> list[dict[str, Any]]: ...


async def sse_events(
    group: RequestGroup,
    prefix: Sequence[Item],
    formatter: StreamFormatter,
    on_done: Callable[[Outputs, int], None],
) -> AsyncGenerator[bytes, None]:
    """The SSE body: chunks, an error chunk if the engine fails mid-stream, then [DONE]."""
    outputs = Outputs(group.size)
    status = CLIENT_CLOSED  # until the stream runs to its end
    err: APIError | None = None
    try:
        for payload in formatter.opening():
            yield sse_event(payload)
        async for index, delta in group.replay(prefix):
            if (err := error_of(delta)) is not None:
                yield sse_event(err.body())
                break
            outputs.add(index, delta)
            for payload in formatter.on_delta(index, delta):
                yield sse_event(payload)
        else:
            for payload in formatter.closing():
                yield sse_event(payload)
        status = err.status if err is not None else 200
        yield DONE
    except Exception:
        log.exception("stream failed")
        status = 500
        yield sse_event(error_body(500, "internal error while streaming the response"))
        yield DONE
    finally:
        group.close()
        on_done(outputs, status)


class SSEResponse:
    """A text/event-stream response that aborts its engine requests the moment the client leaves,
    whether or not a chunk is being written (the body is cancelled when http.disconnect arrives)."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")],
        })
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, receive, tg.cancel_scope)
                async for chunk in self._events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()

    @staticmethod
    async def _watch(receive: Receive, scope: anyio.CancelScope) -> None:
        await wait_for_disconnect(receive)
        scope.cancel()
