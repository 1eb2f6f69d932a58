"""`--sampling-backend flashinfer`: the portable sampler, drawing with flashinfer's sampling kernels.

Everything before the draw is the portable sampler's (torch_sampler.py): bad-row detection, logit
bias, the min_new_tokens mask, penalties, logprobs, and the argmax of greedy rows. The draw of an
unseeded sampled row goes to flashinfer when a kernel has the portable semantics for it:

  top_p < 1 (with or without top_k)   top_k_mask_logits, then top_p_sampling_from_probs
  min_p > 0, no top_k and no top_p    min_p_sampling_from_probs
  neither (top_k alone, or nothing)   top_k_mask_logits (if top_k), then sampling_from_probs

over softmax(logits / temperature). The semantics match (flashinfer-python 0.6.1, read from its
kernels): top-k keeps every token whose logit is >= the k-th largest (ties at the cut kept), top-p
(rejection sampling) keeps a token when the mass of the strictly more likely tokens is below top_p
(the portable nucleus, ties included) and runs over the top-k-renormalised distribution, min-p keeps
p >= min_p * p_max. Differences are float rounding at a cut-off (sums in another order). top_p = 1
rows never reach the top-p kernel, whose test (mass above < 1.0) would drop a negligible tail that
rounds to 1.0 in float32.

Left to the portable draw:
  - seeded rows: flashinfer draws each row from one Philox stream per launch, seeded per call and
    offset by the row's index in the batch, so a row's draw would depend on its batch neighbours.
    The portable draw depends only on (seed, position) (randomness.py): a seeded request gives the
    same tokens with either backend, whatever the batch and across preemption;
  - min_p together with top_k or top_p: no single kernel applies min-p after top-k / top-p.
Unseeded draws use the sampler's shared generator (flashinfer reads and advances its Philox offset),
so a run is reproducible under the process-wide seed too, as with the portable sampler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from app.worker.sampling.batch import BatchPlan, KernelRoute
from app.worker.sampling.slots import SlotTable
from app.worker.sampling.torch_sampler import Sampler

FLASHINFER_PIN = "flashinfer-python==0.6.1"
# Kernel groups (KernelRoute group ids), in the order their rows come in a plan.
TOP_P, MIN_P, PLAIN = 0, 1, 2
NUM_GROUPS = 3


def kernel_group(table: SlotTable, slots: np.ndarray) -> np.ndarray:
    """The kernel group of each unseeded sampled slot, -1 where the portable draw must serve it."""
    has_k = table.top_k[slots] < table.vocab_size
    has_p = table.top_p[slots] < 1
    has_min_p = table.min_p[slots] > 0
    group = np.full(len(slots), PLAIN, dtype=np.int64)
    group[has_min_p] = MIN_P
    group[has_p] = TOP_P
    group[has_min_p & (has_k | has_p)] = -1
    return group


FLASHINFER_ROUTE = KernelRoute(NUM_GROUPS, kernel_group)


def load_flashinfer_sampling(device: torch.device) -> Any:
    """flashinfer.sampling, its kernels built; ValueError naming --sampling-backend flashinfer if this
    machine cannot run them."""
    if device.type != "cuda":
        raise ValueError(
            f"--sampling-backend flashinfer needs a CUDA device, not {device.type}; leave "
            "--sampling-backend unset for the portable sampler"
        )
    try:
        from flashinfer import sampling
    except ImportError as exc:
        raise ValueError(
            f"--sampling-backend flashinfer needs the flashinfer-python package (pip install '{FLASHINFER_PIN}'); "
            "leave --sampling-backend unset for the portable sampler"
        ) from exc
    try:
        sampling.get_sampling_module()  # build (JIT) the kernels now, not on the first sampled request
    except Exception as exc:  # a compiler error, no nvcc, ...: any of them means no kernels
        raise ValueError(
            f"--sampling-backend flashinfer could not build flashinfer's sampling kernels ({exc}); "
            "flashinfer's JIT needs the CUDA toolkit (nvcc)"
        ) from exc
    return sampling


class FlashInferSampler(Sampler):
    """The portable Sampler whose unseeded draws run on flashinfer's kernels where they can (see the
    module docstring). kernels: the flashinfer.sampling module (load_flashinfer_sampling)."""

    route = FLASHINFER_ROUTE

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        max_slots: int,
        kernels: Any,
        seed: int | None = None,
    ):
        super().__init__(vocab_size, eos_token_ids, device, max_slots, seed=seed)
        self.kernels = kernels

    def _draw(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        k = plan.num_kernel_rows
        if k == 0:
            return super()._draw(x, plan)
        drawn = self._kernel_draw(x, plan)
        if k == len(plan.sample_rows):
            return drawn
        return torch.cat([drawn, super()._draw(x, plan)])

    def _kernel_draw(self, x: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
        """Tokens for the first plan.num_kernel_rows sample rows, group by group."""
        dev, k, fi = plan.dev, plan.num_kernel_rows, self.kernels
        rows = x.index_select(0, dev["sample_rows"][:k])  # a copy: x stays for logprobs
        if (self._table.top_k[plan.slots[plan.sample_rows[:k]]] < self.vocab_size).any():
            rows = fi.top_k_mask_logits(rows, dev["top_k"][:k].to(torch.int32))  # rows without top_k: copied
        probs = torch.softmax(rows.div_(dev["temperature"][:k].unsqueeze(1)), dim=-1)
        tokens = torch.empty(k, dtype=torch.int64, device=x.device)
        start = 0
        for group, count in enumerate(plan.kernel_groups):
            if count:
                part = slice(start, start + count)
                tokens[part] = self._sample_group(group, probs[part], dev["top_p"][part], dev["min_p"][part])
            start += count
        return tokens

    def _sample_group(
        self, group: int, probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
    ) -> torch.Tensor:
        fi, gen = self.kernels, self._shared
        if group == TOP_P:
            return fi.top_p_sampling_from_probs(probs, top_p, generator=gen)
        if group == MIN_P:
            return fi.min_p_sampling_from_probs(probs, min_p, generator=gen)
        return fi.sampling_from_probs(probs, generator=gen)
