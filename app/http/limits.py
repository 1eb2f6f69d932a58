"""Limits that need the engine's figures, checked before any work is queued.

A text prompt is tokenized in the tokenizer process, which serves every request in turn: tokenizing
tens of megabytes takes tens of seconds there. A text longer than max_model_len times the most
characters one token can stand for (the tokenizer reports it as `max_token_chars`) cannot fit, so it
is refused here without being tokenized.
"""

from __future__ import annotations

from collections.abc import Iterable

from app.http.errors import bad_request
from app.protocol import EngineInfo


def max_prompt_chars(info: EngineInfo) -> int | None:
    """The longest text that could still fit in --max-model-len tokens; None when not known."""
    if info.max_token_chars is None or info.max_model_len < 1:
        return None
    return info.max_token_chars * info.max_model_len


def check_text_length(chars: int, info: EngineInfo, param: str) -> None:
    limit = max_prompt_chars(info)
    if limit is not None and chars > limit:
        raise bad_request(
            f"invalid value for '{param}': {chars} characters cannot fit in the maximum context length "
            f"(--max-model-len {info.max_model_len} tokens of at most {info.max_token_chars} characters "
            f"each: {limit} characters)", param=param, code="context_length_exceeded")


def check_text_prompts(prompts: Iterable[tuple[str, str]], info: EngineInfo) -> None:
    """(parameter path, text) pairs."""
    for param, text in prompts:
        check_text_length(len(text), info, param)
