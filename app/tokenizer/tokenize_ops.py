"""/tokenize and /detokenize, answered by the tokenizer process (it holds the tokenizer) as control
operations that never reach a scheduler.

tokenize args: {"prompts": [str, ...]} or {"messages": [...], "add_generation_prompt", "chat_template_kwargs",
"tools"}, with "add_special_tokens" and "return_token_strs". detokenize args: {"tokens": [[int, ...], ...],
"skip_special_tokens"}. Answers carry lists, one entry per input; http shapes them per route.
"""

from __future__ import annotations

from typing import Any

from app.protocol import ControlReply, ControlRequest
from app.tokenizer.chat import ChatTemplateError, render_chat_text
from app.tokenizer.prompt import PromptError, check_input_ids

KINDS = ("tokenize", "detokenize")


def handle(msg: ControlRequest, tokenizer: Any | None, *, chat_template: str | None,
           vocab_size: int) -> ControlReply:
    if tokenizer is None:
        return ControlReply(msg.req_id, False, f"{msg.kind} needs the tokenizer, which --skip-tokenizer-init disables")
    try:
        data = _tokenize(msg.args, tokenizer, chat_template) if msg.kind == "tokenize" else \
            _detokenize(msg.args, tokenizer, vocab_size)
    except (PromptError, ChatTemplateError) as exc:
        return ControlReply(msg.req_id, False, str(exc))
    return ControlReply(msg.req_id, True, data=data)


def _tokenize(args: dict[str, Any], tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    if args.get("messages") is not None:
        texts = [render_chat_text(
            tokenizer, args["messages"], chat_template=chat_template,
            add_generation_prompt=bool(args.get("add_generation_prompt", True)),
            chat_template_kwargs=args.get("chat_template_kwargs") or {}, tools=args.get("tools") or None,
        )]
    else:
        texts = list(args.get("prompts") or [])
    special = bool(args.get("add_special_tokens", True))
    tokens = [list(tokenizer.encode(text, add_special_tokens=special)) for text in texts]
    data: dict[str, Any] = {"tokens": tokens}
    if args.get("return_token_strs"):
        data["token_strs"] = [tokenizer.convert_ids_to_tokens(ids) for ids in tokens]
    return data


def _detokenize(args: dict[str, Any], tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    skip = bool(args.get("skip_special_tokens", False))
    texts = []
    for ids in args.get("tokens") or []:
        texts.append(tokenizer.decode(check_input_ids(ids, vocab_size), skip_special_tokens=skip))
    return {"texts": texts}
