"""Stop-string matching on streamed text, across token (and delta) boundaries.

Semantics, the same whether the text arrives whole or in pieces: reading left to right, the
first stop string to complete wins (the one that ends earliest; on a tie, the longest). Output
ends before it, or after it with no_stop_trim. While streaming, a tail of the text that could
still grow into a stop string is held back until it resolves.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces in order; each call returns (text to emit now, matched stop or None)."""

    def __init__(self, stops: Sequence[str], *, no_stop_trim: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))  # dedup, keep order
        self._no_stop_trim = no_stop_trim
        self._held = ""
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, str | None]:
        if self.matched is not None:
            raise RuntimeError("feed() after a stop string matched")
        text = self._held + piece
        match = _first_match(text, self._stops)
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched = stop
            return (text[: start + len(stop)] if self._no_stop_trim else text[:start]), stop
        keep = _partial_tail_len(text, self._stops)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], None

    def flush(self) -> str:
        """No more text will come: the held tail cannot become a stop string any more."""
        held, self._held = self._held, ""
        return held


def _first_match(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop occurrence that ends first; ties go to the longest."""
    best: tuple[int, str] | None = None
    best_end = 0
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        end = start + len(stop)
        if best is None or end < best_end or (end == best_end and len(stop) > len(best[1])):
            best, best_end = (start, stop), end
    return best


def _partial_tail_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
