"""Control and information routes: abort, cache flush, model/server info, weight version."""

from __future__ import annotations

import dataclasses
import re

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.http.body import StrictBody, read_object, validate
from app.http.engine_client import EngineUnavailable
from app.http.errors import APIError, bad_request
from app.http.state import server_state
from app.http.streaming import JSON
from app.protocol import AllLoads, ControlOp, ControlReply, FlushCache, GetLoads

CONTROL_TIMEOUT_S = 30.0


class AbortBody(StrictBody):
    rid: str | None = None
    abort_all: bool = False


class WeightVersionBody(StrictBody):
    new_version: str = Field(min_length=1)


def _fan_out_children(rid: str, inflight: list[str]) -> list[str]:
    """The engine requests an id stands for: itself, or its fan-out {rid}-{index} (OpenAI n > 1)."""
    child = re.compile(re.escape(rid) + r"-\d+")
    return [r for r in inflight if r == rid or child.fullmatch(r)]


async def abort_request(request: Request) -> Response:
    state = server_state(request)
    body = validate(AbortBody, await read_object(request))
    if body.abort_all == (body.rid is not None):
        raise bad_request("send either 'rid' or 'abort_all': true", param="rid")
    if body.abort_all:
        await state.client.abort(abort_all=True, reason="aborted by /abort_request")
    else:
        assert body.rid is not None
        for rid in _fan_out_children(body.rid, state.client.inflight_rids()) or [body.rid]:
            await state.client.abort(rid=rid, reason="aborted by /abort_request")
    return JSON({"success": True})


async def call_engine(request: Request, op: ControlOp, timeout: float | None = None) -> ControlReply:
    """One control operation on the engine; 503 when it cannot serve, 504 when it does not answer
    within timeout (CONTROL_TIMEOUT_S, read at call time, by default)."""
    timeout = CONTROL_TIMEOUT_S if timeout is None else timeout
    state = server_state(request)
    if not state.client.ready:
        raise APIError(503, "the engine is not ready yet")
    try:
        return await state.client.control(op, timeout=timeout)
    except TimeoutError:
        raise APIError(504, f"the engine did not answer {op.KIND} within {timeout:g} s") from None
    except EngineUnavailable as exc:
        raise APIError(503, str(exc)) from None


async def _engine_control(request: Request, op: ControlOp) -> ControlReply:
    reply = await call_engine(request, op)
    if not reply.success:
        raise APIError(400, reply.message or f"{op.KIND} failed", code=f"{op.KIND}_failed")
    return reply


async def flush_cache(request: Request) -> Response:
    reply = await _engine_control(request, FlushCache())
    return JSON({"success": True, "message": reply.message})


async def get_loads(request: Request) -> Response:
    """TokenSpeed's /v1/loads shape, one entry per data-parallel replica, plus each scheduler's KV figures
    (the tokenizer merges the replicas' Loads into one AllLoads, see app/tokenizer/control_fanout.py)."""
    result = (await _engine_control(request, GetLoads())).result
    assert isinstance(result, AllLoads), f"get_loads answered {type(result).__name__}"
    return JSON({"loads": [{
        "dp_rank": loads.dp_rank,
        "num_reqs": loads.num_running,
        "num_waiting_reqs": loads.num_waiting,
        "num_pages": loads.num_used_blocks,
        **dataclasses.asdict(loads),
    } for loads in result.replicas]})


async def get_model_info(request: Request) -> Response:
    state = server_state(request)
    cfg, engine = state.config, state.client.engine
    return JSON({
        "model_path": state.model_path, "tokenizer_path": cfg.tokenizer_path,
        "served_model_name": cfg.served_model_name, "is_generation": True,
        "max_context_length": engine.max_model_len or None, "vocab_size": engine.vocab_size or None,
        "eos_token_ids": engine.eos_token_ids if state.client.ready else None, "weight_version": state.weight_version,
    })


async def get_server_info(request: Request) -> Response:
    state = server_state(request)
    return JSON({
        **state.config.settings_view,
        "weight_version": state.weight_version,
        "engine_info": {**state.client.info, **dataclasses.asdict(state.client.engine)} if state.client.ready else {},
        "ready": state.ready(),
        "draining": state.draining,
        "num_inflight_requests": state.inflight,
    })


async def get_weight_version(request: Request) -> Response:
    return JSON({"weight_version": server_state(request).weight_version})


async def update_weight_version(request: Request) -> Response:
    state = server_state(request)
    body = validate(WeightVersionBody, await read_object(request))
    state.weight_version = body.new_version
    return JSON({"success": True, "message": f"weight version set to {body.new_version}",
                 "new_version": body.new_version})


async def model_info(request: Request) -> Response:
    state = server_state(request)
    return JSON({"model_path": state.model_path, "weight_version": state.weight_version})


ROUTES = [
    Route("/abort_request", abort_request, methods=["POST"]),
    Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    Route("/v1/loads", get_loads, methods=["GET"]),
    Route("/get_loads", get_loads, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
    Route("/get_weight_version", get_weight_version, methods=["GET"]),
    Route("/update_weight_version", update_weight_version, methods=["POST"]),
    Route("/model_info", model_info, methods=["GET"]),
]
