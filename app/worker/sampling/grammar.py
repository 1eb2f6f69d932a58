"""Structured output in the worker: a grammar matcher per constrained slot, and the mask of its rows.

A constrained sequence arrives with its grammar compiled and serialized (GrammarSpec.compiled, from the
tokenizer process); it is deserialized once per grammar text (a small LRU here) and a GrammarMatcher per
slot follows the tokens the sequence outputs (a preempted sequence's matcher replays its output on
re-registration). Before a step samples, mask() fills an XGrammar token bitmask for the constrained rows
only, uploads it and sets every token the grammar does not allow to -inf in the logits (outside any CUDA
graph, after the LM head, one kernel of tokenspeed_kernels.grammar_mask; on the CPU XGrammar's native
apply does it in place). Unconstrained rows are not touched; a step without constrained rows pays one dict
lookup. The sampler then works on the masked logits: logprobs describe the masked distribution.

Pipelining (app/worker/process.py launches step N+1 before it reads step N's tokens): the bitmask of a
constrained row at step N+1 needs its token of step N. mask() runs after step N+1's forward is queued,
and waits there for step N's read-back only when a row of step N+1 is constrained and its matcher has
not seen its step-N token (a Deferred): the device computes step N+1's forward meanwhile, and the matcher
update and bitmask fill run on the host beside it. Steps without constrained rows never wait.

A matcher that has accepted EOS is terminated: its row (a step planned before the scheduler saw the EOS,
whose token is dropped) is left unmasked. A token the matcher refuses (a NaN row's) marks the slot bad,
which fails the request.

Host cost per row (20-field JSON schema, 128k vocabulary): the fill dominates (0.4 to 0.9 ms on a
loaded 2-core CPU; the H200 host's 7.4 ms more per step at 64 rows, one thread, implies about 0.1 ms),
the accept takes a few microseconds. So the rows of a step are
filled by XGrammar's BatchGrammarMatcher on `threads` native threads (GIL released) once a step has
FILL_BATCH_MIN rows; fewer rows loop in Python (the pool's hand-off costs more than it saves). On CUDA
the fill writes into one of two page-locked buffers, copied with one non-blocking copy; a buffer is
reused only after its previous copy has run (an event). `host_s` and `wait_s` add up the host time of
mask() and its wait for the step-N tokens (scripts/gpu/bench_grammar.py reports them per step).
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.grammar import cache_key
from app.protocol import GrammarSpec
from app.worker.layers.fused import kernel_module
from app.worker.transfer import upload

logger = logging.getLogger(__name__)

COMPILED_CACHE_SIZE = 64  # deserialized grammars kept by text
FILL_BATCH_MIN = 4  # rows from which the bitmask fill goes to XGrammar's thread pool


def fill_threads() -> int:
    """Threads for the bitmask fill: half the cores this process may use (the other half keep the
    worker's launch loop and the other processes going), at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0)) // 2))


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

    def __init__(self, make_info: Callable[[], Any], vocab_size: int, device: torch.device, max_slots: int,
                 threads: int | None = None) -> None:
        self._make_info = make_info
        self._info: Any = None
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_slots = max_slots
        self._matchers: dict[int, Any] = {}
        self._awaiting: dict[int, Deferred] = {}
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.threads = threads if threads is not None else fill_threads()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher (threads > 1)
        # [max_slots, ceil(V / 32)] int32 filled per step; on CUDA two page-locked ones used in turn,
        # each with the event of its last copy to the device.
        self._host_masks: list[torch.Tensor] = []
        self._copied: list[Any] = []
        self._turn = 0
        self._xgr: Any = None
        self.host_s = 0.0  # seconds of host work in mask() (matcher updates, fill, copy and apply launch)
        self.wait_s = 0.0  # seconds mask() waited for a step's sampled tokens

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
        started, counted = time.perf_counter(), self.host_s + self.wait_s
        for _, slot, _ in rows:
            waiting = self._awaiting.get(slot)
            if waiting is not None:
                self.resolve(waiting)
        live = [(row, slot, m) for row, slot, m in rows if not m.is_terminated()]
        if live:
            self._apply(logits, live)
        # resolve() above counted its own time: add the rest
        self.host_s += time.perf_counter() - started - (self.host_s + self.wait_s - counted)
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
        started = time.perf_counter()
        tokens, bad = deferred.read()
        waited = time.perf_counter() - started
        self.wait_s += waited
        for row, slot, matcher in deferred.rows:
            if self._awaiting.get(slot) is deferred:
                del self._awaiting[slot]
            if bad[row] or matcher.is_terminated():
                continue
            if not matcher.accept_token(int(tokens[row])):
                logger.error("slot %d: sampled token %d outside its grammar", slot, int(tokens[row]))
                deferred.rejected.append(slot)
        self.host_s += time.perf_counter() - started - waited

    # ------------------------------------------------------------------ internals

    def _load(self) -> Any:
        if self._xgr is None:
            import xgrammar as xgr

            self._info = self._make_info()
            if self.threads > 1:
                self._batch = xgr.BatchGrammarMatcher(max_threads=self.threads)
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
        """Fill the bitmask of `live` rows, send it to the device and set the disallowed tokens of those
        logits rows to -inf."""
        host = self._next_host_mask()
        matchers = [m for _, _, m in live]
        rows = [row for row, _, _ in live]
        on_cpu = self.device.type != "cuda"
        # On CUDA the bitmask is compacted (the i-th live row uses bitmask row i: the least to copy); on
        # the CPU it is filled at the logits rows, where XGrammar's native apply reads it.
        at = rows if on_cpu else list(range(len(live)))
        if self._batch is not None and len(matchers) >= FILL_BATCH_MIN:
            self._batch.batch_fill_next_token_bitmask(matchers, host, at)
        else:
            for i, matcher in zip(at, matchers, strict=True):
                matcher.fill_next_token_bitmask(host, i)
        if on_cpu:
            width = min(logits.shape[1], self.vocab_size)
            self._xgr.apply_token_bitmask_inplace(logits, host[: logits.shape[0]], vocab_size=width, indices=rows)
            if logits.shape[1] > width:  # ids past the vocabulary are never allowed
                logits[rows, width:] = float("-inf")
            return
        bitmask = host[: len(live)].to(self.device, non_blocking=True)
        self._copied[self._turn].record()
        kernel_module("grammar_mask").apply_bitmask(logits, bitmask, upload(rows, torch.int32, self.device))

    def _next_host_mask(self) -> torch.Tensor:
        """The host bitmask to fill now: on CUDA the page-locked buffer whose last copy ran longest ago
        (waited for, which in the pipelined loop has long happened)."""
        if not self._host_masks:
            count = 2 if self.device.type == "cuda" else 1
            for _ in range(count):
                mask = self._xgr.allocate_token_bitmask(self.max_slots, self.vocab_size)
                self._host_masks.append(mask.pin_memory() if self.device.type == "cuda" else mask)
                self._copied.append(torch.cuda.Event() if self.device.type == "cuda" else None)
        self._turn = (self._turn + 1) % len(self._host_masks)
        event = self._copied[self._turn]
        if event is not None:
            event.synchronize()  # an event never recorded returns at once
        return self._host_masks[self._turn]
