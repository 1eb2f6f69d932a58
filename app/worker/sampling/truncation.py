"""Truncation of temperature-scaled logits: top-k, then top-p (nucleus), then min-p.

Each filter turns dropped tokens into -inf. A cut is made by value: every token whose logit equals
the last kept one is kept too, so ties at the cut-off never depend on sort order (as HF's top-k).
Top-p is computed over the distribution left by top-k (renormalised), as HF and vLLM do; min-p
needs no sort: prob_i < min_p * max_prob  <=>  logit_i < max_logit + log(min_p).

A full sort of [n, V] is the cost to avoid (2.8 ms for 256 x 152k on an H200, against 0.6 ms for
a top-4096): when every row's kept set lies among its top `width` tokens, a partial sort is enough.
"""

from __future__ import annotations

import torch

# Candidates of the partial sort: top-p without top-k is tried over this many tokens first.
CANDIDATES = 4096


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    width: int | None = None,
    verify: bool = False,
) -> torch.Tensor:
    """Mask all but each row's top_k[i] tokens (>= V: off), then all outside its top_p[i] nucleus.

    The nucleus is the smallest prefix of the sorted tokens whose mass reaches top_p; the top token
    is always kept and top_p >= 1 keeps everything (no float round-off at the tail).
    width: every row's top_k is <= width or off, so a partial sort of `width` tokens replaces the
    full one. verify: some row uses top_p without top_k and its nucleus may not fit in `width`
    tokens; check (one device sync) and fall back to the full sort if one does not. This is the
    sampler's only sync: no device-only fallback is cheaper than the full sort it avoids, so steps
    with such rows are not overlapped with the next step's launch (the worker's pipeline waits).
    """
    vocab = logits.shape[-1]
    if width is not None and width < vocab:
        candidates = logits.topk(width, dim=-1).values
        cutoff, covered = _cutoff(logits, candidates, top_k, top_p)
        if not verify or bool(covered.all()):
            return logits.masked_fill(logits < cutoff, -torch.inf)
    ordered = logits.sort(dim=-1, descending=True).values
    cutoff, _ = _cutoff(logits, ordered, top_k, top_p)
    return logits.masked_fill(logits < cutoff, -torch.inf)


def _cutoff(
    logits: torch.Tensor, ordered: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 1] smallest kept logit per row (-inf: keep all), and [n] whether `ordered` covered the row.

    ordered: [n, W] each row's W largest logits, descending (W = V for a full sort).
    """
    vocab, width = logits.shape[-1], ordered.shape[-1]
    k = top_k.clamp(1, width).unsqueeze(1)
    top_set = ordered.masked_fill(torch.arange(width, device=logits.device) >= k, -torch.inf)
    log_norm = top_set.logsumexp(dim=-1, keepdim=True)
    if width < vocab:  # rows without top_k renormalise over the whole vocabulary
        log_norm = torch.where((top_k < vocab).unsqueeze(1), log_norm, logits.logsumexp(-1, keepdim=True))
    probs = (top_set - log_norm).exp()
    mass = probs.cumsum(dim=-1)
    p = top_p.unsqueeze(1)
    in_nucleus = (mass - probs < p) | (p >= 1)
    # mass - probs is non-decreasing, so the kept set is a prefix: its length is a count.
    kept = torch.minimum(in_nucleus.sum(dim=-1, keepdim=True), k).clamp_min(1)
    keeps_all = ((top_k >= vocab) & (top_p >= 1)).unsqueeze(1)
    cutoff = ordered.gather(1, kept - 1).masked_fill(keeps_all, -torch.inf)
    covered = (top_k <= width) | ((top_k >= vocab) & ((top_p >= 1) | (mass[:, -1] >= top_p)))
    return cutoff, covered


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p[i] times the row's top probability (0 = off)."""
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < floor, -torch.inf)
