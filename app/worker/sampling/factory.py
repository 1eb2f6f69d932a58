"""make_sampler: the sampler a `--sampling-backend` value names."""

from __future__ import annotations

import torch

from app.sampling_checks import unknown_backend
from app.worker.sampling.greedy import GreedySampler
from app.worker.sampling.output import SamplerBackend
from app.worker.sampling.torch_sampler import Sampler


def make_sampler(
    backend: str | None,
    vocab_size: int,
    eos_token_ids: list[int],
    device: torch.device,
    max_slots: int,
    seed: int | None = None,
) -> SamplerBackend:
    """None: the portable torch sampler (seed: the process-wide seed, see Sampler); "greedy": argmax
    only; "flashinfer": the portable sampler drawing with flashinfer's kernels (CUDA; ValueError
    naming --sampling-backend flashinfer where it cannot run)."""
    if backend is None:
        return Sampler(vocab_size, eos_token_ids, device, max_slots, seed=seed)
    if backend == "greedy":
        return GreedySampler(vocab_size, device, max_slots)
    if backend == "flashinfer":
        from app.worker.sampling.flashinfer_sampler import FlashInferSampler, load_flashinfer_sampling

        kernels = load_flashinfer_sampling(torch.device(device))
        return FlashInferSampler(vocab_size, eos_token_ids, device, max_slots, kernels, seed=seed)
    raise ValueError(unknown_backend(backend))
