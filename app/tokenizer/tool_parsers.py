"""Tool-call parsers (--tool-call-parser): a chat answer's content -> (content, tool calls), incrementally.

Each family marks a tool-call section with its own tags (sources in docs/api.md):
- qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5,
  Qwen3; the Hermes format).
- kimik2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
  {...}<|tool_call_end|>...<|tool_calls_section_end|>`; the `functions.NAME:IDX` string is the call id.
- deepseek_v4: DeepSeek's DSML section, `<｜DSML｜function_calls><｜DSML｜invoke name="NAME">
  <｜DSML｜parameter name="P" string="true|false">VALUE</｜DSML｜parameter></｜DSML｜invoke>...
  </｜DSML｜function_calls>` (published with V3.2; see docs/api.md on what could not be verified).
- json: the whole answer is one JSON call object or an array of them (`{"name", "arguments"|"parameters"}`),
  what a constrained `tool_choice: "required"` produces.
- passthrough: no parsing; the text stays content (tools still reach the chat template).
- a named tool_choice (arguments_format, per request, not a --tool-call-parser value): the whole answer
  is the named tool's arguments object.

A section is held back until it is complete, then parsed at once: a call is sent whole (name, then
its arguments as one fragment). A section that does not parse, or names a tool that was not
offered, comes back as content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from app.protocol import ToolCall
from app.tokenizer.reasoning import held_prefix


class MalformedCall(ValueError):
    """The section's text is not a call in the family's syntax."""


Call = tuple[str, Any, str | None]  # (name, arguments as a JSON value, the model's own id or None)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # opens a section ("" : the whole answer is one section when it starts with { or [)
    end: str  # closes it ("": the end of the answer)
    parse: Callable[[str], list[Call]]  # the text between start and end -> calls
    keep_special_tokens: bool = False  # the tags are special tokens: detokenize with them


def _object_call(obj: Any) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise MalformedCall("a call must be an object with a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise MalformedCall(f"arguments are not JSON: {exc}") from exc
    if not isinstance(args, dict):
        raise MalformedCall("arguments must be a JSON object")
    return obj["name"], args, None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise MalformedCall(f"not JSON: {exc}") from exc


def parse_qwen(section: str) -> list[Call]:
    return [_object_call(_loads(section.strip()))]


def parse_json(section: str) -> list[Call]:
    value = _loads(section.strip())
    items = value if isinstance(value, list) else [value]
    if not items:
        raise MalformedCall("an empty list of calls")
    return [_object_call(item) for item in items]


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)\s*<\|tool_call_end\|>",
    re.DOTALL,
)
_KIMI_ID = re.compile(r"(?:functions\.)?(?P<name>[^:\s]+)(?::\d+)?")


def parse_kimik2(section: str) -> list[Call]:
    calls: list[Call] = []
    rest = section
    for match in _KIMI_CALL.finditer(section):
        call_id = match.group("id")
        named = _KIMI_ID.fullmatch(call_id)
        if named is None:
            raise MalformedCall(f"call id {call_id!r} is not functions.NAME:INDEX")
        args = _loads(match.group("args"))
        if not isinstance(args, dict):
            raise MalformedCall("arguments must be a JSON object")
        calls.append((named.group("name"), args, call_id))
        rest = rest.replace(match.group(0), "", 1)
    if not calls or rest.strip():
        raise MalformedCall("text in the tool-call section is not a call")
    return calls


_DSML = "｜DSML｜"
_DSML_INVOKE = re.compile(rf'<{_DSML}invoke\s+name="(?P<name>[^"]+)"\s*>(?P<body>.*?)</{_DSML}invoke>', re.DOTALL)
_DSML_PARAM = re.compile(
    rf'<{_DSML}parameter\s+name="(?P<name>[^"]+)"(?:\s+string="(?P<string>true|false)")?\s*>'
    rf"(?P<value>.*?)</{_DSML}parameter>",
    re.DOTALL,
)


def parse_dsml(section: str) -> list[Call]:
    calls: list[Call] = []
    rest = section
    for invoke in _DSML_INVOKE.finditer(section):
        args: dict[str, Any] = {}
        body = invoke.group("body")
        for param in _DSML_PARAM.finditer(body):
            value = param.group("value")
            # string="true" (or absent): the value is the text itself; "false": a JSON value.
            args[param.group("name")] = _loads(value) if param.group("string") == "false" else value
            body = body.replace(param.group(0), "", 1)
        if body.strip():
            raise MalformedCall("text in an invoke block is not a parameter")
        calls.append((invoke.group("name"), args, None))
        rest = rest.replace(invoke.group(0), "", 1)
    if not calls or rest.strip():
        raise MalformedCall("text in the function_calls block is not an invoke")
    return calls


TOOL_FORMATS: dict[str, ToolFormat | None] = {
    "qwen": ToolFormat("qwen", "<tool_call>", "</tool_call>", parse_qwen),
    "json": ToolFormat("json", "", "", parse_json),
    "kimik2": ToolFormat("kimik2", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", parse_kimik2,
                         keep_special_tokens=True),
    "deepseek_v4": ToolFormat("deepseek_v4", f"<{_DSML}function_calls>", f"</{_DSML}function_calls>", parse_dsml,
                              keep_special_tokens=True),
    "passthrough": None,
}


def arguments_format(name: str) -> ToolFormat:
    """A named tool_choice: decoding was constrained to the tool's arguments object, so the whole answer
    is one call to `name` (its text, when it is no object: a call cut by max_tokens stays content)."""

    def parse(section: str) -> list[Call]:
        return [_object_call({"name": name, "arguments": _loads(section.strip())})]

    return ToolFormat(f"arguments of {name}", "", "", parse)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _State(Enum):
    START = "start"  # nothing but whitespace yet (json: the answer may be a call)
    CONTENT = "content"
    CONTENT_LEAD = "content_lead"  # right after a section: whitespace before more text is dropped
    SECTION = "section"


class ToolCallExtractor:
    """One request's content -> (content, calls) deltas. feed() as text arrives, flush() at the end.

    tool_names: the offered tools (a call to another name is malformed). parallel: False keeps the
    first call only (OpenAI's parallel_tool_calls). Whitespace around sections is dropped, so the
    streamed and the whole answer carry the same content."""

    def __init__(self, fmt: ToolFormat, tool_names: set[str], *, parallel: bool = True) -> None:
        self._fmt = fmt
        self._names = tool_names
        self._parallel = parallel
        self._state = _State.START
        self._buf = ""
        self._count = 0

    @property
    def num_calls(self) -> int:
        return self._count

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls, final=False):
            pass
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        while self._step(content, calls, final=True):
            pass
        if self._state is _State.SECTION:  # an unclosed section: parse what there is
            self._close_section(self._buf, self._buf[len(self._fmt.start):], content, calls)
        elif self._state is not _State.CONTENT_LEAD:
            content.append(self._buf)
        self._buf = ""
        return "".join(content), calls

    def _step(self, content: list[str], calls: list[ToolCall], *, final: bool) -> bool:
        buf = self._buf
        if self._state is _State.START:
            head = buf.lstrip()
            if not self._fmt.start:  # json: the answer is a call if it starts like one
                if not head:
                    return False
                self._state = _State.SECTION if head[0] in "{[" else _State.CONTENT
                return True
            if not head and not final:
                return False
            self._state = _State.CONTENT
            return True
        if self._state is _State.CONTENT_LEAD:
            self._buf = buf.lstrip()
            if not self._buf:
                return False
            self._state = _State.CONTENT
            return True
        if self._state is _State.CONTENT:
            return self._content_step(buf, content, final=final)
        return self._section_step(buf, content, calls)

    def _content_step(self, buf: str, content: list[str], *, final: bool) -> bool:
        at = buf.find(self._fmt.start) if self._fmt.start else -1
        if at >= 0:
            content.append(buf[:at].rstrip())  # the space before a call separates, it is not content
            self._buf = buf[at:]
            self._state = _State.SECTION
            return True
        if final:
            return False
        held = held_prefix(buf, (self._fmt.start,)) if self._fmt.start else 0
        ready = buf[: len(buf) - held].rstrip()
        content.append(ready)
        self._buf = buf[len(ready):]
        return False

    def _section_step(self, buf: str, content: list[str], calls: list[ToolCall]) -> bool:
        if not self._fmt.end:
            return False  # the section runs to the end of the answer
        at = buf.find(self._fmt.end, len(self._fmt.start))
        if at < 0:
            return False
        whole = buf[: at + len(self._fmt.end)]
        self._close_section(whole, buf[len(self._fmt.start):at], content, calls)
        self._buf = buf[len(whole):]
        self._state = _State.CONTENT_LEAD
        return True

    def _close_section(self, whole: str, inner: str, content: list[str], calls: list[ToolCall]) -> None:
        try:
            parsed = self._fmt.parse(inner)
            unknown = [name for name, _, _ in parsed if name not in self._names]
            if unknown:
                raise MalformedCall(f"no tool named {unknown[0]!r} was offered")
        except MalformedCall:
            content.append(whole)  # the model's text, as it wrote it
            return
        for name, args, call_id in parsed:
            if self._count and not self._parallel:
                return
            calls.append(ToolCall(id=call_id or new_call_id(), name=name,
                                  arguments=json.dumps(args, ensure_ascii=False)))
            self._count += 1


def extract_tool_calls(fmt: ToolFormat, tool_names: set[str], text: str) -> tuple[str, list[ToolCall]]:
    """The whole text at once (what a non-streaming answer gets)."""
    extractor = ToolCallExtractor(fmt, tool_names)
    c1, k1 = extractor.feed(text)
    c2, k2 = extractor.flush()
    return c1 + c2, k1 + k2
