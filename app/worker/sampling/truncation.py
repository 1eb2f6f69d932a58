"""Truncation of temperature-scaled logits: top-k, then top-p (nucleus), then min-p.

Each filter turns dropped tokens into -inf. A cut is made by value: every token whose logit equals
the last kept one is kept too, so ties at the cut-off never depend on sort order (as HF's top-k).
Top-p is computed over the distribution left by top-k (renormalised), as HF and vLLM do; min-p
needs no sort: prob_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p).
"""

from __future__ import annotations

import torch


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's top_k[i] tokens (V = off), then all outside the top_p[i] nucleus.

    The nucleus is the smallest prefix of the sorted tokens whose mass reaches top_p; the top token
    is always kept and top_p >= 1 keeps everything (no float round-off at the tail).
    """
    vocab = logits.shape[-1]
    ordered = logits.sort(dim=-1, descending=True).values
    position = torch.arange(vocab, device=logits.device)
    k = top_k.clamp(1, vocab).unsqueeze(1)
    probs = ordered.masked_fill(position >= k, -torch.inf).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    in_nucleus = (mass_before < top_p.unsqueeze(1)) | (top_p.unsqueeze(1) >= 1)
    # mass_before is non-decreasing, so the kept set is a prefix: its length is a count.
    kept = torch.minimum(in_nucleus.sum(dim=-1, keepdim=True), k).clamp_min(1)
    cutoff = ordered.gather(1, kept - 1)
    return logits.masked_fill(logits < cutoff, -torch.inf)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p[i] times the row's top probability (0 = off)."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < floor, -torch.inf)
