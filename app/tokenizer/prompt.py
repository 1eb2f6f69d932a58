"""A GenerateRequest's prompt -> token ids, and the checks a prompt must pass before scheduling."""

from __future__ import annotations

from typing import Any

from app.protocol import GenerateRequest
from app.tokenizer.chat import ChatTemplateError, render_chat


class PromptError(ValueError):
    """The request cannot be served as given; the message is meant for the client (HTTP 400)."""


def build_prompt(
    req: GenerateRequest, tokenizer: Any | None, *, chat_template: str | None, vocab_size: int
) -> list[int]:
    """Exactly one of text / messages / input_ids -> prompt ids (tokenizer None: ids only)."""
    given = [name for name in ("text", "messages", "input_ids") if getattr(req, name) is not None]
    if len(given) != 1:
        raise PromptError(f"a request needs exactly one of text, messages, input_ids; got {given or 'none'}")
    if req.input_ids is not None:
        return check_input_ids(req.input_ids, vocab_size)
    if tokenizer is None:
        kind = "chat messages" if req.messages is not None else "text prompts"
        raise PromptError(f"{kind} need the tokenizer, which --skip-tokenizer-init disables; send input_ids")
    if req.messages is not None:
        try:
            return render_chat(
                tokenizer, req.messages, chat_template=chat_template,
                add_generation_prompt=req.add_generation_prompt, chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools or None,
            )
        except ChatTemplateError as exc:
            raise PromptError(str(exc)) from exc
    if not isinstance(req.text, str):
        raise PromptError("text must be a string")
    return list(tokenizer.encode(req.text, add_special_tokens=True))


def check_input_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list):
        raise PromptError("input_ids must be a list of token ids")
    for i, tid in enumerate(ids):
        if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
            raise PromptError(f"input_ids[{i}] = {tid!r} is not a token id in [0, {vocab_size})")
    return list(ids)


def validate_prompt(prompt_ids: list[int], max_new_tokens: int | None, *, max_model_len: int) -> None:
    """The prompt must be non-empty and leave room for generation within --max-model-len."""
    n = len(prompt_ids)
    if n == 0:
        raise PromptError("the prompt is empty")
    if n >= max_model_len:
        raise PromptError(
            f"the prompt has {n} tokens, but the maximum context length (--max-model-len) is "
            f"{max_model_len}: the prompt must be shorter than {max_model_len} tokens"
        )
    if max_new_tokens is None:
        return
    if max_new_tokens < 0:
        raise PromptError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if n + max_new_tokens > max_model_len:
        raise PromptError(
            f"the prompt has {n} tokens and {max_new_tokens} new tokens were requested, "
            f"{n + max_new_tokens} in total, more than the maximum context length (--max-model-len) "
            f"of {max_model_len}"
        )
