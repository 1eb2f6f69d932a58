"""What a sampling step returns, and the interface every sampling backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from app.protocol import SamplingParams, TokenLogprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64 on the sampler's device
    logprobs: list[TokenLogprobs | None]  # per row; None where not requested (or the row is bad)
    bad_rows: list[int]  # rows whose logits held NaN/+inf (or were all -inf): their token is meaningless


class SamplerBackend(Protocol):
    """A sampler, as the model runner uses it (see Sampler for the semantics)."""

    def validate(self, params: SamplingParams) -> str | None: ...

    def add_seq(
        self, slot: int, rid: str, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None: ...

    def remove_seq(self, slot: int) -> None: ...

    def sample(self, logits: torch.Tensor, slots: list[int]) -> SamplerOutput: ...


def check_logits(logits: torch.Tensor, slots: list[int], vocab_size: int) -> None:
    """Reject logits that cannot be rows of `slots` over the vocabulary."""
    if logits.dim() != 2 or logits.shape[0] != len(slots) or logits.shape[1] != vocab_size:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match {len(slots)} slots x vocab {vocab_size}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
