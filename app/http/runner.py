"""Running a group of engine requests for one HTTP request, as a whole reply or as an SSE stream."""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request

from app.http.errors import CLIENT_CLOSED, APIError, ClientGone
from app.http.state import ServerState
from app.http.streaming import (
    Outputs,
    RequestGroup,
    SSEResponse,
    StreamFormatter,
    collect,
    error_of,
    run_or_disconnect,
    sse_events,
)
from app.protocol import GenerateRequest, TextDelta


def _status(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status
    return CLIENT_CLOSED if isinstance(exc, ClientGone) else 500


async def run_whole(request: Request, state: ServerState, rid: str,
                    requests: Sequence[GenerateRequest]) -> list[TextDelta]:
    """Every choice's complete output; a disconnect aborts the engine requests at once."""
    group = RequestGroup(state, requests)
    outputs = Outputs(group.size)
    status = 200
    try:
        return await run_or_disconnect(request.receive, collect(group, outputs))
    except BaseException as exc:
        status = _status(exc)
        raise
    finally:
        group.close()
        state.request_log.finished(rid, outputs.items, status)


async def run_stream(request: Request, state: ServerState, rid: str, requests: Sequence[GenerateRequest],
                     formatter: StreamFormatter) -> SSEResponse:
    """An SSE response, committed only once every request answered: an error that comes first (a prompt
    too long, an engine failure) is still an HTTP error status."""
    group = RequestGroup(state, requests)
    try:
        prefix = await run_or_disconnect(request.receive, group.first_round())
        for _, delta in prefix:
            if (err := error_of(delta)) is not None:
                raise err
    except BaseException as exc:
        group.close()
        state.request_log.finished(rid, [], _status(exc))
        raise

    def done(outputs: Outputs, status: int) -> None:
        state.request_log.finished(rid, outputs.items, status)

    return SSEResponse(sse_events(group, prefix, formatter, done))
