"""A ChatML chat template with tools and thinking, Qwen3's conventions in a few lines, for the agent tests.

Tools are listed in a system turn; an assistant turn's calls are written as `<tool_call>` JSON blocks
(arguments as an object, which is how transformers passes them); a tool result is a user turn in
`<tool_response>`. `enable_thinking: false` writes an empty thinking block into the generation
prompt, `open_thinking: true` opens one (the output then starts inside it).
"""

from __future__ import annotations

AGENT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\nYou may call these tools:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- 'Answer with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- for c in m.tool_calls -%}"
    "{{- '<tool_call>{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- if open_thinking is defined and open_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
