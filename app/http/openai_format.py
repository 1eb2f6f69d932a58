"""OpenAI response bodies and stream chunks: completions, chat, logprobs (both formats) and usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.http.openai_schemas import Prompt
from app.protocol import FINISH_STOP, TextDelta, ToolCall


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str
    n: int
    cache_report: bool

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(meta: ResponseMeta, finals: list[TextDelta]) -> dict[str, Any]:
    """The prompt counts once per prompt (not per sample); completions count every choice."""
    firsts = finals[:: meta.n]
    prompt = sum(d.prompt_tokens for d in firsts)
    completion = sum(d.completion_tokens for d in finals)
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    if meta.cache_report:
        out["prompt_tokens_details"] = {"cached_tokens": sum(d.cached_tokens for d in firsts)}
    return out


# ---------------------------------------------------------------- logprobs


def _token_texts(delta: TextDelta) -> list[str]:
    if len(delta.token_texts) == len(delta.logprobs):
        return list(delta.token_texts)
    return [f"token_id:{lp.token_id}" for lp in delta.logprobs]


def _top_texts(delta: TextDelta, position: int) -> list[str]:
    top_ids = delta.logprobs[position].top_ids
    if position < len(delta.top_token_texts) and len(delta.top_token_texts[position]) == len(top_ids):
        return list(delta.top_token_texts[position])
    return [f"token_id:{t}" for t in top_ids]


class CompletionLogprobs:
    """The legacy completions format; text offsets run on across stream chunks."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def format(self, delta: TextDelta) -> dict[str, Any]:
        tokens = _token_texts(delta)
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for i, (lp, text) in enumerate(zip(delta.logprobs, tokens, strict=True)):
            offsets.append(self.offset)
            self.offset += len(text)
            top: dict[str, float] = {}
            for alt_text, value in zip(_top_texts(delta, i), lp.top_logprobs, strict=False):
                top.setdefault(alt_text, value)  # alternatives come most likely first: keep that one
            top.setdefault(text, lp.logprob)  # the sampled token is always listed
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in delta.logprobs],
                "top_logprobs": tops, "text_offset": offsets}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(delta: TextDelta, top_k: int) -> dict[str, Any]:
    content = []
    for i, (lp, text) in enumerate(zip(delta.logprobs, _token_texts(delta), strict=True)):
        entry = _chat_token(text, lp.logprob)
        tops = zip(_top_texts(delta, i), lp.top_logprobs, strict=False)
        entry["top_logprobs"] = [_chat_token(t, v) for t, v in list(tops)[:top_k]]
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_completion_logprobs(delta: TextDelta) -> dict[str, Any]:
    """The echoed prompt's part of completions logprobs (vLLM's shape): every prompt token, its logprob
    (None for the first: nothing predicts it) and alternatives; text offsets from 0."""
    ids = delta.prompt_ids
    texts = delta.prompt_token_texts if len(delta.prompt_token_texts) == len(ids) else [f"token_id:{t}" for t in ids]
    skip = len(ids) - len(delta.prompt_logprobs)  # the tokens without a logprob: the first one
    logprobs: list[float | None] = [None] * skip
    tops: list[dict[str, float] | None] = [None] * skip
    for i, lp in enumerate(delta.prompt_logprobs):
        names = delta.prompt_top_token_texts[i] if i < len(delta.prompt_top_token_texts) else []
        if len(names) != len(lp.top_ids):
            names = [f"token_id:{t}" for t in lp.top_ids]
        top: dict[str, float] = {}
        for name, value in zip(names, lp.top_logprobs, strict=True):
            top.setdefault(name, value)  # most likely first: it keeps a shared name
        top.setdefault(texts[skip + i], lp.logprob)
        logprobs.append(lp.logprob)
        tops.append(top)
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": list(texts), "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _with_prompt(prompt: dict[str, Any] | None, output: dict[str, Any]) -> dict[str, Any]:
    if prompt is None:
        return output
    return {key: prompt[key] + output[key] for key in output}


# ---------------------------------------------------------------- completions


def echo_text(delta: TextDelta, prompt: Prompt) -> str:
    if delta.prompt_text is not None:
        return delta.prompt_text
    return prompt if isinstance(prompt, str) else ""


def completion_response(meta: ResponseMeta, finals: list[TextDelta], prompts: list[Prompt], echo: bool,
                        logprobs: int | None) -> dict[str, Any]:
    choices = []
    for i, delta in enumerate(finals):
        prefix = echo_text(delta, prompts[i // meta.n]) if echo else ""
        lp = CompletionLogprobs(len(prefix)).format(delta) if logprobs is not None else None
        if lp is not None and echo:
            lp = _with_prompt(prompt_completion_logprobs(delta), lp)
        choices.append({"index": i, "text": prefix + delta.text, "logprobs": lp,
                        "finish_reason": delta.finish_reason})
    return {**meta.head("text_completion"), "choices": choices, "usage": usage(meta, finals)}


class _StreamBase:
    def __init__(self, meta: ResponseMeta, size: int, include_usage: bool, continuous_usage: bool = False) -> None:
        """continuous_usage (vLLM's stream_options.continuous_usage_stats): every chunk carries the usage so far."""
        self.meta = meta
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.finals: list[TextDelta | None] = [None] * size
        self.latest: list[TextDelta | None] = [None] * size

    def chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**self.meta.head(obj), "choices": choices}
        if self.continuous_usage:
            out["usage"] = self._usage_so_far()
        elif self.include_usage:
            out["usage"] = None
        return out

    def _usage_so_far(self) -> dict[str, Any]:
        """Counts are cumulative per choice; a choice not heard from yet counts nothing."""
        seen = [d for d in self.latest if d is not None]
        prompt = sum(d.prompt_tokens for i, d in enumerate(self.latest) if d is not None and i % self.meta.n == 0)
        completion = sum(d.completion_tokens for d in seen)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def note(self, index: int, delta: TextDelta) -> None:
        self.latest[index] = delta
        if delta.finish_reason is not None:
            self.finals[index] = delta  # counts are cumulative: the last delta has the totals

    def usage_chunk(self, obj: str) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        finals = [d for d in self.finals if d is not None]
        return [{**self.meta.head(obj), "choices": [], "usage": usage(self.meta, finals)}]


class CompletionStream(_StreamBase):
    OBJECT = "text_completion"

    def __init__(self, meta: ResponseMeta, prompts: list[Prompt], echo: bool, logprobs: int | None,
                 include_usage: bool, *, continuous_usage: bool = False) -> None:
        size = len(prompts) * meta.n
        super().__init__(meta, size, include_usage, continuous_usage)
        self.prompts = prompts
        self.echo = echo
        self.logprobs = logprobs
        self.started = [False] * size
        self.lp_state = [CompletionLogprobs(0) for _ in range(size)]

    def opening(self) -> list[dict[str, Any]]:
        return []

    def on_delta(self, index: int, delta: TextDelta) -> list[dict[str, Any]]:
        self.note(index, delta)
        text = delta.text
        prompt_lp = None
        if not self.started[index]:
            self.started[index] = True
            if self.echo:
                prefix = echo_text(delta, self.prompts[index // self.meta.n])
                text = prefix + text
                self.lp_state[index].offset = len(prefix)
                prompt_lp = prompt_completion_logprobs(delta) if self.logprobs is not None else None
        lp = self.lp_state[index].format(delta) if self.logprobs is not None else None
        if lp is not None:
            lp = _with_prompt(prompt_lp, lp)
        if not text and not delta.logprobs and delta.finish_reason is None:
            return []
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}
        return [self.chunk(self.OBJECT, [choice])]

    def closing(self) -> list[dict[str, Any]]:
        return self.usage_chunk(self.OBJECT)


# ---------------------------------------------------------------- chat


def chat_finish_reason(reason: str | None, called: bool) -> str | None:
    """An answer that ended by itself after calling tools finished for "tool_calls" (a length cut stays)."""
    return "tool_calls" if called and reason == FINISH_STOP else reason


def _tool_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_response(meta: ResponseMeta, finals: list[TextDelta], top_logprobs: int | None, *,
                  reasoning: bool = False) -> dict[str, Any]:
    """reasoning: --reasoning-parser ran, so the message carries reasoning_content (null when none)."""
    choices = []
    for i, delta in enumerate(finals):
        lp = chat_logprobs(delta, top_logprobs) if top_logprobs is not None else None
        message: dict[str, Any] = {"role": "assistant", "content": delta.text}
        if reasoning:
            message["reasoning_content"] = delta.reasoning_text or None
        if delta.tool_calls:
            message["content"] = delta.text or None  # OpenAI: null content beside calls
            message["tool_calls"] = [_tool_call(c) for c in delta.tool_calls]
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": chat_finish_reason(delta.finish_reason, bool(delta.tool_calls))})
    return {**meta.head("chat.completion"), "choices": choices, "usage": usage(meta, finals)}


class ChatStream(_StreamBase):
    OBJECT = "chat.completion.chunk"

    def __init__(self, meta: ResponseMeta, top_logprobs: int | None, include_usage: bool, *,
                 reasoning: bool = False, continuous_usage: bool = False) -> None:
        super().__init__(meta, meta.n, include_usage, continuous_usage)
        self.top_logprobs = top_logprobs
        self.reasoning = reasoning
        self.num_calls = [0] * meta.n  # tool calls sent so far, per choice: the next call's index

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk(self.OBJECT, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                for i in range(self.meta.n)]

    def on_delta(self, index: int, delta: TextDelta) -> list[dict[str, Any]]:
        """Reasoning and content first, then each call as OpenAI streams one: a delta with its index,
        id and name, then one with its arguments; the finish reason rides on the last chunk."""
        self.note(index, delta)
        bodies: list[dict[str, Any]] = []
        if delta.reasoning_text:
            bodies.append({"reasoning_content": delta.reasoning_text})
        if delta.text:
            bodies.append({"content": delta.text})
        for call in delta.tool_calls:
            k = self.num_calls[index]
            self.num_calls[index] += 1
            bodies.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            bodies.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        if not bodies and not delta.logprobs and delta.finish_reason is None:
            return []
        bodies = bodies or [{}]
        lp = chat_logprobs(delta, self.top_logprobs) if self.top_logprobs is not None else None
        finish = chat_finish_reason(delta.finish_reason, self.num_calls[index] > 0)
        chunks = []
        for j, body in enumerate(bodies):
            last = j == len(bodies) - 1
            choice = {"index": index, "delta": body, "logprobs": lp if j == 0 else None,
                      "finish_reason": finish if last else None}
            chunks.append(self.chunk(self.OBJECT, [choice]))
        return chunks

    def closing(self) -> list[dict[str, Any]]:
        return self.usage_chunk(self.OBJECT)
