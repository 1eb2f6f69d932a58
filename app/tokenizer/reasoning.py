"""Reasoning parsers (--reasoning-parser): a chat answer's text -> (reasoning, content), incrementally.

Every family on the list writes its reasoning between `<think>` and `</think>` (sources in
docs/api.md); they differ in whether the output starts inside the block and in what else may
close it:
- qwen3: the model opens the block itself, or the template opened it (Qwen3 thinking-only
  models), or the template wrote an empty block (`enable_thinking: false`, which also turns the
  parser off): all three are read from the end of the rendered prompt.
- deepseek_r1: the output always starts inside (R1's template ends the prompt with `<think>`;
  older R1 outputs omit the opening tag), as SGLang's and vLLM's parsers assume.
- deepseek_v31: the template writes `<think>` (thinking mode) or `</think>` into the prompt.
- kimi_k25: thinking by default, so the output starts inside unless the prompt closed the block or
  `chat_template_kwargs` sets `thinking: false` (as vLLM's parser of that name); a tool-call section
  also ends the reasoning (K2.5 may call a tool without closing the block) and stays in the content
  for the tool parser.
- base: `<think>...</think>` with nothing else assumed.

The splitter is a state machine over the text as it arrives: it holds back only what could still
be the start of a marker (or trailing whitespace of the reasoning), so the concatenated output of
any chunking equals the output of one feed of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_START = "<think>"
THINK_END = "</think>"
KIMI_TOOL_SECTION = "<|tool_calls_section_begin|>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = THINK_START
    end: str = THINK_END
    always_inside: bool = False  # the output starts inside the block unless the prompt closed one
    ends_before: tuple[str, ...] = ()  # markers that end the reasoning and stay in the content
    switch: str | None = None  # the chat_template_kwargs key whose false value means "no thinking"


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    "base": ReasoningFormat("base"),
    "qwen3": ReasoningFormat("qwen3", switch="enable_thinking"),
    "deepseek_r1": ReasoningFormat("deepseek_r1", always_inside=True),
    "deepseek_v31": ReasoningFormat("deepseek_v31", switch="thinking"),
    "kimi_k25": ReasoningFormat("kimi_k25", always_inside=True, ends_before=(KIMI_TOOL_SECTION,), switch="thinking"),
}

# How much of the rendered prompt's end is read to see whether the template opened the block.
PROMPT_TAIL_CHARS = 64


def prompt_opens_reasoning(fmt: ReasoningFormat, prompt_tail: str) -> bool | None:
    """True: the prompt ends inside an open block (the template wrote the opening tag); False: the
    template closed one (thinking off); None: neither tag is at the end of the prompt."""
    tail = prompt_tail[-PROMPT_TAIL_CHARS:]
    opened, closed = tail.rfind(fmt.start), tail.rfind(fmt.end)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


class _State(Enum):
    START = "start"  # nothing but whitespace yet: the output may open the block
    REASONING_LEAD = "reasoning_lead"  # inside, before the first non-space reasoning character
    REASONING = "reasoning"
    CONTENT_LEAD = "content_lead"  # the block closed: whitespace before the answer is dropped
    CONTENT = "content"


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text that is a proper prefix of a marker (it may still become one)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ReasoningSplitter:
    """One request's text -> (reasoning, content) deltas. feed() as text arrives, flush() at the end.

    Reasoning is stripped of surrounding whitespace, and so is the start of the answer after the
    block; output without a block is content exactly as written."""

    def __init__(self, fmt: ReasoningFormat, *, inside: bool | None = None) -> None:
        """inside: whether the output starts inside the block (None: unknown, the format's default)."""
        self._fmt = fmt
        self._closers = (fmt.end, *fmt.ends_before)
        starts_inside = fmt.always_inside if inside is None else inside
        self._state = _State.REASONING_LEAD if starts_inside else _State.START
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state in (_State.REASONING_LEAD, _State.REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        reasoning, content = self.feed("")
        buf, self._buf = self._buf, ""
        if self._state is _State.REASONING_LEAD:
            reasoning += buf.strip()
        elif self._state is _State.REASONING:  # the buffer's leading space is inside the reasoning
            reasoning += buf.rstrip()
        elif self._state in (_State.START, _State.CONTENT):
            content += buf
        return reasoning, content

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Advance once over the buffer; True if the state changed and another step may make progress."""
        buf = self._buf
        state = self._state
        if state is _State.START:
            head = buf.lstrip()
            if head.startswith(self._fmt.start):
                self._buf = head[len(self._fmt.start):]
                self._state = _State.REASONING_LEAD
                return True
            if not head or self._fmt.start.startswith(head):
                return False  # still could be the opening tag
            self._state = _State.CONTENT
            return True
        if state is _State.REASONING_LEAD:
            head = buf.lstrip()
            # A model may write the opening tag the template already wrote (R1): not reasoning text.
            if head.startswith(self._fmt.start):
                head = head[len(self._fmt.start):].lstrip()
            elif head and self._fmt.start.startswith(head):
                return False
            self._buf = head
            if not head:
                return False
            self._state = _State.REASONING
            return True
        if state is _State.REASONING:
            return self._reasoning_step(buf, reasoning)
        if state is _State.CONTENT_LEAD:
            self._buf = buf.lstrip()
            if not self._buf:
                return False
            self._state = _State.CONTENT
            return True
        if buf:
            content.append(buf)
            self._buf = ""
        return False

    def _reasoning_step(self, buf: str, reasoning: list[str]) -> bool:
        hits = [(buf.find(m), m) for m in self._closers if m in buf]
        if hits:
            at, marker = min(hits)
            reasoning.append(buf[:at].rstrip())
            # The block's own end tag is consumed; a tool section stays for the content.
            self._buf = buf[at + len(marker):] if marker == self._fmt.end else buf[at:]
            self._state = _State.CONTENT_LEAD
            return True
        held = held_prefix(buf, self._closers)
        safe = buf[: len(buf) - held]
        ready = safe.rstrip()  # trailing whitespace waits: it is dropped if the block ends next
        reasoning.append(ready)
        self._buf = buf[len(ready):]
        return False


def split_reasoning(fmt: ReasoningFormat, text: str, *, inside: bool | None = None) -> tuple[str, str]:
    """The whole text at once (what a non-streaming answer gets)."""
    splitter = ReasoningSplitter(fmt, inside=inside)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.flush()
    return r1 + r2, c1 + c2
