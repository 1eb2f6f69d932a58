"""The OpenAPI document matches the app: every route documented and every documented route real, with the
access level the auth middleware enforces, and schemas that are what the request models accept."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import jsonschema_rs
import pytest

from app.http import control, health, openai_schemas, rl_control
from app.http.auth import ADMIN, API, OPEN
from app.http.config import HttpConfig
from app.http.openapi import (
    NOT_BUILT_OF,
    NOT_BUILT_VALUES,
    ROUTE_DOCS,
    SCHEMA_OVERRIDES,
    app_operations,
    build_document,
    paths_with,
)
from app.http.server import build_app
from tests.unit.test_http_fakes import MODEL, MODEL_PATH, FakeEngine, settings

KEYS = {"api_key": "sk-api", "admin_api_key": "sk-admin"}


def full_app(**overrides: Any):
    """The app with every optional route switched on (metrics)."""
    return build_app(settings(enable_metrics=True, metrics_reporters=["prometheus"], **overrides), FakeEngine())


def test_every_route_is_documented_and_every_documented_route_exists() -> None:
    app = full_app()
    routes = set(app_operations(app))
    assert routes - set(ROUTE_DOCS) == set(), "routes missing from app.http.openapi.ROUTE_DOCS"
    assert set(ROUTE_DOCS) - routes == set(), "ROUTE_DOCS names routes the app does not have"
    document = build_document(app, HttpConfig.from_settings(settings()))
    documented = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    assert documented == routes


def test_without_metrics_the_document_leaves_metrics_out() -> None:
    app = build_app(settings(), FakeEngine())
    document = build_document(app, HttpConfig.from_settings(settings()))
    assert "/metrics" not in document["paths"] and "/v1/chat/completions" in document["paths"]


def test_access_levels() -> None:
    assert paths_with(OPEN) == {*health.OPEN_PATHS, "/metrics"}
    mutating = {r.path for r in rl_control.ROUTES} | {"/abort_request", "/flush_cache", "/update_weight_version"}
    assert paths_with(ADMIN) == mutating
    assert {"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/openapi.json",
            "/get_server_info", "/get_loads"} <= paths_with(API)
    assert {r.path for r in control.ROUTES} <= paths_with(ADMIN) | paths_with(API)


def test_document_security_follows_the_configured_keys() -> None:
    app = full_app()
    open_doc = build_document(app, HttpConfig.from_settings(settings()))
    assert all(op["security"] == [] for ops in open_doc["paths"].values() for op in ops.values())
    keyed = build_document(app, HttpConfig.from_settings(settings(**KEYS)))
    ops = keyed["paths"]
    assert ops["/health"]["get"]["security"] == [] and "401" not in ops["/health"]["get"]["responses"]
    assert ops["/generate"]["post"]["security"] and "401" in ops["/generate"]["post"]["responses"]
    assert "403" in ops["/flush_cache"]["post"]["responses"]
    assert ops["/flush_cache"]["post"]["x-access"] == ADMIN


def test_schemas_are_valid_json_schema_and_name_the_served_model() -> None:
    document = build_document(full_app(), HttpConfig.from_settings(settings()))
    schemas = document["components"]["schemas"]
    for schema in schemas.values():
        jsonschema_rs.validator_for({**schema, "components": document["components"]})  # raises if invalid
    assert schemas["ChatBody"]["properties"]["model"]["enum"] == [MODEL, MODEL_PATH]
    for name, fields in SCHEMA_OVERRIDES.items():
        assert set(fields) <= set(schemas[name]["properties"]), name


def _validator(document: dict[str, Any], model: str) -> Any:
    schema = {"$ref": f"#/components/schemas/{model}", "components": document["components"]}
    return jsonschema_rs.validator_for(schema)


@pytest.mark.parametrize(("model", "body", "valid"), [
    ("CompletionBody", {"model": MODEL, "prompt": "hi"}, True),
    ("CompletionBody", {"model": MODEL, "prompt": [[1, 2], "x"], "stop": "\n", "suffix": ""}, True),
    ("CompletionBody", {"model": MODEL, "prompt": []}, False),
    ("CompletionBody", {"model": "other", "prompt": "hi"}, False),
    ("CompletionBody", {"model": MODEL, "prompt": "hi", "suffix": "x"}, False),
    ("CompletionBody", {"model": MODEL, "prompt": "hi", "stop": ["a"] * 17}, False),
    ("ChatBody", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
     True),
    ("ChatBody", {"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, False),
    ("ChatBody", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}], "tool_choice": "none"}, True),
    ("ChatBody", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "any"}, False),
    ("ChatBody", {"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_calls": [{}]}]}, False),
    ("ChatBody", {"model": MODEL, "messages": [], "unknown": 1}, False),
    ("GenerateBody", {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {}], "rid": ["x", "y"]}, True),
    ("GenerateBody", {"input_ids": [[1], [2, 3]], "sampling_params": {"n": 1}}, True),
    ("GenerateBody", {"input_ids": [-1]}, False),
    ("GenerateBody", {"text": "x", "lora_path": "adapter"}, False),
    ("GenerateBody", {"text": "x", "rid": "r" * 257}, False),
])
def test_body_schemas_accept_what_the_models_accept(model: str, body: dict[str, Any], valid: bool) -> None:
    document = build_document(full_app(), HttpConfig.from_settings(settings()))
    assert _validator(document, model).is_valid(body) == valid


def test_not_built_parameters_are_documented_with_their_neutral_values() -> None:
    assert set(NOT_BUILT_VALUES) == set(openai_schemas._NOT_BUILT_COMPLETIONS) | set(openai_schemas._NOT_BUILT_CHAT)
    for table in NOT_BUILT_OF.values():
        for name, unused in table.items():
            assert all(unused(value) for value in NOT_BUILT_VALUES[name]), name


def test_openapi_route_serves_the_document_behind_the_api_key() -> None:
    async def run() -> tuple[httpx.Response, httpx.Response]:
        app = build_app(settings(api_key="sk-api"), FakeEngine())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.get("/openapi.json"), await c.get("/openapi.json", headers={"x-api-key": "sk-api"})

    denied, served = asyncio.run(run())
    assert denied.status_code == 401
    assert served.status_code == 200 and served.json()["openapi"] == "3.1.0"
    assert served.json()["paths"]["/v1/models"]["get"]["x-access"] == API
