"""The interface between the model runner and a drafting method (n-gram, draft model, EAGLE-3).

The runner owns the target model, the slots and the verification; a proposer only drafts. Per slot
it sees the sequence's token ids (register), every token the sequence keeps afterwards (observe),
and, if it asks, the target's hidden states of the positions the runner fed (prefill chunks and
verified positions), which a draft model or an EAGLE head needs to build its own state. The runner
calls, for a step that speculates on some slots:

    proposer.register(slot, prompt_ids + output_ids)         # when the slot's sequence arrives
    ...
    draft = proposer.propose(slots, k)                       # before the verify forward
    # the target verifies [last token, d_1 .. d_k] of each slot in one extend forward, accepts a
    # prefix of the drafts and samples one more token (verify.py), then:
    proposer.observe(TargetStep(slots, fed, kept, new_tokens, hidden))
    ...
    proposer.release(slot)                                   # when the scheduler frees the slot

A minimal proposer (it always drafts the same token, deterministically):

    class Repeat(Proposer):
        def __init__(self):
            self.last: dict[int, int] = {}
        def register(self, slot, token_ids):
            self.last[slot] = token_ids[-1]
        def release(self, slot):
            self.last.pop(slot, None)
        def observe(self, step):
            for slot, tokens in zip(step.slots, step.new_tokens):
                if tokens:
                    self.last[slot] = tokens[-1]
        def propose(self, slots, k):
            ids = torch.tensor([[self.last[s]] * k for s in slots])
            return Draft(ids)

Draft probabilities: a deterministic proposer (n-gram) returns `probs=None`; the verifier then
accepts draft d with probability p(d) and on rejection samples from p with d removed (verify.py).
A model draft that samples its tokens returns q, the distribution each token was drawn from, and
the verifier accepts with min(1, p/q), sampling the residual max(0, p - q) on rejection. A model
draft that drafts greedily (argmax) is deterministic: it may return None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class Draft:
    """Drafted tokens for the slots passed to propose(), row i for slots[i].

    token_ids: [B, k] int64, on the runner's device or the host.
    probs: [B, k, V] float32 draft distributions the tokens were sampled from; None for a
        deterministic draft (each row's q is one-hot on its token).
    lengths: how many of each row's k tokens are real drafts (the rest are padding the verifier
        ignores); None: all k. A proposer with nothing to offer for a slot says 0 (n-gram, no match).
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None
    lengths: list[int] | None = None

    def length(self, row: int) -> int:
        return int(self.token_ids.shape[1]) if self.lengths is None else self.lengths[row]


@dataclass
class TargetStep:
    """What the target did for some slots in one step, for proposers that follow its state.

    slots[i] was fed fed[i] (its prefill chunk, or its last token then its drafts for a verify row)
    at positions start[i] .. start[i] + len(fed[i]) - 1; the first kept[i] of those positions stay
    in the KV cache (a prefill chunk: all; a verify row: 1 + accepted drafts), and new_tokens[i] are
    the tokens the sequence gained (empty for a chunk that did not sample; accepted drafts plus the
    one sampled after them for a verify row). hidden: the target's last hidden states of the step's
    fed positions, rows in the same order as the flat concatenation of fed (only when the
    proposer's `wants_hidden` is True; None otherwise). aux_hidden: the hidden states of the layers
    the proposer named in `capture_layers`, concatenated along the last dimension (EAGLE-3), or None.
    """

    slots: list[int]
    fed: list[list[int]]
    start: list[int]
    kept: list[int]
    new_tokens: list[list[int]]
    hidden: torch.Tensor | None = None
    aux_hidden: torch.Tensor | None = None


class Proposer(ABC):
    """A drafting method. The runner owns one per worker (TP leader drafts; see the runner).

    Class attributes a proposer may override:
    wants_hidden: observe() gets the target's last hidden states (draft heads).
    capture_layers: target layer indices whose outputs observe() gets in aux_hidden (EAGLE-3).
    drafts_on_device: propose() returns token ids made on the runner's device (a model draft): the
        runner feeds them without reading them back first (decoder.VerifyRows.pending).
    """

    wants_hidden: bool = False
    capture_layers: tuple[int, ...] = ()
    drafts_on_device: bool = False

    @abstractmethod
    def register(self, slot: int, token_ids: list[int]) -> None:
        """A sequence took `slot`; token_ids: all it holds (prompt, then output before a preemption)."""

    @abstractmethod
    def release(self, slot: int) -> None:
        """The slot's sequence left (finished, aborted, preempted): forget it."""

    @abstractmethod
    def observe(self, step: TargetStep) -> None:
        """The target's step for these slots (see TargetStep); called after every step, before the next
        propose(), for every registered slot the step touched."""

    @abstractmethod
    def propose(self, slots: list[int], k: int) -> Draft:
        """Draft up to k tokens to follow each slot's sequence (its last token included: the one the
        verify forward feeds first)."""
