"""Built-in chat templates, selectable by name with --chat-template.

Kept as Python strings (not package data files) so they ship with any install of the package.
Both accept string content only (chat.py flattens text parts first) and tolerate a None content
(an assistant turn that only carried tool calls).
"""

from __future__ import annotations

# ChatML (Qwen, SmolLM2, many fine-tunes): <|im_start|>role\ncontent<|im_end|>\n per turn.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama 3 / 3.1 instruct: BOS, then a header per turn, content trimmed, each turn ends in <|eot_id|>.
LLAMA_3 = (
    "{{- bos_token or '' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + (message['content'] or '') | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "chatml": CHATML,
    "llama-3": LLAMA_3,
}
