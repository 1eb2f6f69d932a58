"""Stop-string matching: streaming in any pieces gives what matching the whole text gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.tokenizer.stop import StopMatcher

ALPHABET = "abcx\u00e9\U0001f600"
STOPS = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=4)


def oracle(text: str, stops: list[str], no_stop_trim: bool) -> tuple[str, str | None]:
    """Scan ends left to right: the first position where a stop string ends (longest on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if no_stop_trim else text[: end - len(stop)]), stop
    return text, None


def stream(matcher: StopMatcher, pieces: list[str]) -> tuple[str, str | None, list[str]]:
    out: list[str] = []
    for piece in pieces:
        emitted, matched = matcher.feed(piece)
        out.append(emitted)
        if matched is not None:
            return "".join(out), matched, out
    out.append(matcher.flush())
    return "".join(out), None, out


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30), stops=STOPS, cuts=st.lists(st.integers(0, 40)),
       no_stop_trim=st.booleans())
def test_streaming_equals_whole_text(text, stops, cuts, no_stop_trim):
    expected = oracle(text, stops, no_stop_trim)
    whole = stream(StopMatcher(stops, no_stop_trim=no_stop_trim), [text])
    pieces = stream(StopMatcher(stops, no_stop_trim=no_stop_trim), split(text, cuts))
    assert whole[:2] == expected
    assert pieces[:2] == expected


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30), stops=STOPS)
def test_held_text_is_only_a_possible_stop_start(text, stops):
    """Char by char: what is held back at any moment is a proper prefix of some stop string."""
    matcher = StopMatcher(stops)
    emitted = ""
    for i, ch in enumerate(text):
        out, matched = matcher.feed(ch)
        emitted += out
        if matched is not None:
            return
        held = text[: i + 1][len(emitted):]
        assert text[: i + 1].startswith(emitted)
        assert held == "" or any(s.startswith(held) and s != held for s in stops)


def test_match_across_pieces_trims_before_the_stop():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == ("hello ", None)  # "E" held: it may start END
    assert m.feed("N") == ("", None)
    assert m.feed("D and more") == ("", "END")
    assert m.matched == "END"


def test_no_stop_trim_keeps_the_stop_string():
    m = StopMatcher(["\n\n"], no_stop_trim=True)
    assert m.feed("a\n") == ("a", None)
    assert m.feed("\nb") == ("\n\n", "\n\n")


def test_false_start_is_released():
    m = StopMatcher(["stop"])
    assert m.feed("st") == ("", None)
    assert m.feed("ep") == ("step", None)
    assert m.feed("s") == ("", None)
    assert m.flush() == "s"


def test_earliest_ending_stop_wins():
    assert StopMatcher(["abcd", "bc"]).feed("abcd") == ("a", "bc")
    assert StopMatcher(["bc", "abc"]).feed("xabc") == ("x", "abc")


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])


def test_feed_after_match_is_an_error():
    m = StopMatcher(["x"])
    m.feed("x")
    with pytest.raises(RuntimeError):
        m.feed("y")
