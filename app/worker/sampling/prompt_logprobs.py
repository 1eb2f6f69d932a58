"""Prompt logprobs: for a sequence that asks (SamplingParams.prompt_logprob_start), the logprob of each
prompt token given the tokens before it, with the top alternatives, computed from the prefill's own
hidden states (no second forward).

Definition: log_softmax of the model's raw logits, in float32, before temperature (as the sampled
tokens' logprobs, sampling/logprobs.py; penalties and logit_bias concern generated tokens and do not
apply to the prompt, as in vLLM). Position p predicts prompt token p + 1, so a chunk's last position
predicts the next chunk's first token: the worker keeps the prompt ids of the slots that ask and
reads the target from them, whatever the chunking. Only the rows that ask pay the LM head; decode
steps (and their CUDA graphs) never have such rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from app.protocol import NewSeq, TokenLogprobs
from app.worker.sampling.logprobs import DeviceLogprobs
from app.worker.transfer import upload

# Rows per LM-head pass: bounds the float32 [rows, vocab] logits of a long prefill (256 x 152k: 0.16 GB,
# a few such tensors at once, within the runner's reserve beyond the profiled peak).
ROWS_PER_PASS = 256


@dataclass(slots=True)
class PromptWant:
    """What a slot asks: the logprobs of prompt tokens first .. num_prompt - 1, top alternatives each."""

    prompt_ids: list[int]
    first: int
    top: int

    @classmethod
    def of(cls, seq: NewSeq) -> PromptWant:
        prompt = list(seq.prompt_ids[: seq.num_prompt_tokens])
        return cls(prompt, max(seq.sampling.prompt_logprob_start, 1), seq.sampling.top_logprobs)


@dataclass
class PromptRows:
    """The rows of one step's flat batch whose prompt logprobs are asked, with their target tokens."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    tops: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # per slot with rows, in row order
    counts: list[int] = field(default_factory=list)

    def add(self, want: PromptWant, slot: int, row: int, start: int, length: int) -> None:
        """A chunk of `length` tokens at positions start.. in rows row..: keep the positions that predict
        a wanted prompt token (first - 1 .. len(prompt) - 2)."""
        lo = max(start, want.first - 1)
        hi = min(start + length, len(want.prompt_ids) - 1)
        if hi <= lo:
            return
        self.rows += range(row + lo - start, row + hi - start)
        self.targets += want.prompt_ids[lo + 1 : hi + 1]
        self.tops += [want.top] * (hi - lo)
        self.slots.append(slot)
        self.counts.append(hi - lo)

    def compute(
        self,
        hidden: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device,
        leader: bool,
    ) -> PromptLogprobs | None:
        """Queue the LM head and log_softmax over the rows (every TP rank: the LM head gathers across
        ranks), then the copy of the leader's results to the host; None when no row asks (or off the leader)."""
        if not self.rows:
            return None
        rows = upload(self.rows, torch.int64, device)
        targets = upload(self.targets, torch.int64, device)
        parts: list[DeviceLogprobs] = []
        for lo in range(0, len(self.rows), ROWS_PER_PASS):
            hi = min(lo + ROWS_PER_PASS, len(self.rows))
            logits = compute_logits(hidden.index_select(0, rows[lo:hi]))
            if leader:
                parts.append(_pack(logits, targets[lo:hi], np.asarray(self.tops[lo:hi], dtype=np.int64)))
        if not leader:
            return None
        return PromptLogprobs(list(self.slots), list(self.counts), parts)


def _pack(logits: torch.Tensor, targets: torch.Tensor, tops: np.ndarray) -> DeviceLogprobs:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    parts = [targets.to(torch.float64), logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).to(torch.float64)]
    widest = int(tops.max())
    if widest:
        top_values, top_ids = logprobs.topk(widest, dim=-1)
        parts += [top_ids.to(torch.float64).flatten(), top_values.to(torch.float64).flatten()]
    return DeviceLogprobs(np.arange(len(tops), dtype=np.int64), tops, torch.cat(parts))


class PromptLogprobs:
    """One step's prompt logprobs, being copied to the host (on CUDA, without waiting for the device)."""

    def __init__(self, slots: list[int], counts: list[int], parts: list[DeviceLogprobs]) -> None:
        self.slots = slots
        self.counts = counts
        self.parts = parts
        self.copied: torch.cuda.Event | None = None
        self.host = [part.packed for part in parts]
        if parts and parts[0].packed.is_cuda:
            self.host = [torch.empty(p.packed.shape, dtype=p.packed.dtype, pin_memory=True) for p in parts]
            for host, part in zip(self.host, parts, strict=True):
                host.copy_(part.packed, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> tuple[list[int], list[list[TokenLogprobs]]]:
        """(slots, each slot's logprobs in prompt order), waiting for the copy if need be."""
        if self.copied is not None:
            self.copied.synchronize()
        flat: list[TokenLogprobs] = []
        for host, part in zip(self.host, self.parts, strict=True):
            flat += [lp for lp in part.unpack(host.numpy(), len(part.rows)) if lp is not None]
        out: list[list[TokenLogprobs]] = []
        at = 0
        for count in self.counts:
            out.append(flat[at : at + count])
            at += count
        return list(self.slots), out
