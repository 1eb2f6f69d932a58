"""Per-slot sampling state: parameters in host arrays, token history in device tensors.

Host side, numpy arrays indexed by slot hold every parameter and flag, so a step groups its rows
with vectorised numpy instead of per-row Python. Device side, two [max_slots, V] tensors hold the
history the penalties need:
  counts      int32, how often each token was output (presence / frequency / repetition);
  prompt_seen bool,  which tokens the prompt holds (repetition penalty).
That is 5 * max_slots * V bytes (256 slots x 151,936 tokens: 194 MB), allocated once. Rows are
written only for sequences that use penalties; other rows are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from app.protocol import SamplingParams
from app.worker.sampling.randomness import position_seed
from app.worker.transfer import upload


@dataclass(slots=True)
class SlotExtras:
    """The variable-length part of a slot's state."""

    rid: str
    seed: int | None
    bias_ids: np.ndarray  # int64 token ids of logit_bias
    bias_values: np.ndarray  # float32
    blocked_ids: np.ndarray  # int64: EOS and stop ids, masked while output < min_new_tokens


class SlotTable:
    """Parameters and history of every registered sequence, by slot."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device, max_slots: int):
        self.vocab_size = vocab_size
        self.device = device
        self.max_slots = max_slots
        self.eos_ids = np.asarray(sorted(set(eos_token_ids)), dtype=np.int64)
        zeros = np.zeros(max_slots)
        self.active = zeros.astype(bool)
        self.greedy = zeros.astype(bool)
        self.seeded = zeros.astype(bool)
        self.penalised = zeros.astype(bool)
        self.has_bias = zeros.astype(bool)
        self.logprobs = zeros.astype(bool)
        self.top_logprobs = zeros.astype(np.int64)
        self.temperature = zeros.astype(np.float32)
        self.top_k = zeros.astype(np.int64)
        self.top_p = zeros.astype(np.float32)
        self.min_p = zeros.astype(np.float32)
        self.repetition = zeros.astype(np.float32)
        self.presence = zeros.astype(np.float32)
        self.frequency = zeros.astype(np.float32)
        self.min_new_tokens = zeros.astype(np.int64)
        self.num_output = zeros.astype(np.int64)
        self.extras: list[SlotExtras | None] = [None] * max_slots
        self.counts = torch.zeros((max_slots, vocab_size), dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros((max_slots, vocab_size), dtype=torch.bool, device=device)

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the history tensors hold."""
        return self.counts.nbytes + self.prompt_seen.nbytes

    def add(
        self, slot: int, rid: str, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is outside [0, {self.max_slots})")
        if self.active[slot]:
            raise ValueError(f"slot {slot} is already held by request {self.extras[slot].rid}")
        self.active[slot] = True
        self.greedy[slot] = p.greedy
        self.temperature[slot] = 1.0 if p.greedy else p.temperature
        self.top_k[slot] = self.vocab_size if p.top_k == -1 else min(p.top_k, self.vocab_size)
        self.top_p[slot], self.min_p[slot] = p.top_p, p.min_p
        self.repetition[slot] = p.repetition_penalty
        self.presence[slot], self.frequency[slot] = p.presence_penalty, p.frequency_penalty
        self.penalised[slot] = (
            p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
        )
        self.has_bias[slot] = bool(p.logit_bias)
        self.logprobs[slot], self.top_logprobs[slot] = p.logprobs, p.top_logprobs
        self.min_new_tokens[slot], self.num_output[slot] = p.min_new_tokens, len(output_ids)
        self.seeded[slot] = p.seed is not None
        self.extras[slot] = self._extras(rid, p)
        if self.penalised[slot]:
            self._write_history(slot, prompt_ids, output_ids)

    def _extras(self, rid: str, p: SamplingParams) -> SlotExtras:
        blocked = np.union1d(self.eos_ids, np.asarray(p.stop_token_ids, dtype=np.int64))
        return SlotExtras(
            rid=rid,
            seed=p.seed,
            bias_ids=np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
            bias_values=np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)),
            blocked_ids=blocked.astype(np.int64),
        )

    def _write_history(self, slot: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        for name, ids in (("prompt_ids", prompt_ids), ("output_ids", output_ids)):
            if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
                raise ValueError(f"{name} of slot {slot} hold a token id outside [0, {self.vocab_size})")
        prompt = upload(prompt_ids, torch.int64, self.device)
        output = upload(output_ids, torch.int64, self.device)
        # index_fill_, not `[slot, prompt] = True`: that assignment copies the scalar over, a device sync
        # (a GPU test caught it when a prefill's launch was checked under sync debug mode).
        self.prompt_seen[slot].zero_().index_fill_(0, prompt, True)
        # index_add_, not bincount: bincount sizes its output from the max id, a device sync.
        ones = torch.ones_like(output, dtype=torch.int32)
        self.counts[slot].zero_().index_add_(0, output, ones)

    def remove(self, slot: int) -> None:
        self.check_active([slot])
        self.active[slot] = False
        self.extras[slot] = None

    def check_active(self, slots: list[int] | np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        in_range = (slots >= 0) & (slots < self.max_slots)
        held = in_range & self.active[np.where(in_range, slots, 0)]
        if not held.all():
            raise KeyError(f"slot {int(slots[~held][0])} holds no sequence")

    def position_seeds(self, slots: np.ndarray) -> list[int]:
        """The generator seed of the next output position of each (seeded) slot in `slots`."""
        extras = self.extras
        return [
            position_seed(extras[slot].seed, position)
            for slot, position in zip(slots.tolist(), self.num_output[slots].tolist(), strict=True)
        ]

    def record(
        self, slots: np.ndarray, penalised_slots: torch.Tensor, penalised_tokens: torch.Tensor
    ) -> None:
        """Count one more output token for each of `slots`; the token ids matter to penalised ones."""
        np.add.at(self.num_output, slots, 1)
        if penalised_slots.numel():
            ones = torch.ones_like(penalised_tokens, dtype=torch.int32)
            flat = penalised_slots * self.vocab_size + penalised_tokens  # index_add_: see add_logit_bias
            self.counts.view(-1).index_add_(0, flat, ones)
