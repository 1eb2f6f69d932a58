"""Sampling in the worker: logits [B, V] -> one token per row.

Public: Sampler (the portable torch sampler; torch_sampler.py lists the steps), GreedySampler
(`--sampling-backend greedy`), FlashInferSampler (`--sampling-backend flashinfer`: the portable
sampler drawing with flashinfer's kernels, flashinfer_sampler.py), SamplerOutput, SamplerBackend
(the interface they implement) and make_sampler. Logprobs are log_softmax of the logits after bias
and penalties, before temperature and truncation (logprobs.py). app.sampling_checks answers what a sampler's validate() would, without torch (the
tokenizer checks requests with it); attributes here load lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.worker.sampling.factory import make_sampler
    from app.worker.sampling.flashinfer_sampler import FlashInferSampler
    from app.worker.sampling.greedy import GreedySampler
    from app.worker.sampling.output import SamplerBackend, SamplerOutput
    from app.worker.sampling.torch_sampler import Sampler

_EXPORTS = {
    "Sampler": "torch_sampler",
    "GreedySampler": "greedy",
    "FlashInferSampler": "flashinfer_sampler",
    "SamplerOutput": "output",
    "SamplerBackend": "output",
    "make_sampler": "factory",
}
__all__ = ["FlashInferSampler", "GreedySampler", "Sampler", "SamplerBackend", "SamplerOutput", "make_sampler"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
