"""Acceptance of draft tokens against the target's distributions, keeping the target's output exact.

A verify row fed [t, d_1 .. d_m] and got the target's distribution p_j at each of its m + 1 positions
(p_j predicts the token after d_j; p_0 the one after t). Greedy rows accept the longest prefix of drafts
equal to the target's argmax and then take the argmax after it: token for token what decoding one
token at a time gives. Sampled rows use rejection sampling (Leviathan et al., Chen et al.): draft d_j
is accepted with probability min(1, p_j(d_j) / q_j(d_j)), q_j being the draft's distribution (one-hot
for a deterministic draft such as n-gram, so the probability is p_j(d_j)); at the first rejection the
token is drawn from the residual max(0, p_j - q_j), renormalised (for a one-hot q: p_j without d_j);
if every draft is accepted one more token is drawn from p_m. Each emitted token is then distributed
exactly as p: the drafts change how many tokens a step yields, never which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.worker.sampling.truncation import apply_min_p, apply_top_k_top_p


@dataclass
class Accepted:
    """One verify row's outcome: the drafts it kept, then the token the target chose after them."""

    tokens: list[int]
    next_token: int


def row_offsets(lengths: list[int]) -> list[int]:
    """The first flat position of each row that fed 1 + lengths[i] positions."""
    offsets, at = [], 0
    for m in lengths:
        offsets.append(at)
        at += m + 1
    return offsets


def accept_greedy(target_ids: list[int], drafts: list[list[int]]) -> list[Accepted]:
    """target_ids: the target's argmax at every fed position, rows flat (1 + len(drafts[i]) each)."""
    out = []
    for at, draft in zip(row_offsets([len(d) for d in drafts]), drafts, strict=True):
        j = 0
        while j < len(draft) and draft[j] == target_ids[at + j]:
            j += 1
        out.append(Accepted(list(draft[:j]), target_ids[at + j]))
    return out


def accept_sampled(
    probs: torch.Tensor,
    drafts: list[list[int]],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[Accepted]:
    """Rejection sampling (module docstring). probs: [sum(len(d) + 1), V] float32, the target's
    distribution at every fed position, rows flat; draft_probs: [sum(len(d)), V] the draft's q at every
    draft position (rows flat), or None for deterministic drafts."""
    device = probs.device
    offsets = row_offsets([len(d) for d in drafts])
    positions = [at + j for at, d in zip(offsets, drafts, strict=True) for j in range(len(d))]
    tokens = [t for d in drafts for t in d]
    ratio = probs.new_zeros(0)
    if positions:
        index = torch.tensor([positions, tokens], dtype=torch.int64, device=device)
        ratio = probs[index[0], index[1]]
        if draft_probs is not None:
            q = draft_probs[torch.arange(len(tokens), device=device), index[1]]
            ratio = ratio / q.clamp_min(torch.finfo(q.dtype).tiny)
    u = torch.rand(ratio.shape, generator=generator, device=device, dtype=ratio.dtype)
    ok = (u < ratio).tolist()
    kept, last_rows, residual_of = [], [], []
    flat = 0
    for at, draft in zip(offsets, drafts, strict=True):
        j = 0
        while j < len(draft) and ok[flat + j]:
            j += 1
        kept.append(j)
        last_rows.append(at + j)
        residual_of.append(flat + j if j < len(draft) else -1)  # the rejected draft's flat index
        flat += len(draft)
    final = probs.index_select(0, torch.tensor(last_rows, dtype=torch.int64, device=device))
    rejected = [(i, r) for i, r in enumerate(residual_of) if r >= 0]
    if rejected:
        rows = torch.tensor([i for i, _ in rejected], dtype=torch.int64, device=device)
        which = torch.tensor([r for _, r in rejected], dtype=torch.int64, device=device)
        if draft_probs is None:
            residual = final.index_select(0, rows).scatter(1, index[1].index_select(0, which).unsqueeze(1), 0.0)
        else:
            residual = (final.index_select(0, rows) - draft_probs.index_select(0, which)).clamp_min(0.0)
        # p == q leaves nothing: then any draw from p is exact (a rejection is impossible there).
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, final.index_select(0, rows), residual)
        final = final.index_copy(0, rows, residual)
    chosen = torch.multinomial(final, 1, generator=generator).squeeze(1).tolist()
    return [Accepted(list(d[:j]), t) for d, j, t in zip(drafts, kept, chosen, strict=True)]


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The distribution the portable sampler draws from, per row (float32 [n, V]): temperature, then
    top-k / top-p, then min-p (app/worker/sampling/torch_sampler.py). top_k >= V or top_p >= 1: off."""
    rows = logits.to(torch.float32) / temperature.unsqueeze(1)
    if bool((top_k < logits.shape[-1]).any()) or bool((top_p < 1).any()):
        rows = apply_top_k_top_p(rows, top_k, top_p)
    if bool((min_p > 0).any()):
        rows = apply_min_p(rows, min_p)
    return torch.softmax(rows, dim=-1)
