"""Validation of a StepPlan against the worker's state, before anything changes.

A plan fault (unknown slot, block ids outside the pool, a context beyond its blocks) raises PlanError:
the scheduler erred, the step fails and leaves no trace. What concerns one sequence only (sampling
parameters its sampler cannot honour, token ids outside the vocabulary, an uncompiled grammar) refuses
that sequence alone: validate() returns it with the reason, and the runner leaves it out of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.slot_state import SlotState


class PlanError(ValueError):
    """The plan does not fit the worker's state (unknown slot, token outside the vocabulary, ...)."""


@dataclass
class PlanChecks:
    """The limits a plan is checked against; `slots` is the runner's live slot state."""

    slots: SlotState
    num_blocks: int  # the scheduler's pool (the scratch block beyond it is the worker's own)
    block_size: int
    max_model_len: int
    vocab_size: int
    sampling_error: Callable[[SamplingParams], str | None]  # the sampler's refusal, or None

    def validate(self, plan: StepPlan, refused: set[int]) -> dict[int, str]:
        """Refuse a plan that does not fit (PlanError: a scheduler fault, the step fails) before any state
        changes; returns the sequences refused alone (slot -> why: the request's own fault). Chunks of
        `refused` slots (refused earlier, not yet freed) are not checked: the runner skips them."""
        new = {seq.slot: seq for seq in plan.new_seqs}
        if len(new) != len(plan.new_seqs):
            raise PlanError(f"step {plan.step}: a slot is registered twice")
        failed: dict[int, str] = {}
        for seq in plan.new_seqs:
            error = self._check_new_seq(seq)
            if error:
                failed[seq.slot] = error
        seen: set[int] = set()
        for chunk in plan.chunks:
            if chunk.slot in seen:
                raise PlanError(f"step {plan.step}: slot {chunk.slot} has two chunks")
            seen.add(chunk.slot)
            if chunk.slot in failed or chunk.slot in refused:
                continue
            error = self._check_chunk(chunk, new.get(chunk.slot))
            if error:
                failed[chunk.slot] = error
        for slot in plan.free_slots:
            self._check_slot(slot)
        return failed

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.slots.max_slots:
            raise PlanError(f"slot {slot!r} is outside [0, {self.slots.max_slots})")

    def _check_blocks(self, slot: int, ids: list[int], total: int) -> None:
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < self.num_blocks]
        if bad:
            raise PlanError(f"slot {slot}: block ids {bad[:8]} are outside [0, {self.num_blocks})")
        if total > self.slots.max_blocks:
            raise PlanError(
                f"slot {slot}: {total} blocks exceed max_model_len {self.max_model_len} "
                f"({self.slots.max_blocks} blocks of {self.block_size})"
            )

    def _check_new_seq(self, seq: NewSeq) -> str | None:
        """PlanError for a plan fault; the reason the sequence alone is refused, or None."""
        self._check_slot(seq.slot)
        if self.slots.active[seq.slot]:
            raise PlanError(f"slot {seq.slot} is already in use (rid {seq.rid}); free it first")
        self._check_blocks(seq.slot, seq.block_ids, len(seq.block_ids))
        if not 0 <= seq.num_cached_tokens <= len(seq.block_ids) * self.block_size:
            raise PlanError(
                f"slot {seq.slot}: num_cached_tokens {seq.num_cached_tokens} is not covered by "
                f"{len(seq.block_ids)} blocks"
            )
        if seq.sampling.grammar is not None and not seq.sampling.grammar.compiled:
            return "its grammar was not compiled (the tokenizer process compiles grammars)"
        return self.sampling_error(seq.sampling) or self._check_ids(seq.prompt_ids) or self._check_ids(seq.output_ids)

    def _check_ids(self, token_ids: list[int]) -> str | None:
        """Why these ids cannot be tokens of this model (penalties index by them), or None."""
        if not token_ids:
            return None
        ids = np.asarray(token_ids)  # a non-integer or huge id gives a non-integer dtype
        if ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            return f"a prompt token id is outside the vocabulary [0, {self.vocab_size})"
        return None

    def _check_chunk(self, chunk: SeqChunk, new: NewSeq | None) -> str | None:
        """PlanError for a plan fault; the reason the chunk's sequence alone is refused, or None."""
        self._check_slot(chunk.slot)
        s = self.slots
        if new is None and not s.active[chunk.slot]:
            raise PlanError(f"chunk for slot {chunk.slot}, which holds no sequence")
        blocks = (len(new.block_ids) if new else s.num_blocks[chunk.slot]) + len(chunk.append_block_ids)
        self._check_blocks(chunk.slot, chunk.append_block_ids, blocks)
        error = None
        if chunk.token_ids:
            error = self._check_ids(chunk.token_ids)
        elif new is not None or not s.has_token[chunk.slot]:
            raise PlanError(f"decode chunk for slot {chunk.slot}, which has no sampled token to feed")
        elif not chunk.sample:
            raise PlanError(f"decode chunk for slot {chunk.slot} must sample")
        start = new.num_cached_tokens if new else s.seq_len[chunk.slot]
        end = start + max(len(chunk.token_ids), 1)
        if end > blocks * self.block_size:
            raise PlanError(
                f"slot {chunk.slot}: context of {end} tokens exceeds its {blocks} blocks of {self.block_size}"
            )
        if end > self.max_model_len:
            raise PlanError(
                f"slot {chunk.slot}: context of {end} tokens exceeds max_model_len {self.max_model_len}"
            )
        return error
