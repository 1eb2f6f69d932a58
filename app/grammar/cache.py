"""A bounded LRU of compile outcomes by grammar text: the serialized compiled grammar, or the compiler's
error (a schema that failed once fails again: it is answered without recompiling).

Bounded twice: at most `max_entries` entries and `max_bytes` characters of serialized grammars (a compiled
JSON schema over a 128k vocabulary is a few hundred kB to a few MB). The least recently used entries go
first; an entry larger than max_bytes alone is not kept at all.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    """A compile's result: `compiled` (serialized) on success, else `error` (the compiler's message)."""

    compiled: str = ""
    error: str = ""

    @property
    def size(self) -> int:
        return len(self.compiled) + len(self.error)


class GrammarCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"max_entries and max_bytes must be >= 0, got {max_entries} and {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], Outcome] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, key: tuple[str, str]) -> Outcome | None:
        outcome = self._entries.get(key)
        if outcome is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return outcome

    def put(self, key: tuple[str, str], outcome: Outcome) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        if outcome.size > self.max_bytes or self.max_entries == 0:
            return
        self._entries[key] = outcome
        self._bytes += outcome.size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def check_invariants(self) -> None:
        """The byte count is the sum of the entries' sizes and both bounds hold."""
        assert self._bytes == sum(o.size for o in self._entries.values()), "byte count drifted"
        assert len(self._entries) <= self.max_entries, "too many entries"
        assert self._bytes <= self.max_bytes, "too many bytes"
        assert all(o.size <= self.max_bytes for o in self._entries.values())
