"""Incremental detokenization: deltas concatenate to tokenizer.decode and never split a character."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from app.tokenizer.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, token_texts
from tests.support.tokenizer_factory import build_tokenizer

MODEL_DIR = os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR")
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text with multi-byte characters the tiny tokenizer splits into several byte tokens.
UNICODE_TEXT = st.lists(
    st.sampled_from(list("abc xyz.,!\n") + ["\u00e9", "\u00fc", "\u65e5", "\u8a9e", "\U0001f600",
                                           "\U0001f680", "\u2764\ufe0f", "<|im_end|>"]),
    max_size=40,
).map("".join) | st.text(max_size=20).filter(lambda t: REPLACEMENT_CHAR not in t)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def smollm2():
    if not MODEL_DIR or not Path(MODEL_DIR).is_dir():
        pytest.skip("TOKENSPEED_DEFAULT_MODEL_DIR is not a prepared model")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feed ids in pieces split at `cuts`; the deltas, with the final flush last."""
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    deltas = [detok.add(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return [*deltas, detok.flush()]


def check_stream(tok, ids, cuts, prompt, skip, spaces):
    detok = IncrementalDetokenizer(
        tok, skip_special_tokens=skip, spaces_between_special_tokens=spaces, prompt_ids=prompt
    )
    deltas = stream(detok, ids, cuts)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    # Only the final flush may end mid-character (random ids can leave invalid bytes for good).
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1])
    return deltas


def random_ids(vocab: int):
    return st.lists(st.integers(0, vocab - 1), max_size=40)


@SETTINGS
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_random_ids_match_decode(tiny, data, skip, spaces):
    ids = data.draw(random_ids(len(tiny)))
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=10))
    prompt = data.draw(random_ids(len(tiny)).map(lambda p: p[:8]))
    check_stream(tiny, ids, cuts, prompt, skip, spaces)


@pytest.mark.slow  # hypothesis over a real tokenizer
@SETTINGS
@given(text=UNICODE_TEXT, prompt_text=UNICODE_TEXT, skip=st.booleans(), cuts=st.lists(st.integers(0, 100)))
def test_unicode_text_never_emits_broken_characters(tiny, text, prompt_text, skip, cuts):
    ids = tiny.encode(text)
    assume(tiny.decode(ids) == text)  # the tokenizer can represent it (no unknown bytes)
    deltas = check_stream(tiny, ids, cuts, tiny.encode(prompt_text), skip, True)
    # Valid text: no delta may contain a replacement character at all.
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_one_token_at_a_time_holds_split_emoji(tiny):
    ids = tiny.encode("a\U0001f680b")  # the rocket is not in the corpus: it takes byte tokens
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tiny)
    deltas = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "a\U0001f680b"
    assert "\U0001f680" in deltas  # arrives whole, in one delta
    assert deltas.count("") >= 3  # the partial bytes were held back


def test_flush_releases_an_unfinished_character(tiny):
    rocket = tiny.encode("\U0001f680")
    detok = IncrementalDetokenizer(tiny)
    assert detok.add(rocket[:-1]) == ""
    assert detok.flush().endswith(REPLACEMENT_CHAR)  # the request ended mid-character


def test_special_tokens(tiny):
    ids = tiny.encode("hi<|im_end|>there")
    for skip, expected in ((True, "hithere"), (False, "hi<|im_end|>there")):
        detok = IncrementalDetokenizer(tiny, skip_special_tokens=skip)
        assert "".join(detok.add([i]) for i in ids) + detok.flush() == expected


def test_window_stays_small(tiny):
    """O(1) per token: the decoded window does not grow with the output."""
    detok = IncrementalDetokenizer(tiny)
    calls: list[int] = []
    original = detok._decode
    detok._decode = lambda ids: calls.append(len(ids)) or original(ids)
    for tid in tiny.encode("The quick brown fox jumps over the lazy dog. " * 40):
        detok.add([tid])
    assert len(calls) > 500
    assert max(calls) <= 4


def test_token_texts(tiny):
    ids = tiny.encode("Hello<|im_end|>")
    assert "".join(token_texts(tiny, ids)) == "Hello<|im_end|>"
    assert token_texts(tiny, ids)[-1] == "<|im_end|>"


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_smollm2_random_ids_match_decode(smollm2, data, skip):
    ids = data.draw(random_ids(len(smollm2)))
    cuts = data.draw(st.lists(st.integers(0, 100), max_size=10))
    prompt = data.draw(random_ids(len(smollm2)).map(lambda p: p[:8]))
    check_stream(smollm2, ids, cuts, prompt, skip, True)


@SETTINGS
@given(text=UNICODE_TEXT, skip=st.booleans(), cuts=st.lists(st.integers(0, 100)))
def test_smollm2_unicode_text(smollm2, text, skip, cuts):
    assume(smollm2.decode(smollm2.encode(text)) == text)  # a few rare bytes have no token in its vocab
    deltas = check_stream(smollm2, smollm2.encode(text), cuts, smollm2.encode("Say:"), skip, True)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
