"""Chat templates: the model's own, a file, a built-in name, and a model without one."""

from __future__ import annotations

import pytest

from app.tokenizer.chat import ChatTemplateError, render_chat, render_chat_text, resolve_chat_template
from app.tokenizer.templates import BUILTIN_CHAT_TEMPLATES

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]
CHATML_TEXT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture
def bare_tok(tok):
    """The same tokenizer without a chat template."""
    saved = tok.chat_template
    tok.chat_template = None
    yield tok
    tok.chat_template = saved


def test_model_template(tok):
    assert render_chat_text(tok, MESSAGES) == CHATML_TEXT
    ids = render_chat(tok, MESSAGES)
    assert ids == tok.encode(CHATML_TEXT, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_without_generation_prompt(tok):
    text = render_chat_text(tok, MESSAGES, add_generation_prompt=False)
    assert text == CHATML_TEXT.removesuffix("<|im_start|>assistant\n")


def test_builtin_chatml_matches_the_model_template(bare_tok):
    template = resolve_chat_template("chatml")
    assert render_chat_text(bare_tok, MESSAGES, chat_template=template) == CHATML_TEXT


def test_builtin_llama3(bare_tok):
    template = resolve_chat_template("llama-3")
    text = render_chat_text(bare_tok, [{"role": "user", "content": "  Hi  "}], chat_template=template)
    assert text == (
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_template_file_overrides_the_model_template(tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")
    template = resolve_chat_template(str(path))
    assert render_chat_text(tok, MESSAGES, chat_template=template) == (
        "[system]Be brief.[user]What is the capital of France?[assistant]"
    )


def test_unknown_template_name(tmp_path):
    with pytest.raises(ChatTemplateError, match="neither a built-in template .*chatml.*llama-3"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_no_template_given():
    assert resolve_chat_template(None) is None
    assert set(BUILTIN_CHAT_TEMPLATES) >= {"chatml", "llama-3"}


def test_missing_template_is_a_clear_error(bare_tok):
    with pytest.raises(ChatTemplateError, match="the model has no chat template; pass --chat-template"):
        render_chat(bare_tok, MESSAGES)


def test_text_parts_are_joined(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                         {"type": "text", "text": "the capital of France?"}]}]
    assert render_chat_text(tok, parts) == (
        "<|im_start|>user\nWhat is\nthe capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_image_parts_are_rejected(tok):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                        {"type": "image_url", "image_url": {"url": "data:..."}}]}]
    with pytest.raises(ChatTemplateError, match=r"content\[1\] has type 'image_url'.*text content only"):
        render_chat(tok, msgs)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"content": "hi"}], "role must be"),
    ([{"role": "user", "content": 5}], "content must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"text must be a string"),
])
def test_malformed_messages(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        render_chat(tok, messages)


def test_chat_template_kwargs_reach_the_template(tok):
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = render_chat_text(tok, MESSAGES[1:], chat_template=template, chat_template_kwargs={"greeting": "Hey! "})
    assert text == "Hey! What is the capital of France?"


def test_reserved_kwargs_are_rejected(tok):
    with pytest.raises(ChatTemplateError, match="may not set tokenize"):
        render_chat(tok, MESSAGES, chat_template_kwargs={"tokenize": True})


def test_template_errors_become_chat_errors(tok):
    template = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(ChatTemplateError, match="only user turns, please"):
        render_chat(tok, MESSAGES, chat_template=template)
