"""N-gram drafting (prompt lookup): no weights, only the token ids each sequence holds.

The last n tokens of a sequence (n from the max window down to the min) are looked up earlier in the
same sequence, prompt and output; the k tokens that followed the match are the draft. Of the
candidates the longest match wins, the most recent among equals (in an edit of a file the answer
follows its latest copy). SGLang's NGRAM and vLLM's prompt lookup draft this way; it pays where an
answer repeats its prompt (code edits, summaries quoting the source, structured rewrites).
"""

from __future__ import annotations

import numpy as np
import torch

from app.worker.spec.proposer import Draft, Proposer, TargetStep


class NgramProposer(Proposer):
    def __init__(self, min_window: int, max_window: int) -> None:
        if not 1 <= min_window <= max_window:
            raise ValueError(f"n-gram windows must satisfy 1 <= min ({min_window}) <= max ({max_window})")
        self.min_window = min_window
        self.max_window = max_window
        self._tokens: dict[int, list[int]] = {}

    def register(self, slot: int, token_ids: list[int]) -> None:
        self._tokens[slot] = list(token_ids)

    def release(self, slot: int) -> None:
        self._tokens.pop(slot, None)

    def observe(self, step: TargetStep) -> None:
        for slot, tokens in zip(step.slots, step.new_tokens, strict=True):
            history = self._tokens.get(slot)
            if history is not None:
                history.extend(tokens)

    def propose(self, slots: list[int], k: int) -> Draft:
        ids = np.zeros((len(slots), k), dtype=np.int64)
        lengths = []
        for row, slot in enumerate(slots):
            found = lookup(self._tokens[slot], self.min_window, self.max_window, k)
            ids[row, : len(found)] = found
            lengths.append(len(found))
        return Draft(torch.from_numpy(ids), None, lengths)


def lookup(tokens: list[int], min_window: int, max_window: int, k: int) -> list[int]:
    """Up to k tokens that followed the longest (then latest) earlier match of the sequence's last n
    tokens, min_window <= n <= max_window; [] if none matches."""
    if len(tokens) < 2 or k < 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    last = len(seq) - 1
    # Candidates end where the last token occurs earlier; extend the match backwards while it holds.
    ends = np.flatnonzero(seq[:last] == seq[last])
    matched = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for back in range(1, max_window):
        if not alive.any():
            break
        start = ends - back
        ok = alive & (start >= 0)
        ok[ok] = seq[start[ok]] == seq[last - back]
        matched += ok
        alive = ok
    good = matched >= min_window
    if not good.any():
        return []
    best = int(matched[good].max())
    end = int(ends[good & (matched == best)][-1])  # the latest of the longest
    return seq[end + 1 : end + 1 + k].tolist()
