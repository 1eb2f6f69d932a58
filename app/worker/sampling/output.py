"""What a sampling step returns, and the interface every sampling backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from app.protocol import SamplingParams, TokenLogprobs
from app.worker.sampling.logprobs import DeviceLogprobs


@dataclass(slots=True)
class SamplerOutput:
    """A sampling step as device work: building it never waits for the device (the model runner
    copies what it needs to the host without blocking and reads it a step later). The properties
    bad_rows and logprobs read the device on access: a sync, for tests and one-off callers."""

    token_ids: torch.Tensor  # [B] int64 on the sampler's device
    bad: torch.Tensor  # [B] bool on the device: NaN/+inf (or all -inf) logits, a meaningless token
    device_logprobs: DeviceLogprobs | None = None  # the rows that asked for logprobs (None: no row did)

    @property
    def bad_rows(self) -> list[int]:
        return self.bad.nonzero().flatten().tolist()

    @property
    def logprobs(self) -> list[TokenLogprobs | None]:
        """Per row; None where not requested (or the row is bad)."""
        batch_size = self.token_ids.shape[0]
        if self.device_logprobs is None:
            return [None] * batch_size
        host = self.device_logprobs.packed.cpu().numpy()
        return self.device_logprobs.unpack(host, batch_size, self.bad_rows)


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
