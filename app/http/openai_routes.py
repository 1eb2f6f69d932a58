"""GET /v1/models, POST /v1/completions, POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.http.body import read_object
from app.http.limits import check_text_length, check_text_prompts
from app.http.openai_format import (
    ChatStream,
    CompletionStream,
    ResponseMeta,
    chat_response,
    completion_response,
)
from app.http.openai_schemas import (
    Prompt,
    check_model,
    engine_template_fields,
    engine_tool_fields,
    parse_chat,
    parse_completion,
    with_seed,
)
from app.http.runner import run_stream, run_whole
from app.http.sampling import per_sample_seed
from app.http.state import ServerState, server_state
from app.http.streaming import JSON
from app.protocol import GenerateRequest, SamplingParams


def choice_rid(rid: str, index: int, total: int) -> str:
    """A single choice runs under the response id itself; fan-outs under {id}-{index}."""
    return rid if total == 1 else f"{rid}-{index}"


def fan_out(rid: str, n: int, sampling: SamplingParams, prompts: list[dict[str, Any]],
            **common: Any) -> list[GenerateRequest]:
    """One engine request per (prompt, sample), in choice-index order."""
    total = len(prompts) * n
    now = time.time()
    out = []
    for p, prompt in enumerate(prompts):
        for s in range(n):
            index = p * n + s
            out.append(GenerateRequest(rid=choice_rid(rid, index, total),
                                       sampling=with_seed(sampling, per_sample_seed(sampling.seed, s)),
                                       arrival_time=now, **prompt, **common))
    return out


def _meta(state: ServerState, rid: str, n: int) -> ResponseMeta:
    cfg = state.config
    return ResponseMeta(rid, int(time.time()), cfg.served_model_name, n, cfg.enable_cache_report)


def _prompt_fields(prompt: Prompt) -> dict[str, Any]:
    return {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}


async def list_models(request: Request) -> Response:
    state = server_state(request)
    cfg = state.config
    card = {
        "id": cfg.served_model_name, "object": "model", "created": state.started, "owned_by": "tokenspeed",
        "root": cfg.model_path, "parent": None, "max_model_len": state.client.engine.max_model_len or None,
    }
    return JSON({"object": "list", "data": [card]})


async def completions(request: Request) -> Response:
    state = server_state(request)
    state.check_admission()
    body, sampling = parse_completion(await read_object(request), state.client.engine.vocab_size or None)
    check_model(body.model, state.config.model_names())
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts = body.prompts
    check_text_prompts(((f"prompt[{i}]" if len(prompts) > 1 else "prompt", p) for i, p in enumerate(prompts)
                        if isinstance(p, str)), state.client.engine)
    meta = _meta(state, rid, body.n or 1)
    stream = bool(body.stream)
    requests = fan_out(rid, meta.n, sampling, [_prompt_fields(p) for p in prompts], stream=stream,
                       return_prompt_ids=bool(body.echo))
    state.request_log.received(rid, "/v1/completions", prompts, sampling,
                               {"n": meta.n, "echo": body.echo, "stream": stream, "user": body.user})
    if stream:
        formatter = CompletionStream(meta, prompts, bool(body.echo), body.logprobs, body.include_usage,
                                     continuous_usage=body.continuous_usage)
        return await run_stream(request, state, rid, requests, formatter)
    finals = await run_whole(request, state, rid, requests)
    return JSON(completion_response(meta, finals, prompts, bool(body.echo), body.logprobs))


async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    state.check_admission()
    body, sampling = parse_chat(await read_object(request), state.client.engine.vocab_size or None)
    check_model(body.model, state.config.model_names())
    check_text_length(sum(len(m.content or "") for m in body.messages), state.client.engine, "messages")
    cfg = state.config
    tool_fields = engine_tool_fields(body, cfg.tool_call_parser, cfg.reasoning_parser)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    meta = _meta(state, rid, body.n or 1)
    messages = [m.to_engine() for m in body.messages]
    stream = bool(body.stream)
    requests = fan_out(rid, meta.n, sampling, [{"messages": messages}], stream=stream,
                       **engine_template_fields(body), **tool_fields)
    state.request_log.received(rid, "/v1/chat/completions", [messages], sampling,
                               {"n": meta.n, "stream": stream, "user": body.user,
                                "chat_template_kwargs": body.chat_template_kwargs,
                                "tools": [t["function"]["name"] for t in tool_fields["tools"]] or None})
    top_logprobs = sampling.top_logprobs if sampling.logprobs else None
    reasoning = tool_fields["separate_reasoning"] and body.include_reasoning is not False
    if stream:
        formatter = ChatStream(meta, top_logprobs, body.include_usage, reasoning=reasoning,
                               continuous_usage=body.continuous_usage)
        return await run_stream(request, state, rid, requests, formatter)
    finals = await run_whole(request, state, rid, requests)
    return JSON(chat_response(meta, finals, top_logprobs, reasoning=reasoning))


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
]
