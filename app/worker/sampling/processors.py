"""Logit processing before temperature: bad-row detection, logit bias, token masking, penalties.

Every function works on float32 [n, V] rows; the per-row parameters are [n] device tensors. A row
whose parameters mean "off" (penalty 1 or 0) comes out bit-identical, so mixed batches can be
processed with one vectorised call.
"""

from __future__ import annotations

import torch

from app.worker.sampling.reduce import max_rows


def find_bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows holding NaN or +inf, or with every entry -inf (nothing can be sampled).

    One max-reduction covers all three cases: max propagates NaN.
    """
    return ~torch.isfinite(max_rows(logits))


def add_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor
) -> None:
    """logits[rows[i], tokens[i]] += bias[i], in place (pairs flattened over the batch; logits contiguous).

    index_add_ over the flat view, not index_put_(accumulate=True): some torch releases check the
    indices of the latter on the host, a device sync."""
    logits.view(-1).index_add_(0, rows * logits.shape[1] + tokens, bias)


def mask_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """logits[rows[i], tokens[i]] = -inf, in place (logits contiguous).

    index_fill_ over the flat view, not logits[rows, tokens] = ...: that index_put_ waits for the device
    on CUDA, which stalled every pipelined step of a request with min_tokens (its EOS is masked)."""
    logits.view(-1).index_fill_(0, rows * logits.shape[1] + tokens, -torch.inf)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics: over seen tokens, positive logits are divided by the penalty, others multiplied."""
    p = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI semantics over output tokens: logit -= presence * (count > 0) + frequency * count."""
    penalised = logits - frequency.unsqueeze(1) * counts  # int32 counts promote to float32
    return penalised.sub_(presence.unsqueeze(1) * (counts > 0))
