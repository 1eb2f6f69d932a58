"""Building a request's prompt and the checks it must pass."""

from __future__ import annotations

import pytest

from app.protocol import GenerateRequest, SamplingParams
from app.tokenizer.prompt import PromptError, build_prompt, validate_prompt


def req(**kw) -> GenerateRequest:
    return GenerateRequest(rid="r", sampling=SamplingParams(), **kw)


def build(tok, r, vocab=512):
    return build_prompt(r, tok, chat_template=None, vocab_size=vocab)


def test_text_prompt(tok):
    assert build(tok, req(text="Hello, world!")) == tok.encode("Hello, world!")


def test_chat_prompt(tok):
    ids = build(tok, req(messages=[{"role": "user", "content": "Hi"}]))
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_error_is_a_prompt_error(tok):
    with pytest.raises(PromptError, match="text content only"):
        build(tok, req(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))


def test_input_ids_are_taken_as_they_are(tok):
    assert build(tok, req(input_ids=[5, 0, 511])) == [5, 0, 511]


@pytest.mark.parametrize("ids", [[1, 512], [-1], [1, "2"], [True]])
def test_input_ids_out_of_range(tok, ids):
    with pytest.raises(PromptError, match=r"is not a token id in \[0, 512\)"):
        build(tok, req(input_ids=ids))


def test_exactly_one_prompt_kind(tok):
    with pytest.raises(PromptError, match="exactly one of"):
        build(tok, req(text="a", input_ids=[1]))
    with pytest.raises(PromptError, match="exactly one of"):
        build(tok, req())


def test_without_tokenizer_only_ids():
    assert build(None, req(input_ids=[3, 4])) == [3, 4]
    with pytest.raises(PromptError, match="--skip-tokenizer-init"):
        build(None, req(text="hello"))
    with pytest.raises(PromptError, match="chat messages need the tokenizer.*--skip-tokenizer-init"):
        build(None, req(messages=[{"role": "user", "content": "Hi"}]))


def test_validate_accepts_a_prompt_that_fits():
    validate_prompt([1] * 10, 6, max_model_len=16)
    validate_prompt([1] * 15, None, max_model_len=16)
    validate_prompt([1] * 15, 0, max_model_len=16)


def test_empty_prompt():
    with pytest.raises(PromptError, match="the prompt is empty"):
        validate_prompt([], 4, max_model_len=16)


def test_prompt_fills_the_context():
    with pytest.raises(PromptError, match=r"prompt has 16 tokens.*--max-model-len\) is 16"):
        validate_prompt([1] * 16, None, max_model_len=16)


def test_prompt_plus_new_tokens_too_long():
    with pytest.raises(PromptError, match=r"10 tokens and 7 new tokens.*17 in total.*of 16"):
        validate_prompt([1] * 10, 7, max_model_len=16)


def test_negative_max_new_tokens():
    with pytest.raises(PromptError, match="max_new_tokens must be >= 0"):
        validate_prompt([1], -1, max_model_len=16)
