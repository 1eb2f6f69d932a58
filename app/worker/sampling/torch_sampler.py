"""The portable sampler: every SamplingParams feature, vectorised torch ops on any device.

A step, on [B, V] logits whose row i belongs to slots[i] (in the model dtype; processed in float32):
  1. rows holding NaN / +inf (or all -inf) are reported in bad_rows and zeroed;
  2. logit_bias is added to the raw logits;
  3. while a sequence has output fewer than min_new_tokens tokens, EOS and its stop_token_ids are -inf;
  4. repetition_penalty (HF) over prompt and output tokens, then presence / frequency penalties
     (OpenAI) over output tokens. These are the "processed logits" that logprobs describe;
  5. greedy rows (temperature <= 1e-6) take the argmax; the others are divided by their temperature,
     truncated by top-k, top-p and min-p (truncation.py) and sampled by the exponential race
     (randomness.py: a per-position seed for seeded requests, one shared generator otherwise).
Every stage runs only over the rows that need it (a batch of greedy rows that nothing processes takes
the argmax of the logits as they come, without the float32 copy); top-k / top-p run only when a
sampled row uses one of them, over a partial sort (topk) where that is exact. The sampled tokens are recorded in the
slots' history before returning. A subclass may draw some unseeded rows with kernels of its own
(class attribute `route`, see batch.KernelRoute; FlashInferSampler): everything else stays here.
Nothing here waits for the device (the worker launches the next step before it reads this one's
tokens): row groups and parameters are planned on the host and uploaded without a sync, bad rows
and logprobs come back as device tensors (SamplerOutput). One exception: a sampled row with top_p
but no top_k makes the partial sort check that its nucleus fits (truncation.py), one device sync in
such steps.
Device memory: the history tensors of SlotTable (5 * max_slots * V bytes), plus per step a few
float32 [B, V] temporaries (3 when sorting; a full sort adds its int64 indices).
"""

from __future__ import annotations

import torch

from app.protocol import SamplingParams
from app.sampling_checks import check_params
from app.worker.sampling.batch import BatchPlan, KernelRoute, plan_batch
from app.worker.sampling.logprobs import gather_logprobs
from app.worker.sampling.output import SamplerOutput, check_logits
from app.worker.sampling.processors import (
    add_logit_bias,
    apply_presence_frequency,
    apply_repetition_penalty,
    find_bad_rows,
    mask_tokens,
)
from app.worker.sampling.randomness import gumbel_noise
from app.worker.sampling.reduce import argmax_and_bad_rows, argmax_rows
from app.worker.sampling.slots import SlotTable
from app.worker.sampling.truncation import apply_min_p, apply_top_k_top_p


class Sampler:
    """Samples one token per row for the sequences registered in its slots (see the module docstring).

    seed: the process-wide seed for requests without one (None: torch.initial_seed()).
    """

    route: KernelRoute | None = None  # the rows a subclass draws with its own kernels (none here)

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        max_slots: int,
        seed: int | None = None,
    ):
        if vocab_size < 1 or max_slots < 1:
            raise ValueError(f"vocab_size and max_slots must be >= 1, got {vocab_size} and {max_slots}")
        if any(not 0 <= token < vocab_size for token in eos_token_ids):
            raise ValueError(f"eos_token_ids {eos_token_ids} hold an id outside [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._table = SlotTable(vocab_size, eos_token_ids, self.device, max_slots)
        self._shared = torch.Generator(device=self.device)
        self._shared.manual_seed(torch.initial_seed() if seed is None else seed)
        self._seeded = torch.Generator(device=self.device)  # re-seeded before each seeded row's draw

    @property
    def state_bytes(self) -> int:
        """Device memory held between steps (the per-slot token history)."""
        return self._table.device_bytes

    def validate(self, params: SamplingParams) -> str | None:
        return check_params(params, self.vocab_size)

    def add_seq(
        self, slot: int, rid: str, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        """Register a sequence; output_ids (generated before a preemption) count as its output."""
        error = self.validate(params)
        if error:
            raise ValueError(f"request {rid}: {error}")
        self._table.add(slot, rid, params, prompt_ids, output_ids)

    def remove_seq(self, slot: int) -> None:
        self._table.remove(slot)

    def process_logits(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """The processed float32 logits (steps 1-4) that sample() would draw from; records nothing."""
        check_logits(logits, slots, self.vocab_size)
        return self._process(logits, plan_batch(self._table, slots))[0]

    def sample(self, logits: torch.Tensor, slots: list[int]) -> SamplerOutput:
        check_logits(logits, slots, self.vocab_size)
        if not slots:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return SamplerOutput(empty, empty.bool())
        plan = plan_batch(self._table, slots, self.route)
        if plan.plain_greedy:  # no float32 copy nor zeroing of bad rows (their token is discarded with them):
            # ~0.4 ms of a ~23 ms decode step at 512 rows of Llama-3's vocabulary on the H200
            tokens, bad = argmax_and_bad_rows(logits)
            self._table.record(plan.slots, plan.dev["penalised_slots"], tokens[:0])  # none is penalised
            return SamplerOutput(tokens, bad)
        processed, bad = self._process(logits, plan)
        tokens = self._choose(processed, plan)
        penalised = plan.dev["penalised_rows"]
        self._table.record(plan.slots, plan.dev["penalised_slots"], tokens.index_select(0, penalised))
        top_counts = self._table.top_logprobs[plan.slots[plan.logprob_rows]]
        logprobs = gather_logprobs(processed, tokens, plan.logprob_rows, plan.dev["logprob_rows"], top_counts)
        return SamplerOutput(tokens, bad, logprobs)

    def _process(self, logits: torch.Tensor, plan: BatchPlan) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)  # add_logit_bias: flat
        bad = find_bad_rows(x)
        x.masked_fill_(bad.unsqueeze(1), 0.0)
        dev = plan.dev
        if dev["bias_rows"].numel():
            add_logit_bias(x, dev["bias_rows"], dev["bias_ids"], dev["bias_values"])
        if dev["block_rows"].numel():
            mask_tokens(x, dev["block_rows"], dev["block_ids"])
        if len(plan.penalised_rows):
            x = self._penalise(x, plan)
        return x, bad

    def _penalise(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        dev = plan.dev
        every_row = plan.covers_all(plan.penalised_rows)
        rows = x if every_row else x.index_select(0, dev["penalised_rows"])
        counts = self._table.counts.index_select(0, dev["penalised_slots"])
        seen = self._table.prompt_seen.index_select(0, dev["penalised_slots"]) | (counts > 0)
        rows = apply_repetition_penalty(rows, seen, dev["repetition"])
        rows = apply_presence_frequency(rows, counts, dev["presence"], dev["frequency"])
        if every_row:
            return rows
        return x.index_copy_(0, dev["penalised_rows"], rows)

    def _choose(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        """[B] int64 tokens: argmax for greedy rows, a draw for the others."""
        if not len(plan.sample_rows):
            return argmax_rows(x)
        dev = plan.dev
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        if len(plan.greedy_rows):
            greedy = argmax_rows(x.index_select(0, dev["greedy_rows"]))
            tokens.index_copy_(0, dev["greedy_rows"], greedy)
        return tokens.index_copy_(0, dev["sample_rows"], self._draw(x, plan))

    def _draw(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        """Tokens for plan.sample_rows[plan.num_kernel_rows:] (all of them here), in that order."""
        dev, k = plan.dev, plan.num_kernel_rows
        if k == 0 and plan.covers_all(plan.sample_rows):
            rows = x
        else:
            rows = x.index_select(0, dev["sample_rows"][k:])
        rows = rows / dev["temperature"][k:].unsqueeze(1)  # a new tensor: x stays for logprobs
        if plan.truncates:
            rows = apply_top_k_top_p(
                rows, dev["top_k"][k:], dev["top_p"][k:], plan.sort_width, plan.verify_nucleus
            )
        if plan.need_min_p:
            rows = apply_min_p(rows, dev["min_p"][k:])
        seeded_slots = plan.slots[plan.sample_rows[plan.num_unseeded :]]
        seeds = self._table.position_seeds(seeded_slots)
        noise = gumbel_noise(self.vocab_size, plan.num_unseeded - k, self._shared, self._seeded, seeds)
        return argmax_rows(rows + noise)
