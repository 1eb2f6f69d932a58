"""A chat answer's text -> reasoning, content and tool calls, as it arrives (DESIGN 5b).

The reasoning parser runs first (a tool call inside the reasoning is thought, not a call), the
tool parser over what the reasoning parser leaves as content. Built per request by the tokenizer
from --reasoning-parser, --tool-call-parser and the request's tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.protocol import GenerateRequest, ToolCall
from app.tokenizer.reasoning import REASONING_FORMATS, ReasoningSplitter, prompt_opens_reasoning
from app.tokenizer.tool_parsers import TOOL_FORMATS, ToolCallExtractor, ToolFormat, arguments_format

# Enough prompt tokens to hold the generation prompt the template wrote (and a thinking tag).
_PROMPT_TAIL_TOKENS = 16


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class AnswerParser:
    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallExtractor | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str, *, final: bool) -> Parsed:
        out = Parsed(content=text)
        if self._reasoning is not None:
            out.reasoning, out.content = self._reasoning.feed(text)
            if final:
                more_reasoning, more_content = self._reasoning.flush()
                out.reasoning += more_reasoning
                out.content += more_content
        if self._tools is not None:
            out.content, out.calls = self._tools.feed(out.content)
            if final:
                more_content, more_calls = self._tools.flush()
                out.content += more_content
                out.calls += more_calls
        return out


def tool_format(req: GenerateRequest, tool_call_parser: str | None) -> ToolFormat | None:
    """How the request's answer is read for calls: a forced tool_choice's own format (its grammar wrote
    it), else --tool-call-parser's family; None when no calls are parsed."""
    if not req.parse_tool_calls:
        return None
    if req.forced_tool_name:
        return arguments_format(req.forced_tool_name)
    if req.forced_calls:
        return TOOL_FORMATS["json"]
    return TOOL_FORMATS.get(tool_call_parser or "")


def tool_parser_keeps_special_tokens(tool_call_parser: str | None, req: GenerateRequest) -> bool:
    """The family's tags are special tokens: the answer must be detokenized with them to be parsed."""
    fmt = tool_format(req, tool_call_parser)
    return fmt is not None and fmt.keep_special_tokens


def answer_parser(req: GenerateRequest, tokenizer: Any, prompt: list[int], *, reasoning_parser: str | None,
                  tool_call_parser: str | None) -> AnswerParser | None:
    """The request's parser, or None when neither applies (no parser set, not asked, no tools)."""
    reasoning = None
    rfmt = REASONING_FORMATS.get(reasoning_parser or "")
    thinking_off = rfmt is not None and rfmt.switch is not None and req.chat_template_kwargs.get(rfmt.switch) is False
    if req.separate_reasoning and rfmt is not None and not thinking_off:
        tail = tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        reasoning = ReasoningSplitter(rfmt, inside=prompt_opens_reasoning(rfmt, tail))
    tools = None
    tfmt = tool_format(req, tool_call_parser)
    if tfmt is not None:
        names = {str(t.get("function", {}).get("name")) for t in req.tools if isinstance(t, dict)}
        tools = ToolCallExtractor(tfmt, names, parallel=req.parallel_tool_calls)
    if reasoning is None and tools is None:
        return None
    return AnswerParser(reasoning, tools)
