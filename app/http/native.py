"""POST /generate: SGLang's native API (text or input_ids, single or batch, SSE streaming)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import field_validator
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from app.http.body import StrictBody, read_object, validate
from app.http.errors import bad_request
from app.http.limits import check_text_length
from app.http.runner import run_stream, run_whole
from app.http.sampling import NumLogprobs, SamplingBody, Seed, check_token_ids
from app.http.state import ServerState, server_state
from app.http.streaming import JSON
from app.http.structured import native_grammar
from app.protocol import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    GrammarSpec,
    SamplingParams,
    TextDelta,
)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_RID_CHARS = 256  # request ids travel in every message and log line


class NativeSampling(SamplingBody):
    """SGLang's sampling_params: the shared sampling fields under the engine's own names, and these."""

    sampling_seed: Seed | None = None  # SGLang's name for seed
    n: int | None = None
    # Structured output (SGLang's names; app/http/structured.py): one of them.
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None

    @field_validator("n")
    @classmethod
    def _one_sample(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported by /generate: send a batch, or use the OpenAI API's n")
        return value

    def sampling(self, vocab_size: int | None, param: str, top_logprobs: int | None) -> SamplingParams:
        if self.seed is not None and self.sampling_seed is not None and self.seed != self.sampling_seed:
            raise bad_request(f"'{param}.seed' and '{param}.sampling_seed' disagree", param=f"{param}.seed")
        max_new = self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        return self.to_params(vocab_size, param, max_new, top_logprobs,
                              seed=self.seed if self.seed is not None else self.sampling_seed)

    def grammar(self, prefix: str) -> GrammarSpec | None:
        return native_grammar({"json_schema": self.json_schema, "regex": self.regex, "ebnf": self.ebnf,
                               "structural_tag": self.structural_tag}, prefix)


class GenerateBody(StrictBody):
    text: Any = None
    input_ids: Any = None
    sampling_params: Any = None
    stream: bool = False
    rid: Any = None
    return_logprob: bool = False
    top_logprobs_num: NumLogprobs = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int | None = None
    lora_path: Any = None

    @field_validator("logprob_start_len")
    @classmethod
    def _start_len(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("must be -1 (no prompt logprobs) or the first prompt position to report (>= 0)")
        return value

    @field_validator("lora_path")
    @classmethod
    def _no_lora(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("LoRA adapters are not supported")
        return value


def _prompts(body: GenerateBody) -> tuple[list[dict[str, Any]], bool]:
    """([{text} | {input_ids}] per item, whether the body is a batch)."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("send exactly one of 'text' or 'input_ids'", param="text")
    if body.text is not None:
        text = body.text
        batch = isinstance(text, list)
        items = text if batch else [text]
        for i, item in enumerate(items):
            path = f"text[{i}]" if batch else "text"
            if not isinstance(item, str) or not item:
                raise bad_request(f"invalid value for '{path}': must be a non-empty string", param=path)
        if not items:
            raise bad_request("invalid value for 'text': an empty batch", param="text")
        return [{"text": t} for t in items], batch
    ids = body.input_ids
    batch = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
    items = ids if batch else [ids]
    for i, item in enumerate(items):
        path = f"input_ids[{i}]" if batch else "input_ids"
        if (not isinstance(item, list) or not item
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in item)):
            raise bad_request(f"invalid value for '{path}': must be a non-empty list of token ids "
                              "(or a batch of such lists)", param=path)
    return [{"input_ids": list(item)} for item in items], batch


def _rids(body: GenerateBody, size: int, batch: bool) -> list[str]:
    if body.rid is None:
        return [uuid.uuid4().hex for _ in range(size)]
    rids = body.rid if batch else [body.rid]
    if not isinstance(rids, list) or len(rids) != size:
        shape = f"a list of {size} strings" if batch else "a string"
        raise bad_request(f"invalid value for 'rid': must be {shape}", param="rid")
    if not all(isinstance(r, str) and r for r in rids):
        raise bad_request("invalid value for 'rid': request ids must be non-empty strings", param="rid")
    if any(len(r) > MAX_RID_CHARS for r in rids):
        raise bad_request(f"invalid value for 'rid': a request id may have at most {MAX_RID_CHARS} characters",
                          param="rid")
    if len(set(rids)) != len(rids):
        raise bad_request("invalid value for 'rid': request ids must be unique", param="rid")
    return rids


def _sampling(body: GenerateBody, size: int, batch: bool, vocab_size: int | None) -> list[SamplingParams]:
    raw = body.sampling_params
    if raw is None:
        raw = {}
    if isinstance(raw, list):
        if not batch or len(raw) != size:
            raise bad_request(f"invalid value for 'sampling_params': a list needs a batch of the same size ({size})",
                              param="sampling_params")
        paths = [f"sampling_params[{i}]" for i in range(size)]
    else:
        raw, paths = [raw] * size, ["sampling_params"] * size
    out = []
    for item, path in zip(raw, paths, strict=True):
        parsed = validate(NativeSampling, item, path)
        sampling = parsed.sampling(vocab_size, path, body.top_logprobs_num if body.return_logprob else None)
        if body.return_logprob and body.logprob_start_len is not None:
            sampling.prompt_logprob_start = body.logprob_start_len  # -1: none
        out.append(sampling)
    return out


# ---------------------------------------------------------------- responses


def finish_info(delta: TextDelta) -> dict[str, Any] | None:
    if delta.finish_reason is None:
        return None
    if delta.finish_reason == FINISH_STOP:
        return {"type": "stop", "matched": delta.matched_stop}
    if delta.finish_reason == FINISH_LENGTH:
        return {"type": "length", "length": delta.completion_tokens}
    if delta.finish_reason == FINISH_ABORT:
        return {"type": "abort", "message": delta.error or "aborted"}
    return {"type": delta.finish_reason}


@dataclass(frozen=True)
class NativeView:
    rids: list[str]
    batch: bool
    arrival: float
    state: ServerState  # its weight version is read when each response is built (updates show at once)
    return_logprob: bool
    top_logprobs_num: int
    text_in_logprobs: bool
    logprob_start_len: int = -1  # -1: no prompt logprobs

    def meta_info(self, index: int, delta: TextDelta) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rids[index], "finish_reason": finish_info(delta), "prompt_tokens": delta.prompt_tokens,
            "completion_tokens": delta.completion_tokens, "cached_tokens": delta.cached_tokens,
            "weight_version": self.state.weight_version,
        }
        if delta.finish_reason is not None:
            meta["e2e_latency"] = time.time() - self.arrival
        if self.return_logprob:
            meta.update(self._logprobs(delta))
        return meta

    def _logprobs(self, delta: TextDelta) -> dict[str, Any]:
        texts = delta.token_texts if len(delta.token_texts) == len(delta.logprobs) else None
        out: dict[str, Any] = {"output_token_logprobs": [
            [lp.logprob, lp.token_id, texts[i] if texts and self.text_in_logprobs else None]
            for i, lp in enumerate(delta.logprobs)]}
        if self.top_logprobs_num:
            tops = []
            for i, lp in enumerate(delta.logprobs):
                names = delta.top_token_texts[i] if i < len(delta.top_token_texts) else []
                tops.append([[v, t, names[j] if self.text_in_logprobs and j < len(names) else None]
                             for j, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=False))])
            out["output_top_logprobs"] = tops
        if self.logprob_start_len >= 0 and delta.prompt_ids:  # the first delta: it carries them
            out.update(self._input_logprobs(delta))
        return out

    def _input_logprobs(self, delta: TextDelta) -> dict[str, Any]:
        """SGLang's input_token_logprobs ([logprob, id, text-or-None] per prompt token from logprob_start_len
        on; the first prompt token's logprob is None: nothing predicts it) and input_top_logprobs."""
        ids = delta.prompt_ids
        first = len(ids) - len(delta.prompt_logprobs)  # the position of the first logprob
        texts = delta.prompt_token_texts if self.text_in_logprobs else []
        tokens, tops = [], []
        for i in range(min(self.logprob_start_len, len(ids)), len(ids)):
            lp = delta.prompt_logprobs[i - first] if i >= first else None
            tokens.append([lp.logprob if lp else None, ids[i], texts[i] if i < len(texts) else None])
            if lp is None:
                tops.append(None)
                continue
            names = delta.prompt_top_token_texts[i - first] if self.text_in_logprobs else []
            tops.append([[v, t, names[j] if j < len(names) else None]
                         for j, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=False))])
        out: dict[str, Any] = {"input_token_logprobs": tokens}
        if self.top_logprobs_num:
            out["input_top_logprobs"] = tops
        return out

    def item(self, index: int, delta: TextDelta, text: str) -> dict[str, Any]:
        out = {"text": text, "output_ids": list(delta.token_ids), "meta_info": self.meta_info(index, delta)}
        if self.batch:
            out["index"] = index
        return out


class NativeStream:
    """Chunks carry the text so far (or just the new segment with --stream-output) and the new ids."""

    def __init__(self, view: NativeView, stream_output: bool) -> None:
        self.view = view
        self.stream_output = stream_output
        self.texts = [""] * len(view.rids)

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_delta(self, index: int, delta: TextDelta) -> list[dict[str, Any]]:
        self.texts[index] += delta.text
        text = delta.text if self.stream_output else self.texts[index]
        return [self.view.item(index, delta, text)]

    def closing(self) -> list[dict[str, Any]]:
        return []


async def generate(request: Request) -> Response:
    state: ServerState = server_state(request)
    state.check_admission()
    body = validate(GenerateBody, await read_object(request))
    vocab_size = state.client.engine.vocab_size or None
    prompts, batch = _prompts(body)
    for i, fields in enumerate(prompts):
        if "input_ids" in fields:
            check_token_ids(fields["input_ids"], vocab_size, f"input_ids[{i}]" if batch else "input_ids")
        else:
            check_text_length(len(fields["text"]), state.client.engine, f"text[{i}]" if batch else "text")
    rids = _rids(body, len(prompts), batch)
    samplings = _sampling(body, len(prompts), batch, vocab_size)
    if body.top_logprobs_num and not body.return_logprob:
        raise bad_request("'top_logprobs_num' needs 'return_logprob' to be true", param="top_logprobs_num")
    if _or_none(body.logprob_start_len) >= 0 and not body.return_logprob:
        raise bad_request("'logprob_start_len' needs 'return_logprob' to be true", param="logprob_start_len")
    now = time.time()
    prompt_lp = body.return_logprob and _or_none(body.logprob_start_len) >= 0  # needs the prompt's ids back
    requests = [GenerateRequest(rid=rid, sampling=sampling, stream=body.stream, arrival_time=now,
                                return_prompt_ids=prompt_lp, **fields)
                for rid, sampling, fields in zip(rids, samplings, prompts, strict=True)]
    view = NativeView(rids, batch, now, state, body.return_logprob, body.top_logprobs_num,
                      body.return_text_in_logprobs, _or_none(body.logprob_start_len))
    log_rid = rids[0] if len(rids) == 1 else f"{rids[0]}..(+{len(rids) - 1})"
    state.request_log.received(log_rid, "/generate", [p.get("text", p.get("input_ids")) for p in prompts],
                               samplings[0], {"stream": body.stream, "batch": len(rids)})
    if body.stream:
        return await run_stream(request, state, log_rid, requests, NativeStream(view, state.config.stream_output))
    finals = await run_whole(request, state, log_rid, requests)
    items = [view.item(i, d, d.text) for i, d in enumerate(finals)]
    return JSON(items if batch else items[0])


ROUTES = [Route("/generate", generate, methods=["POST"])]


def _or_none(start: int | None) -> int:
    return -1 if start is None else start
