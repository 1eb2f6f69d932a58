"""/tokenize and /detokenize, answered by the tokenizer process (it holds the tokenizer) as control
operations (protocol.Tokenize, protocol.Detokenize) that never reach a scheduler. Answers carry lists, one
entry per input; http shapes them per route.
"""

from __future__ import annotations

from typing import Any

from app.protocol import ControlReply, ControlRequest, Detokenize, Detokenized, Tokenize, Tokenized
from app.tokenizer.chat import ChatTemplateError, render_chat_text
from app.tokenizer.prompt import PromptError, check_input_ids

OPS = (Tokenize, Detokenize)


def handle(msg: ControlRequest, tokenizer: Any | None, *, chat_template: str | None,
           vocab_size: int) -> ControlReply:
    op = msg.op
    if tokenizer is None:
        return ControlReply(msg.req_id, False, f"{op.KIND} needs the tokenizer, which --skip-tokenizer-init disables")
    try:
        result = _tokenize(op, tokenizer, chat_template) if isinstance(op, Tokenize) else \
            _detokenize(op, tokenizer, vocab_size)
    except (PromptError, ChatTemplateError) as exc:
        return ControlReply(msg.req_id, False, str(exc))
    return ControlReply(msg.req_id, True, result=result)


def _tokenize(op: Tokenize, tokenizer: Any, chat_template: str | None) -> Tokenized:
    if op.messages is not None:
        texts = [render_chat_text(
            tokenizer, op.messages, chat_template=chat_template, add_generation_prompt=op.add_generation_prompt,
            chat_template_kwargs=op.chat_template_kwargs, tools=op.tools or None,
        )]
    else:
        texts = list(op.prompts)
    tokens = [list(tokenizer.encode(text, add_special_tokens=op.add_special_tokens)) for text in texts]
    strs = [tokenizer.convert_ids_to_tokens(ids) for ids in tokens] if op.return_token_strs else None
    return Tokenized(tokens, strs)


def _detokenize(op: Detokenize, tokenizer: Any, vocab_size: int) -> Detokenized:
    texts = [tokenizer.decode(check_input_ids(ids, vocab_size), skip_special_tokens=op.skip_special_tokens)
             for ids in op.tokens]
    return Detokenized(texts)
