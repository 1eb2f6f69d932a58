"""OpenAI response bodies and stream chunks: completions, chat, logprobs (both formats) and usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.http.openai_schemas import Prompt
from app.protocol import TextDelta


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
        choices.append({"index": i, "text": prefix + delta.text, "logprobs": lp,
                        "finish_reason": delta.finish_reason})
    return {**meta.head("text_completion"), "choices": choices, "usage": usage(meta, finals)}


class _StreamBase:
    def __init__(self, meta: ResponseMeta, size: int, include_usage: bool) -> None:
        self.meta = meta
        self.include_usage = include_usage
        self.finals: list[TextDelta | None] = [None] * size

    def chunk(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {**self.meta.head(obj), "choices": choices}
        if self.include_usage:
            out["usage"] = None
        return out

    def note(self, index: int, delta: TextDelta) -> None:
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
                 include_usage: bool) -> None:
        size = len(prompts) * meta.n
        super().__init__(meta, size, include_usage)
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
        if not self.started[index]:
            self.started[index] = True
            if self.echo:
                prefix = echo_text(delta, self.prompts[index // self.meta.n])
                text = prefix + text
                self.lp_state[index].offset = len(prefix)
        lp = self.lp_state[index].format(delta) if self.logprobs is not None else None
        if not text and not delta.logprobs and delta.finish_reason is None:
            return []
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": delta.finish_reason}
        return [self.chunk(self.OBJECT, [choice])]

    def closing(self) -> list[dict[str, Any]]:
        return self.usage_chunk(self.OBJECT)


# ---------------------------------------------------------------- chat


def chat_response(meta: ResponseMeta, finals: list[TextDelta], top_logprobs: int | None) -> dict[str, Any]:
    choices = []
    for i, delta in enumerate(finals):
        lp = chat_logprobs(delta, top_logprobs) if top_logprobs is not None else None
        choices.append({"index": i, "message": {"role": "assistant", "content": delta.text},
                        "logprobs": lp, "finish_reason": delta.finish_reason})
    return {**meta.head("chat.completion"), "choices": choices, "usage": usage(meta, finals)}


class ChatStream(_StreamBase):
    OBJECT = "chat.completion.chunk"

    def __init__(self, meta: ResponseMeta, top_logprobs: int | None, include_usage: bool) -> None:
        super().__init__(meta, meta.n, include_usage)
        self.top_logprobs = top_logprobs

    def opening(self) -> list[dict[str, Any]]:
        return [self.chunk(self.OBJECT, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}])
                for i in range(self.meta.n)]

    def on_delta(self, index: int, delta: TextDelta) -> list[dict[str, Any]]:
        self.note(index, delta)
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return []
        lp = chat_logprobs(delta, self.top_logprobs) if self.top_logprobs is not None else None
        body = {"content": delta.text} if delta.text else {}
        choice = {"index": index, "delta": body, "logprobs": lp, "finish_reason": delta.finish_reason}
        return [self.chunk(self.OBJECT, [choice])]

    def closing(self) -> list[dict[str, Any]]:
        return self.usage_chunk(self.OBJECT)
