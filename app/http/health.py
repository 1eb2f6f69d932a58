"""Health routes: /health and /liveness (the process runs), /readiness (the engine is ready and we are
not draining; while starting, its 503 names the start-up phase), /health_generate (a real one-token
greedy generation through the whole engine)."""

from __future__ import annotations

import asyncio
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from app.http.errors import APIError
from app.http.state import RETRY_AFTER_S, server_state
from app.http.streaming import Outputs, RequestGroup, collect
from app.protocol import GenerateRequest, SamplingParams

PROBE_INPUT_IDS = [0]  # any id below vocab_size; the probe only proves tokens come back
OPEN_PATHS = ("/health", "/liveness", "/readiness", "/health_generate")


async def health(request: Request) -> Response:
    return PlainTextResponse("OK")


async def readiness(request: Request) -> Response:
    state = server_state(request)
    reason = state.unready_reason()
    if reason is None:
        return JSONResponse({"status": "ready"})
    body = {"status": reason} if reason in ("draining", "not ready") else {"status": "not ready", "reason": reason}
    if reason == "not ready":  # still starting: say which phase (app/startup_phases.py)
        body.update(state.client.startup.as_json())
    return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_S})


async def health_generate(request: Request) -> Response:
    state = server_state(request)
    try:
        state.check_admission()
        probe = GenerateRequest(
            rid=f"health-generate-{uuid.uuid4().hex}", input_ids=list(PROBE_INPUT_IDS),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        )
        group = RequestGroup(state, [probe])
        try:
            finals = await asyncio.wait_for(collect(group, Outputs(1)), state.health_generate_timeout)
        finally:
            group.close("health probe ended")
    except TimeoutError:
        return _unhealthy(f"no token within {state.health_generate_timeout:g} s")
    except APIError as exc:
        return _unhealthy(exc.message)
    if not finals[0].token_ids:
        return _unhealthy(f"the probe ended without a token ({finals[0].finish_reason}: {finals[0].error})")
    return JSONResponse({"status": "ok"})


def _unhealthy(message: str) -> Response:
    return APIError(503, f"health generation failed: {message}", code="unhealthy").response()


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/liveness", health, methods=["GET"]),
    Route("/readiness", readiness, methods=["GET"]),
    Route("/health_generate", health_generate, methods=["GET"]),
]
