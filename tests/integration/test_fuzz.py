"""Fuzzing the whole appliance: schemathesis against its own /openapi.json (bounded), and a hand-written
list of hostile bodies. Zero 5xx, zero crashed processes, and the server still answers afterwards.

The routes that reach the network or the weights (weight updates, pause/continue) are left to the
hostile list, whose bodies never pass validation; everything else is fuzzed with valid and invalid data.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import psutil
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    status_code_conformance,
)

from app.http import rl_control
from app.http.openapi import ROUTE_DOCS
from tests.support.appliance import Appliance

API_KEY = "sk-fuzz-0c1d"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A short context keeps every generation the fuzzer asks for cheap; a small capacity makes big fan-outs a 400.
FLAGS = ("--max-model-len", "64", "--max-num-seqs", "8", "--max-queued-requests", "8", "--api-key", API_KEY,
         "--request-timeout", "30")
NOT_FUZZED = {route.path for route in rl_control.ROUTES}  # network, disk, pausing the engine
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def app(tiny_model_dirs, log_dir):
    with Appliance(tiny_model_dirs["llama"], *FLAGS, log_dir=log_dir) as appliance:
        yield appliance


@pytest.fixture(scope="module")
def api_schema(app: Appliance):
    document = httpx.get(f"{app.base_url}/openapi.json", headers=AUTH, timeout=10).json()
    return schemathesis.openapi.from_dict(document)


# Every operation with valid data; those with a body with invalid data too (nothing else can be invalid).
FUZZED = [(method, path, mode) for (method, path), doc in sorted(ROUTE_DOCS.items())
          if path != "/metrics" and path not in NOT_FUZZED
          for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
          if mode is GenerationMode.POSITIVE or doc.body is not None]


@pytest.mark.parametrize(("method", "path", "mode"), FUZZED, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZED])
def test_schemathesis_finds_no_server_error(api_schema, app: Appliance, method: str, path: str,
                                            mode: GenerationMode) -> None:
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(base_url=app.base_url, headers=AUTH, timeout=60)
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    run()


# ---------------------------------------------------------------- hostile bodies


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MODEL_FIELD = '"model": "MODEL"'
HOSTILE: dict[str, bytes] = {
    "deeply nested array": _nested(100_000).encode(),
    "deeply nested object": ('{"a":' * 50_000 + "1" + "}" * 50_000).encode(),
    "nested within the parser's limit": ('{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], '
                                         '"chat_template_kwargs": ' + '{"a":' * 900 + "1" + "}" * 900 + "}").encode(),
    "invalid UTF-8": b'{"model": "MODEL", "prompt": "\xff\xfe\xfd"}',
    "UTF-16": '{"model": "MODEL", "prompt": "hi"}'.encode("utf-16"),
    "UTF-8 BOM": b"\xef\xbb\xbf" + b'{"model": "MODEL", "prompt": "hi"}',
    "NaN": b'{"model": "MODEL", "prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"model": "MODEL", "prompt": "hi", "logit_bias": {"1": -Infinity}}',
    "1e999": b'{"model": "MODEL", "prompt": "hi", "top_p": 1e999}',
    "a 5000-digit integer": b'{"model": "MODEL", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
    "raw control characters": b'{"model": "MODEL", "prompt": "a\x00b\x1bc"}',
    "lone surrogate": b'{"model": "MODEL", "prompt": "\\ud800"}',
    "lone surrogate in a key": b'{"model": "MODEL", "\\udfff": 1}',
    "unknown field": b'{"model": "MODEL", "prompt": "hi", "bogus": 1}',
    "wrong types": b'{"model": 7, "prompt": {"a": 1}, "n": "2", "stream": "true", "max_tokens": 1.5}',
    "booleans for numbers": b'{"model": "MODEL", "prompt": "hi", "max_tokens": true}',
    "empty": b"",
    "whitespace": b"  \n\t ",
    "null": b"null",
    "an array": b"[1, 2, 3]",
    "a string": b'"hello"',
    "truncated": b'{"model": "MODEL", "prompt": "hi"',
    "trailing garbage": b'{"model": "MODEL", "prompt": "hi"} xyz',
    "duplicate keys": b'{"model": "MODEL", "model": "MODEL", "prompt": "hi", "bogus": 1}',
    "a 1 MB model name": json.dumps({"model": "m" * 1_000_000, "prompt": "hi", "bogus": 1}).encode(),
    "a 1 MB request id": json.dumps({"rid": "r" * 1_000_000, "text": "hi", "bogus": 1}).encode(),
    "10000 stop strings": json.dumps({"model": "MODEL", "prompt": "hi", "stop": ["x"] * 10_000}).encode(),
    "a 100 kB stop string": json.dumps({"model": "MODEL", "prompt": "hi", "stop": ["x" * 100_000]}).encode(),
    "5000 logit biases": json.dumps({"model": "MODEL", "prompt": "hi",
                                     "logit_bias": {str(i): 1 for i in range(5000)}}).encode(),
    "1000 stop token ids": json.dumps({"model": "MODEL", "prompt": "hi", "stop_token_ids": [1] * 1000}).encode(),
    "a 5 MB prompt": json.dumps({"model": "MODEL", "prompt": "word " * 1_000_000}).encode(),
    "n x prompts beyond capacity": json.dumps({"model": "MODEL", "prompt": ["a"] * 8, "n": 128}).encode(),
}
# Bodies that are valid for some route: for them only "no 5xx" is asserted.
MAYBE_VALID = {"raw control characters", "UTF-16", "UTF-8 BOM"}


def _children_alive(app: Appliance) -> list[str]:
    return [p.name() for p in app.children if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]


def test_hostile_bodies_get_4xx_and_nothing_crashes(app: Appliance) -> None:
    document = httpx.get(f"{app.base_url}/openapi.json", headers=AUTH).json()
    model = httpx.get(f"{app.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    posts = [path for path, ops in document["paths"].items() if "post" in ops]
    assert "/v1/chat/completions" in posts and "/update_weights_from_disk" in posts
    problems: list[Any] = []
    with httpx.Client(base_url=app.base_url, headers={**AUTH, "Content-Type": "application/json"},
                      timeout=60) as client:
        for name, raw in HOSTILE.items():
            body = raw.replace(b'"MODEL"', json.dumps(model).encode())
            for path in posts:
                if not raw.strip() and not ROUTE_DOCS["POST", path].body_required:
                    continue  # no body is a valid call there (it would start a weight update)
                status = client.post(path, content=body).status_code
                ok = status < 500 if name in MAYBE_VALID or path == "/flush_cache" else 400 <= status < 500
                if not ok:
                    problems.append((name, path, status))
    assert problems == []


LONG = "word " * 100_000  # far more than 64 tokens of at most 13 characters


@pytest.mark.parametrize(("path", "body", "param", "limit"), [
    ("/v1/completions", {"prompt": LONG}, "prompt", "--max-model-len 64"),
    ("/v1/completions", {"prompt": ["ok", LONG]}, "prompt[1]", "--max-model-len 64"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages", "--max-model-len 64"),
    ("/generate", {"text": LONG}, "text", "--max-model-len 64"),
    ("/v1/completions", {"prompt": list(range(100))}, None, "--max-model-len"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 64}, None, "--max-model-len"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "128"),
    ("/v1/completions", {"prompt": ["a"] * 6, "n": 3}, None, "--max-queued-requests 8"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "20"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop", "16"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 1025}, "stop", "1024"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 257}, "stop_token_ids", "256"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    ("/generate", {"text": "hi", "rid": "r" * 257}, "rid", "256"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["x"] * 17}}, "sampling_params.stop", "16"),
])
def test_each_limit_is_a_400_naming_it(app: Appliance, path: str, body: dict[str, Any], param: str | None,
                                       limit: str) -> None:
    model = httpx.get(f"{app.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    if path.startswith("/v1"):
        body = {"model": model, **body}
    r = httpx.post(f"{app.base_url}{path}", json=body, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert limit in error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_oversized_bodies_get_413(app: Appliance) -> None:
    huge = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    declared = httpx.post(f"{app.base_url}/v1/completions", content=huge, headers=AUTH, timeout=60)
    assert declared.status_code == 413 and "32 MiB" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(40):
            yield b"a" * (1024 * 1024)

    streamed = httpx.post(f"{app.base_url}/generate", content=chunks(), headers=AUTH, timeout=60)
    assert streamed.status_code == 413


def test_the_server_still_answers_after_the_fuzzing(app: Appliance) -> None:
    assert _children_alive(app) == []
    assert httpx.get(f"{app.base_url}/readiness").status_code == 200
    model = httpx.get(f"{app.base_url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    r = httpx.post(f"{app.base_url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": model, "prompt": "still there?", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 10
    while (loads := httpx.get(f"{app.base_url}/get_loads", headers=AUTH).json()["loads"][0])["num_used_blocks"]:
        assert time.monotonic() < deadline, loads
        time.sleep(0.1)
    assert "unhandled error" not in app.logs() and "Traceback" not in app.logs()
