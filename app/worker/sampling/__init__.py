"""Sampling in the worker: logits [B, V] -> one token per row (see torch_sampler.py for the steps).

Public: Sampler (portable torch sampler), GreedySampler, SamplerOutput, SamplerBackend, make_sampler,
and validation.check_params. Attributes load lazily so that `app.worker.sampling.validation` can
be imported without torch (the HTTP layer validates requests with it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from app.worker.sampling.factory import make_sampler
    from app.worker.sampling.greedy import GreedySampler
    from app.worker.sampling.output import SamplerBackend, SamplerOutput
    from app.worker.sampling.torch_sampler import Sampler

_EXPORTS = {
    "Sampler": "torch_sampler",
    "GreedySampler": "greedy",
    "SamplerOutput": "output",
    "SamplerBackend": "output",
    "make_sampler": "factory",
}
__all__ = ["GreedySampler", "Sampler", "SamplerBackend", "SamplerOutput", "make_sampler"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
