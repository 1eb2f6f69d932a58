"""GET /openapi.json: the OpenAPI 3.1 document of the HTTP API, generated from the app's route table and
the pydantic request models, and the one place that declares who may call each route.

ROUTE_DOCS holds, per (method, path), the summary, the request body model and the access level (open,
API key, admin key). The auth middleware takes its open and admin paths from it (so the document's
`security` is what is enforced), and a test checks that every route of the app is documented here and
that every entry here is a route of the app. Fields that the models type loosely (`Any`, checked by a
validator) get the schema of what the validator accepts in SCHEMA_OVERRIDES.
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.http import control, native, openai_schemas, rl_control, tokenize_routes
from app.http.auth import ADMIN, API, OPEN
from app.http.body import StrictBody
from app.http.config import HttpConfig
from app.http.errors import error_type
from app.http.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from app.http.state import server_state
from app.http.streaming import JSON
from app.http.tools import TOOL_CHOICE_SCHEMA

DISTRIBUTION = "tokenspeed-appliance"
REF = "#/components/schemas/{model}"


@dataclass(frozen=True)
class RouteDoc:
    summary: str
    access: str  # OPEN, API or ADMIN
    tag: str
    body: type[BaseModel] | None = None
    body_required: bool = True  # False: an empty body means {}
    streams: bool = False  # may answer text/event-stream
    engine: bool = False  # reaches the engine: 503 (not ready, draining, full), 504 (timeout), 500
    errors: tuple[int, ...] = ()  # further error statuses
    media: str = "application/json"  # of a 200 answer


class EmptyBody(StrictBody):
    """An empty JSON object (or no body)."""


def _rl(summary: str, body: type[BaseModel], required: bool = True) -> RouteDoc:
    return RouteDoc(summary, ADMIN, "control", body, required, engine=True)


ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("GET", "/health"): RouteDoc("Liveness: the HTTP process runs", OPEN, "health", media="text/plain"),
    ("GET", "/liveness"): RouteDoc("Liveness (alias of /health)", OPEN, "health", media="text/plain"),
    ("GET", "/readiness"): RouteDoc("Readiness: 200 once the engine serves, 503 while not ready, draining or "
                                    "when an engine process stopped reporting", OPEN, "health", errors=(503,)),
    ("GET", "/health_generate"): RouteDoc("A real one-token generation through the whole engine", OPEN, "health",
                                          errors=(503,)),
    ("GET", "/metrics"): RouteDoc("Prometheus metrics of every process (with --enable-metrics)", OPEN, "health",
                                  media="text/plain"),
    ("GET", "/openapi.json"): RouteDoc("This document", API, "info"),
    ("GET", "/v1/models"): RouteDoc("The served model", API, "openai"),
    ("POST", "/v1/completions"): RouteDoc("OpenAI text completions", API, "openai", openai_schemas.CompletionBody,
                                          streams=True, engine=True, errors=(404,)),
    ("POST", "/v1/chat/completions"): RouteDoc("OpenAI chat completions", API, "openai", openai_schemas.ChatBody,
                                               streams=True, engine=True, errors=(404,)),
    **{("POST", f"{prefix}/tokenize"): RouteDoc("Text or chat messages -> token ids (vLLM's and SGLang's shape)",
                                                API, "native", tokenize_routes.TokenizeBody, engine=True,
                                                errors=(404,)) for prefix in ("", "/v1")},
    **{("POST", f"{prefix}/detokenize"): RouteDoc("Token ids -> text (vLLM's and SGLang's shape)", API, "native",
                                                  tokenize_routes.DetokenizeBody, engine=True, errors=(404,))
       for prefix in ("", "/v1")},
    ("POST", "/generate"): RouteDoc("SGLang's native generation (text or token ids, single or batch)", API,
                                    "native", native.GenerateBody, streams=True, engine=True),
    ("GET", "/get_model_info"): RouteDoc("Model path, context length, vocabulary, weight version", API, "info"),
    ("GET", "/get_server_info"): RouteDoc("Every resolved setting (secrets masked) and the engine summary", API,
                                          "info"),
    ("GET", "/get_weight_version"): RouteDoc("The served weight version", API, "info"),
    ("GET", "/model_info"): RouteDoc("Model path and weight version", API, "info"),
    ("GET", "/get_loads"): RouteDoc("Running and waiting requests, KV blocks in use", API, "info", engine=True),
    ("GET", "/v1/loads"): RouteDoc("The same, in TokenSpeed's shape", API, "info", engine=True),
    ("POST", "/abort_request"): RouteDoc("Abort one request (rid) or all", ADMIN, "control", control.AbortBody),
    ("GET", "/flush_cache"): RouteDoc("Drop the prefix cache", ADMIN, "control", engine=True),
    ("POST", "/flush_cache"): RouteDoc("Drop the prefix cache", ADMIN, "control", engine=True),
    ("POST", "/update_weight_version"): RouteDoc("Set the weight version stamped into responses", ADMIN, "control",
                                                 control.WeightVersionBody),
    ("POST", "/update_weights_from_disk"): _rl("Load new weights from a path", rl_control.DiskBody),
    ("POST", "/init_weights_update_group"): _rl("Join a trainer's weight broadcast group", rl_control.InitGroupBody),
    ("POST", "/destroy_weights_update_group"): _rl("Leave a weight broadcast group", rl_control.GroupBody, False),
    ("POST", "/update_weights_from_distributed"): _rl("Receive weights broadcast by a trainer",
                                                      rl_control.DistributedBody),
    ("POST", "/update_weights_from_tensor"): _rl("Load weights sent in the body (safetensors, base64)",
                                                 rl_control.TensorBody),
    ("POST", "/start_weight_update"): _rl("Begin a multi-part weight update", EmptyBody, False),
    ("POST", "/finish_weight_update"): _rl("End a multi-part weight update", rl_control.FinishBody, False),
    ("POST", "/pause_generation"): _rl("Pause generation", rl_control.PauseBody, False),
    ("POST", "/continue_generation"): _rl("Resume generation", EmptyBody, False),
}


def paths_with(access: str) -> frozenset[str]:
    return frozenset(path for (_, path), doc in ROUTE_DOCS.items() if doc.access == access)


# ---------------------------------------------------------------- schemas of loosely typed fields

_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_TEXT = {"type": "string", "minLength": 1}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
_STOP = {"anyOf": [_STOP_STRING, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING},
                   {"type": "null"}]}
_UNUSED = {"description": "not built: only an empty value is accepted", "anyOf": [{"type": "null"},
                                                                                  {"type": "array", "maxItems": 0}]}

SCHEMA_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "CompletionBody": {
        "prompt": {"anyOf": [_TEXT, _IDS, {"type": "array", "minItems": 1, "items": {"anyOf": [_TEXT, _IDS]}}]},
        "stop": _STOP,
    },
    "ChatBody": {"stop": _STOP, "tool_choice": TOOL_CHOICE_SCHEMA},
    "NativeSampling": {"stop": _STOP, "n": {"anyOf": [{"const": 1}, {"type": "null"}]}},
    "ChatMessage": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"description": "null only in an assistant turn with tool_calls", "anyOf": [
            {"type": "string"}, {"type": "null"}, {"type": "array", "items": {
                "type": "object", "additionalProperties": False, "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
        **{name: _UNUSED for name in ("function_call", "refusal", "audio", "annotations")},
    },
    "GenerateBody": {
        "text": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _TEXT}, {"type": "null"}]},
        "input_ids": {"anyOf": [_IDS, {"type": "array", "minItems": 1, "items": _IDS}, {"type": "null"}]},
        "sampling_params": {"anyOf": [{"$ref": REF.format(model="NativeSampling")},
                                      {"type": "array", "items": {"$ref": REF.format(model="NativeSampling")}},
                                      {"type": "null"}]},
        "rid": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": native.MAX_RID_CHARS},
                          {"type": "array", "items": {"type": "string", "minLength": 1,
                                                      "maxLength": native.MAX_RID_CHARS}},
                          {"type": "null"}]},
        "logprob_start_len": {"anyOf": [{"type": "integer", "minimum": -1}, {"type": "null"}],
                              "description": "with return_logprob: the first prompt position of "
                                             "meta_info.input_token_logprobs (-1: none)"},
        "lora_path": {"type": "null", "description": "LoRA adapters are not built"},
    },
}

# OpenAI parameters this server does not build: accepted only with a value that means "not used"
# (app.http.openai_schemas refuses any other value by name).
NOT_BUILT_VALUES: dict[str, list[Any]] = {
    "suffix": [None, ""], "functions": [None, []],
    "function_call": [None, "none"],
    "audio": [None], "modalities": [None, ["text"]], "prediction": [None], "reasoning_effort": [None],
    "service_tier": [None, "auto", "default"], "store": [None, False], "metadata": [None],
    "web_search_options": [None], "prompt_cache_key": [None], "prompt_cache_options": [None],
    "prompt_cache_retention": [None], "moderation": [None], "safety_identifier": [None], "verbosity": [None],
    # vLLM's and SGLang's extensions that are not built.
    "use_beam_search": [None, False], "length_penalty": [None, 1.0], "priority": [None, 0],
    "truncate_prompt_tokens": [None], "return_tokens_as_token_ids": [None, False], "return_token_ids": [None, False],
    "allowed_token_ids": [None], "bad_words": [None, []], "request_id": [None], "cache_salt": [None],
    "kv_transfer_params": [None], "vllm_xargs": [None], "lora_path": [None], "return_hidden_states": [None, False],
    "mm_processor_kwargs": [None, {}], "documents": [None, []], "chat_template": [None], "stream_reasoning": [None, True],
}
NOT_BUILT_OF = {"CompletionBody": openai_schemas._NOT_BUILT_COMPLETIONS, "ChatBody": openai_schemas._NOT_BUILT_CHAT}
# Models a body refers to through an override (its field is typed loosely and validated by hand).
REFERRED: dict[str, list[type[BaseModel]]] = {"GenerateBody": [native.NativeSampling]}


def _model_schemas(model: type[BaseModel]) -> dict[str, dict[str, Any]]:
    """The model's schema and those it refers to, by name, with the overrides applied."""
    schema = copy.deepcopy(model.model_json_schema(ref_template=REF, mode="validation"))
    found = {**schema.pop("$defs", {}), model.__name__: schema}
    for referred in REFERRED.get(model.__name__, []):
        found.update(_model_schemas(referred))
    for name, item in found.items():
        props = item.get("properties", {})
        for field, override in SCHEMA_OVERRIDES.get(name, {}).items():
            props[field] = {**override, "title": props.get(field, {}).get("title", field)}
        for field in NOT_BUILT_OF.get(name, {}):
            props[field] = {"enum": NOT_BUILT_VALUES[field], "description": "not built: only a value meaning "
                            "'not used' is accepted"}
    return found


def _served_models(schemas: dict[str, dict[str, Any]], config: HttpConfig) -> None:
    """`model` must name the served model (404 otherwise): say which names it takes."""
    for name in NOT_BUILT_OF:
        if name in schemas:
            schemas[name]["properties"]["model"] = {"title": "Model", "type": "string",
                                                    "enum": list(dict.fromkeys(config.model_names()))}


# ---------------------------------------------------------------- the document


def app_operations(app: Starlette) -> Iterator[tuple[str, str]]:
    """(method, path) of every route in the app (HEAD, which starlette adds to GET, left out)."""
    for route in app.routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    yield method, route.path


def _error(status: int, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": REF.format(model="Error")}}}}


_ERROR_TEXT = {
    400: "Invalid request: the message names the parameter and the limit",
    401: "Missing or wrong API key", 403: "The admin API key is needed", 404: "Unknown model",
    413: "Body too large", 500: "The engine failed the request", 503: "Not ready, draining, at capacity "
    "(with Retry-After) or the engine failed", 504: "A timeout (--request-timeout, --ttft-timeout, a control "
    "operation)",
}


def _responses(doc: RouteDoc, access: str) -> dict[str, Any]:
    ok: dict[str, Any] = {doc.media: {"schema": {"type": "string"} if doc.media == "text/plain" else {}}}
    if doc.streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    statuses = set(doc.errors)
    if doc.body is not None:
        statuses |= {400, 413}
    if doc.engine:
        statuses |= {400, 500, 503, 504}
    if access != OPEN:
        statuses.add(401)
    if access == ADMIN:
        statuses.add(403)
    out: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status in sorted(statuses):
        out[str(status)] = _error(status, _ERROR_TEXT[status])
    return out


def _effective_access(doc: RouteDoc, config: HttpConfig) -> str:
    if doc.access == ADMIN and config.admin_closed:
        return ADMIN
    if doc.access == OPEN or not (config.api_key or config.admin_api_key):
        return OPEN
    if doc.access == ADMIN and config.admin_api_key:
        return ADMIN
    return API if config.api_key else OPEN


def _operation(method: str, path: str, doc: RouteDoc, config: HttpConfig) -> dict[str, Any]:
    access = _effective_access(doc, config)
    op: dict[str, Any] = {
        "summary": doc.summary, "operationId": f"{method.lower()}_{path.strip('/').replace('/', '_') or 'root'}",
        "tags": [doc.tag], "responses": _responses(doc, access), "x-access": doc.access,
        "security": [] if access == OPEN else [{"bearer": []}, {"apiKeyHeader": []}],
    }
    if doc.body is not None:
        op["requestBody"] = {"required": doc.body_required, "content": {"application/json": {
            "schema": {"$ref": REF.format(model=doc.body.__name__)}}}}
    return op


def build_document(app: Starlette, config: HttpConfig) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    for method, path in app_operations(app):
        doc = ROUTE_DOCS.get((method, path))
        if doc is None:
            continue  # a test keeps ROUTE_DOCS complete
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, doc, config)
        if doc.body is not None:
            schemas.update(_model_schemas(doc.body))
    _served_models(schemas, config)
    return {
        "openapi": "3.1.0",
        "info": {"title": "TokenSpeed appliance", "version": _version(),
                 "description": "OpenAI-compatible and SGLang-native LLM serving. Limits, timeouts and access "
                                "levels: docs/operations.md. `x-access` is the route's access level: open, api "
                                "(the --api-key) or admin (the --admin-api-key when set)."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"enum": sorted({error_type(s) for s in _ERROR_TEXT})},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "integer", "null"]}}}},
}


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def openapi_json(request: Request) -> Response:
    app = request.app
    document = getattr(app.state, "openapi", None)
    if document is None:  # the routes and settings are fixed once the app runs: build it once
        document = app.state.openapi = build_document(app, server_state(request).config)
    return JSON(document)


ROUTES = [Route("/openapi.json", openapi_json, methods=["GET"])]
