"""POST /tokenize and /detokenize (also under /v1/), in vLLM's and SGLang's shapes.

/tokenize: a `prompt` (a string, or a list of strings as SGLang batches them) or chat `messages`
rendered by the chat template; `add_special_tokens` defaults to true for a prompt and false for
messages (the template writes its own), as in vLLM. The answer: `tokens`, `count`, `max_model_len`,
and `token_strs` when `return_token_strs` is true; a list prompt gets lists.
/detokenize: `tokens` (a list of ids, or a list of lists) -> the text, under both vLLM's key `prompt`
and SGLang's `text`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.http.body import StrictBody, fits_the_wire, read_object, validate
from app.http.control import call_engine
from app.http.errors import bad_request
from app.http.limits import check_text_length, check_text_prompts
from app.http.openai_schemas import ChatMessage, check_model
from app.http.sampling import check_token_ids
from app.http.state import server_state
from app.http.streaming import JSON
from app.http.tools import ToolDef, check_tools
from app.protocol import ControlOp, Detokenize, Detokenized, Tokenize, Tokenized

R = TypeVar("R", Tokenized, Detokenized)


class TokenizeBody(StrictBody):
    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    return_token_strs: bool = False

    _fits_the_wire = field_validator("chat_template_kwargs")(fits_the_wire)


class DetokenizeBody(StrictBody):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


async def tokenize(request: Request) -> Response:
    state = server_state(request)
    body = validate(TokenizeBody, await read_object(request))
    check_model(body.model, state.config.model_names())
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
    check_tools(body.tools, None)
    # What could never fit the context is refused before it occupies the tokenizer process.
    info = state.client.engine
    if body.messages is not None:
        check_text_length(sum(len(m.content or "") for m in body.messages), info, "messages")
    else:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt or []
        check_text_prompts(((f"prompt[{i}]" if isinstance(body.prompt, list) else "prompt", p)
                            for i, p in enumerate(prompts)), info)
    if body.messages is not None:
        op = Tokenize(messages=[m.to_engine() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
                      chat_template_kwargs=body.chat_template_kwargs or {},
                      tools=[t.to_engine() for t in body.tools or []],
                      add_special_tokens=bool(body.add_special_tokens), return_token_strs=body.return_token_strs)
    else:
        op = Tokenize(prompts=[body.prompt] if isinstance(body.prompt, str) else body.prompt or [],
                      add_special_tokens=body.add_special_tokens is not False, return_token_strs=body.return_token_strs)
    data = await _ask(request, op, Tokenized)
    batched = isinstance(body.prompt, list)
    tokens = data.tokens if batched else data.tokens[0]
    out: dict[str, Any] = {"tokens": tokens, "count": [len(t) for t in tokens] if batched else len(tokens),
                           "max_model_len": state.client.engine.max_model_len}
    if body.return_token_strs:
        strs = data.token_strs or []
        out["token_strs"] = strs if batched else strs[0]
    return JSON(out)


async def detokenize(request: Request) -> Response:
    state = server_state(request)
    body = validate(DetokenizeBody, await read_object(request))
    check_model(body.model, state.config.model_names())
    batched = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists = body.tokens if batched else [body.tokens]
    vocab_size = state.client.engine.vocab_size or None
    for i, ids in enumerate(lists):
        check_token_ids(ids, vocab_size, f"tokens[{i}]" if batched else "tokens")
    data = await _ask(request, Detokenize(tokens=lists, skip_special_tokens=body.skip_special_tokens), Detokenized)
    text = data.texts if batched else data.texts[0]
    return JSON({"prompt": text, "text": text})


async def _ask(request: Request, op: ControlOp, result: type[R]) -> R:
    reply = await call_engine(request, op)
    if not reply.success:
        raise bad_request(reply.message or f"{op.KIND} failed")
    assert isinstance(reply.result, result), f"{op.KIND} answered {type(reply.result).__name__}"
    return reply.result


ROUTES = [
    Route(path, handler, methods=["POST"])
    for prefix in ("", "/v1")
    for path, handler in ((f"{prefix}/tokenize", tokenize), (f"{prefix}/detokenize", detokenize))
]
