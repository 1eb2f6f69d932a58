"""The argmax-only backend (`--sampling-backend greedy`): no float copy, no history, no randomness.

It honours greedy requests (temperature 0; top-k / top-p / min-p / seed cannot change an argmax) and
logprobs; validate() refuses everything else (sampling, penalties, logit_bias, min_new_tokens), so
a request it cannot serve exactly is rejected with a 400 instead of being served differently.
"""

from __future__ import annotations

import numpy as np
import torch

from app.protocol import SamplingParams
from app.sampling_checks import check_greedy_params
from app.worker.sampling.logprobs import gather_logprobs
from app.worker.sampling.output import SamplerOutput, check_logits
from app.worker.sampling.reduce import argmax_and_bad_rows
from app.worker.transfer import upload


class GreedySampler:
    """Argmax of the raw logits; logprobs are log_softmax of the raw logits (nothing processes them)."""

    def __init__(self, vocab_size: int, device: torch.device, max_slots: int):
        if vocab_size < 1 or max_slots < 1:
            raise ValueError(f"vocab_size and max_slots must be >= 1, got {vocab_size} and {max_slots}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.max_slots = max_slots
        self._active = np.zeros(max_slots, dtype=bool)
        self._logprobs = np.zeros(max_slots, dtype=bool)
        self._top_logprobs = np.zeros(max_slots, dtype=np.int64)

    def validate(self, params: SamplingParams) -> str | None:
        return check_greedy_params(params, self.vocab_size)

    def add_seq(
        self, slot: int, rid: str, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        error = self.validate(params)
        if error:
            raise ValueError(f"request {rid}: {error}")
        if not 0 <= slot < self.max_slots or self._active[slot]:
            raise ValueError(f"slot {slot} is outside [0, {self.max_slots}) or already held")
        self._active[slot] = True
        self._logprobs[slot], self._top_logprobs[slot] = params.logprobs, params.top_logprobs

    def remove_seq(self, slot: int) -> None:
        self._check_active([slot])
        self._active[slot] = False

    def _check_active(self, slots: list[int]) -> np.ndarray:
        s = np.asarray(slots, dtype=np.int64)
        held = (s >= 0) & (s < self.max_slots)
        held &= self._active[np.where(held, s, 0)]
        if not held.all():
            raise KeyError(f"slot {int(s[~held][0])} holds no sequence")
        return s

    def sample(self, logits: torch.Tensor, slots: list[int]) -> SamplerOutput:
        check_logits(logits, slots, self.vocab_size)
        s = self._check_active(slots)
        tokens, bad = argmax_and_bad_rows(logits)
        rows = np.flatnonzero(self._logprobs[s])
        logprobs = None
        if len(rows):
            rows_dev = upload(rows, torch.int64, self.device)
            logprobs = gather_logprobs(logits, tokens, rows, rows_dev, self._top_logprobs[s[rows]])
        return SamplerOutput(tokens, bad, logprobs)
