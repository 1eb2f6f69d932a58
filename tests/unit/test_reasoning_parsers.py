"""Reasoning parsers over each family's real output format, chunked at every boundary."""

from __future__ import annotations

import pytest

from app.tokenizer.reasoning import (
    REASONING_FORMATS,
    ReasoningSplitter,
    prompt_opens_reasoning,
    split_reasoning,
)

# (parser, prompt tail, model output, expected reasoning, expected content)
CASES = [
    # Qwen3 (hybrid): the model opens the block itself.
    ("qwen3", "<|im_start|>assistant\n", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
     "The user greets me.", "Hello! How can I help?"),
    # Qwen3 with enable_thinking false: the template wrote an empty block; the answer is content.
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello there.", "", "Hello there."),
    # Qwen3 thinking-only models: the template opened the block, the output starts inside it.
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Two plus two is four.\n</think>\n\nIt is 4.",
     "Two plus two is four.", "It is 4."),
    # No block at all: everything is content, exactly as written.
    ("qwen3", "<|im_start|>assistant\n", "  Plain <b>answer</b>\n", "", "  Plain <b>answer</b>\n"),
    # A block that never closes (max_tokens hit while thinking): all reasoning.
    ("qwen3", "<|im_start|>assistant\n", "<think>\nStill thinking about </thi", "Still thinking about </thi", ""),
    # DeepSeek-R1: the template ends the prompt with <think>; the output may repeat it or not.
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Let me see.\n</think>\n\nThe answer is 7.",
     "Let me see.", "The answer is 7."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nHmm.\n</think>The answer.", "Hmm.", "The answer."),
    # DeepSeek-V3.1: thinking mode opens the block in the prompt, non-thinking closes it there.
    ("deepseek_v31", "<｜Assistant｜><think>", "Reasoning here</think>Final.", "Reasoning here", "Final."),
    ("deepseek_v31", "<｜Assistant｜></think>", "Direct answer.", "", "Direct answer."),
    # Kimi K2.5: a tool-call section ends the reasoning and stays in the content.
    ("kimi_k25", "<|im_assistant|>assistant<|im_middle|>",
     "<think>I should call the tool.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0",
     "I should call the tool.", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"),
    ("kimi_k25", "<|im_assistant|>assistant<|im_middle|>", "<think>ok</think>Sure.", "ok", "Sure."),
    # Kimi thinks by default: an output without the opening tag starts inside; a closed block in the
    # prompt (thinking off) makes it all content.
    ("kimi_k25", "<|im_assistant|>assistant<|im_middle|>", "Plan first.</think>Done.", "Plan first.", "Done."),
    ("kimi_k25", "<|im_middle|><think></think>", "Hi there.", "", "Hi there."),
    ("base", "", "<think>a < b and c</think> d", "a < b and c", "d"),
    # Multibyte text and a marker-like fragment inside the reasoning.
    ("base", "", "<think>héllo </th ink> 世界\n\n</think>\n答案", "héllo </th ink> 世界", "答案"),
]


def _run(name: str, prompt_tail: str, chunks: list[str]) -> tuple[str, str]:
    fmt = REASONING_FORMATS[name]
    splitter = ReasoningSplitter(fmt, inside=prompt_opens_reasoning(fmt, prompt_tail))
    reasoning, content = "", ""
    for chunk in chunks:
        r, c = splitter.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize(("name", "tail", "output", "reasoning", "content"), CASES)
def test_whole_output(name: str, tail: str, output: str, reasoning: str, content: str) -> None:
    fmt = REASONING_FORMATS[name]
    assert split_reasoning(fmt, output, inside=prompt_opens_reasoning(fmt, tail)) == (reasoning, content)


@pytest.mark.parametrize(("name", "tail", "output", "reasoning", "content"), CASES)
def test_every_chunking_gives_the_same_split(name: str, tail: str, output: str, reasoning: str,
                                            content: str) -> None:
    # Every two-way and three-way cut, and one character at a time: nothing lost or duplicated.
    assert _run(name, tail, list(output)) == (reasoning, content)
    for i in range(len(output) + 1):
        assert _run(name, tail, [output[:i], output[i:]]) == (reasoning, content), i
        for j in range(i, len(output) + 1, 3):
            assert _run(name, tail, [output[:i], output[i:j], output[j:]]) == (reasoning, content), (i, j)


def test_streamed_reasoning_arrives_before_the_block_ends() -> None:
    splitter = ReasoningSplitter(REASONING_FORMATS["qwen3"])
    assert splitter.feed("<think>\nfirst ") == ("first", "")
    assert splitter.in_reasoning
    assert splitter.feed("second</th") == (" second", "")
    assert splitter.feed("ink>\n\nanswer") == ("", "answer")
    assert not splitter.in_reasoning


def test_prompt_tail_detection() -> None:
    fmt = REASONING_FORMATS["qwen3"]
    assert prompt_opens_reasoning(fmt, "<|im_start|>assistant\n<think>\n")
    assert prompt_opens_reasoning(fmt, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is False
    assert prompt_opens_reasoning(fmt, "<|im_start|>assistant\n") is None
    # An old turn's closed block far back in the prompt does not count.
    assert prompt_opens_reasoning(fmt, "<think>" + "x" * 100 + "<|im_start|>assistant\n") is None
