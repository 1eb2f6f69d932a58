"""The RL control plane: weight updates (SGLang- and vLLM-compatible), pause and continue.

Each route validates its body into its operation (app/protocol.py: the body's fields are the operation's), sends
it in one ControlRequest through the tokenizer to the scheduler
(which drains or pauses the engine and has the worker do the work, see app/scheduler/rl_control.py)
and answers SGLang's way: {"success": true, "message": ...}, or status 400 with success false when
the engine refused the operation (the weights and the version are then unchanged). The weight
version and model path the engine reports back are applied by ServerState as the reply arrives
(before any later output), so every response after an update carries the new version.

update_weights_from_tensor takes `serialized_named_tensors`: a list with one element per worker
rank (one here), each the base64 of `safetensors.torch.save({name: tensor, ...})` bytes.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Literal

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from app import protocol as p
from app.http.body import StrictBody, read_object, validate
from app.http.control import call_engine
from app.http.errors import bad_request

# Weight operations may wait for the engine to drain and for a trainer's broadcast or a disk load.
WEIGHT_OP_TIMEOUT_S = 1800.0
PAUSE_TIMEOUT_S = 60.0
Version = Field(None, min_length=1)


class DiskBody(StrictBody):
    model_path: str = Field(min_length=1)
    load_format: Literal["auto", "safetensors", "pt"] | None = None
    weight_version: str | None = Version


class InitGroupBody(StrictBody):
    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)  # the trainer is rank 0
    world_size: int = Field(ge=2)
    group_name: str = Field(p.DEFAULT_UPDATE_GROUP, min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"

    @model_validator(mode="after")
    def _fits(self) -> InitGroupBody:
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} leaves no room in world_size {self.world_size}")
        return self


class GroupBody(StrictBody):
    group_name: str = Field(p.DEFAULT_UPDATE_GROUP, min_length=1)


class DistributedBody(StrictBody):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(p.DEFAULT_UPDATE_GROUP, min_length=1)
    flush_cache: bool = True
    weight_version: str | None = Version

    @model_validator(mode="after")
    def _aligned(self) -> DistributedBody:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("'names', 'dtypes' and 'shapes' must have the same length")
        return self


class TensorBody(StrictBody):
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=1)  # one per worker rank
    load_format: Literal["safetensors"] | None = None
    flush_cache: bool = True
    weight_version: str | None = Version


class FinishBody(StrictBody):
    weight_version: str | None = Version


class PauseBody(StrictBody):
    mode: Literal["in_place", "retract", "abort"] = "in_place"


async def _optional_object(request: Request) -> dict[str, Any]:
    """The JSON object body, or {} when the request has no body (SGLang clients often send none)."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return {}
    return await read_object(request)


async def _run(request: Request, op: p.ControlOp, timeout: float) -> Response:
    reply = await call_engine(request, op, timeout)
    return JSONResponse({"success": reply.success, "message": reply.message}, status_code=200 if reply.success else 400)


async def update_weights_from_disk(request: Request) -> Response:
    body = validate(DiskBody, await read_object(request))
    return await _run(request, p.UpdateWeightsFromDisk(**body.model_dump()), WEIGHT_OP_TIMEOUT_S)


async def init_weights_update_group(request: Request) -> Response:
    body = validate(InitGroupBody, await read_object(request))
    return await _run(request, p.InitWeightsUpdateGroup(**body.model_dump()), WEIGHT_OP_TIMEOUT_S)


async def destroy_weights_update_group(request: Request) -> Response:
    body = validate(GroupBody, await _optional_object(request))
    return await _run(request, p.DestroyWeightsUpdateGroup(**body.model_dump()), WEIGHT_OP_TIMEOUT_S)


async def update_weights_from_distributed(request: Request) -> Response:
    body = validate(DistributedBody, await read_object(request))
    return await _run(request, p.UpdateWeightsFromDistributed(**body.model_dump()), WEIGHT_OP_TIMEOUT_S)


async def update_weights_from_tensor(request: Request) -> Response:
    body = validate(TensorBody, await read_object(request))
    payloads = []
    for i, text in enumerate(body.serialized_named_tensors):
        try:
            payloads.append(base64.b64decode(text, validate=True))
        except (binascii.Error, ValueError):
            raise bad_request(f"invalid value for 'serialized_named_tensors[{i}]': not base64",
                              param=f"serialized_named_tensors[{i}]") from None
    op = p.UpdateWeightsFromTensor(payloads[0], body.flush_cache, body.weight_version)
    return await _run(request, op, WEIGHT_OP_TIMEOUT_S)


async def start_weight_update(request: Request) -> Response:
    validate(StrictBody, await _optional_object(request))
    return await _run(request, p.StartWeightUpdate(), WEIGHT_OP_TIMEOUT_S)


async def finish_weight_update(request: Request) -> Response:
    body = validate(FinishBody, await _optional_object(request))
    return await _run(request, p.FinishWeightUpdate(**body.model_dump()), WEIGHT_OP_TIMEOUT_S)


async def pause_generation(request: Request) -> Response:
    body = validate(PauseBody, await _optional_object(request))
    return await _run(request, p.PauseGeneration(**body.model_dump()), PAUSE_TIMEOUT_S)


async def continue_generation(request: Request) -> Response:
    validate(StrictBody, await _optional_object(request))
    return await _run(request, p.ContinueGeneration(), PAUSE_TIMEOUT_S)


ROUTES = [
    Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
    Route("/init_weights_update_group", init_weights_update_group, methods=["POST"]),
    Route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]),
    Route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]),
    Route("/update_weights_from_tensor", update_weights_from_tensor, methods=["POST"]),
    Route("/start_weight_update", start_weight_update, methods=["POST"]),
    Route("/finish_weight_update", finish_weight_update, methods=["POST"]),
    Route("/pause_generation", pause_generation, methods=["POST"]),
    Route("/continue_generation", continue_generation, methods=["POST"]),
]
