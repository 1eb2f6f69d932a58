"""Chat messages -> prompt token ids, through the model's chat template or a --chat-template one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.tokenizer.templates import BUILTIN_CHAT_TEMPLATES

# apply_chat_template arguments that a request's chat_template_kwargs may not override: they are
# set here (or change the return type away from a rendered string).
_RESERVED_KWARGS = frozenset({
    "conversation", "chat_template", "add_generation_prompt", "tokenize", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools",
})


class ChatTemplateError(ValueError):
    """The chat request cannot be rendered; the message is meant for the client."""


def resolve_chat_template(spec: str | None) -> str | None:
    """--chat-template: a built-in name or a path to a Jinja file -> the template text (None: none given)."""
    if spec is None or spec == "":
        return None
    if spec in BUILTIN_CHAT_TEMPLATES:
        return BUILTIN_CHAT_TEMPLATES[spec]
    path = Path(spec).expanduser()
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ChatTemplateError(f"--chat-template file {path} is empty")
        return text
    names = ", ".join(sorted(BUILTIN_CHAT_TEMPLATES))
    raise ChatTemplateError(
        f"--chat-template {spec!r} is neither a built-in template ({names}) nor an existing file"
    )


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI-style messages; text-part lists become one string (parts joined by newlines)."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ChatTemplateError(f"messages[{index}] must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages[{index}].role must be a non-empty string")
    out = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(_text_of_part(index, j, part) for j, part in enumerate(content))
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
    if isinstance(message.get("tool_calls"), list):
        out["tool_calls"] = [_template_call(call) for call in message["tool_calls"]]
    return out


def _template_call(call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen's, Llama's, ...) write them with
    tojson or iterate them, so they get the object (as vLLM and SGLang pass them)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            args = json.loads(function["arguments"])
        except ValueError:
            return call
        if isinstance(args, dict):
            function["arguments"] = args
    return {**call, "function": function}


def _text_of_part(index: int, j: int, part: Any) -> str:
    where = f"messages[{index}].content[{j}]"
    if not isinstance(part, dict):
        raise ChatTemplateError(f"{where} must be an object")
    kind = part.get("type")
    if kind != "text":
        raise ChatTemplateError(
            f"{where} has type {kind!r}: this server accepts text content only (no images, audio or files)"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise ChatTemplateError(f"{where}.text must be a string")
    return text


def render_chat(
    tokenizer: Any,
    messages: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Render messages with `chat_template` (else the tokenizer's own) and tokenize the result.

    The rendered text is tokenized without adding special tokens: the template writes its own
    BOS and turn markers (what apply_chat_template(tokenize=True) does too).
    """
    text = render_chat_text(
        tokenizer, messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=chat_template_kwargs, tools=tools,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_text(
    tokenizer: Any,
    messages: Any,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """tools: OpenAI tool definitions, passed to the template as transformers' apply_chat_template does."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("the model has no chat template; pass --chat-template")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS.intersection(kwargs))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    conversation = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False, tools=tools, **kwargs,
        )
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
        raise ChatTemplateError(f"the chat template failed to render the messages: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template rendered {type(text).__name__}, not text")
    return text
