"""Structured output in the worker: a grammar matcher per constrained slot, and the mask of its rows.

A constrained sequence arrives with its grammar compiled and serialized (GrammarSpec.compiled, from the
tokenizer process); it is deserialized once per grammar text (a small LRU here) and a GrammarMatcher per
slot follows the tokens the sequence outputs (a preempted sequence's matcher replays its output on
re-registration). Before a step samples, mask() fills an XGrammar token bitmask for the constrained rows
only, uploads it and sets every token the grammar does not allow to -inf in the logits (outside any CUDA
graph, after the LM head). Unconstrained rows are not touched; a step without constrained rows pays one
dict lookup. The sampler then works on the masked logits: logprobs describe the masked distribution.

Pipelining (app/worker/process.py launches step N+1 before it reads step N's tokens): the bitmask of a
constrained row at step N+1 needs its token of step N. mask() runs after step N+1's forward is queued,
and waits there for step N's read-back only when a row of step N+1 is constrained and its matcher has
not seen its step-N token (a Deferred): the device computes step N+1's forward meanwhile, and the matcher
update and bitmask fill run on the host beside it. Steps without constrained rows never wait.

A matcher that has accepted EOS is terminated: its row (a step planned before the scheduler saw the EOS,
whose token is dropped) is left unmasked. A token the matcher refuses (a NaN row's) marks the slot bad,
which fails the request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.grammar import cache_key
from app.protocol import GrammarSpec
from app.worker.transfer import to_device, upload

logger = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 64  # deserialized grammars kept by text


@dataclass(slots=True)
class Deferred:
    """Constrained rows of a launched step whose matchers still have to accept the sampled tokens.
    read() gives the step's sampled ids and bad-row flags on the host (waiting for the device)."""

    rows: list[tuple[int, int, Any]]  # (batch row, slot, matcher)
    read: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
    done: bool = False
    rejected: list[int] = field(default_factory=list)  # slots whose matcher refused their token


class GrammarRows:
    """Matchers of the constrained slots and the token mask of their rows (see the module docstring).

    make_info: builds the vocabulary's xgrammar TokenizerInfo (app.grammar.compiler.tokenizer_info), on
    first use; it must equal the tokenizer process's for serialized grammars to load.
    """

    def __init__(self, make_info: Callable[[], Any], vocab_size: int, device: torch.device, max_slots: int) -> None:
        self._make_info = make_info
        self._info: Any = None
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_slots = max_slots
        self._matchers: dict[int, Any] = {}
        self._awaiting: dict[int, Deferred] = {}
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._host_mask: torch.Tensor | None = None  # [max_slots, ceil(V / 32)] int32, filled per step
        self._xgr: Any = None

    def __contains__(self, slot: int) -> bool:
        return slot in self._matchers

    def add(self, slot: int, spec: GrammarSpec, output_ids: list[int]) -> None:
        """Register slot's matcher, advanced over the tokens it output before (a preempted sequence)."""
        if not spec.compiled:
            raise ValueError(f"slot {slot}: the grammar was not compiled (the tokenizer compiles it)")
        xgr = self._load()
        matcher = xgr.GrammarMatcher(self._deserialize(spec))
        for token in output_ids:
            if not matcher.accept_token(int(token)):
                raise ValueError(f"slot {slot}: its output token {token} does not match its grammar")
        self._matchers[slot] = matcher
        self._awaiting.pop(slot, None)

    def remove(self, slot: int) -> None:
        self._matchers.pop(slot, None)
        self._awaiting.pop(slot, None)

    def mask(self, logits: torch.Tensor, slots: list[int]) -> Deferred | None:
        """Mask the logits rows of constrained `slots` (row i is slots[i]) to what their grammars allow;
        the Deferred (None: no row constrained) must get its read() and go to expect() after sampling."""
        if not self._matchers:
            return None
        rows = [(row, slot, self._matchers[slot]) for row, slot in enumerate(slots) if slot in self._matchers]
        if not rows:
            return None
        for _, slot, _ in rows:
            waiting = self._awaiting.get(slot)
            if waiting is not None:
                self.resolve(waiting)
        live = [(row, slot, m) for row, slot, m in rows if not m.is_terminated()]
        if live:
            self._apply(logits, live)
        return Deferred(live)

    def expect(self, deferred: Deferred) -> None:
        """The matchers of deferred's rows accept their tokens when read (resolve())."""
        for _, slot, _ in deferred.rows:
            self._awaiting[slot] = deferred

    def resolve(self, deferred: Deferred) -> None:
        """Advance deferred's matchers by their step's tokens (once; waits for the step's read-back)."""
        if deferred.done:
            return
        deferred.done = True
        if not deferred.rows:
            return
        assert deferred.read is not None, "expect() a Deferred only after giving it read()"
        tokens, bad = deferred.read()
        for row, slot, matcher in deferred.rows:
            if self._awaiting.get(slot) is deferred:
                del self._awaiting[slot]
            if bad[row] or matcher.is_terminated():
                continue
            if not matcher.accept_token(int(tokens[row])):
                logger.error("slot %d: sampled token %d outside its grammar", slot, int(tokens[row]))
                deferred.rejected.append(slot)

    # ------------------------------------------------------------------ internals

    def _load(self) -> Any:
        if self._xgr is None:
            import xgrammar as xgr

            self._info = self._make_info()
            self._xgr = xgr
        return self._xgr

    def _deserialize(self, spec: GrammarSpec) -> Any:
        key = cache_key(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._xgr.CompiledGrammar.deserialize_json(spec.compiled, self._info)
            self._compiled[key] = compiled
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return compiled

    def _apply(self, logits: torch.Tensor, live: list[tuple[int, int, Any]]) -> None:
        """Fill the bitmask of `live` rows (compacted: the i-th live row uses bitmask row i), upload it
        and set the disallowed tokens of those logits rows to -inf."""
        if self._host_mask is None:
            self._host_mask = self._xgr.allocate_token_bitmask(self.max_slots, self.vocab_size)
        host = self._host_mask
        for i, (_, _, matcher) in enumerate(live):
            matcher.fill_next_token_bitmask(host, i)
        n = len(live)
        # to_device copies through fresh page-locked memory: the next fill may reuse `host` at once.
        bitmask = to_device(host[:n], self.device)
        apply_bitmask(logits, bitmask, upload([row for row, _, _ in live], torch.int64, self.device))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0 (XGrammar's layout: 32 tokens per
    int32, lowest bit first). Device work only, no host sync."""
    width = logits.shape[1]
    # Each byte of the (little-endian) words picks its 8 flags from a 256-row table: one gather.
    table = _byte_bits(bitmask.device)
    allowed = table[bitmask.contiguous().view(torch.uint8).long()].flatten(1)[:, :width]
    if allowed.shape[1] < width:  # logits wider than the bitmask: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    picked = logits.index_select(0, rows)
    logits.index_copy_(0, rows, picked.masked_fill_(~allowed, float("-inf")))


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}


def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte value, lowest first."""
    table = _BYTE_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)
        table = _BYTE_BITS[device] = ((values.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
    return table
