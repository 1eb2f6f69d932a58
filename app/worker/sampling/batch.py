"""The host-side plan of one sampling step: which rows need what, uploaded in two copies.

Rows are grouped with numpy over the slot tables (greedy / sampled, penalised, biased, blocked by
min_new_tokens, asking for logprobs), and every index and parameter array the device needs is
packed into one int64 and one float32 buffer: two host-to-device copies per step, whatever the mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.worker.sampling import truncation
from app.worker.sampling.slots import SlotTable
from app.worker.transfer import to_device


@dataclass(slots=True)
class BatchPlan:
    """Row groups of a [B, V] batch (host arrays of row indices) and their device twins in `dev`."""

    slots: np.ndarray
    greedy_rows: np.ndarray
    sample_rows: np.ndarray  # unseeded rows first, then seeded ones
    num_unseeded: int
    penalised_rows: np.ndarray
    logprob_rows: np.ndarray
    truncates: bool  # some sampled row uses top_k or top_p
    sort_width: int | None  # partial sort width for apply_top_k_top_p (None: full sort)
    verify_nucleus: bool  # some sampled row uses top_p without top_k
    need_min_p: bool
    dev: dict[str, torch.Tensor] = field(default_factory=dict)

    def covers_all(self, rows: np.ndarray) -> bool:
        """Whether `rows` is the whole batch in order (then no gather is needed)."""
        return len(rows) == len(self.slots) and bool((rows == np.arange(len(rows))).all())


def _pairs(rows: np.ndarray, per_row: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Flatten per-row id arrays into (row, id) pairs."""
    if not per_row:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lengths = [len(ids) for ids in per_row]
    return np.repeat(rows, lengths).astype(np.int64), np.concatenate(per_row).astype(np.int64)


def _upload(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """One host-to-device copy per dtype, queued without a sync; the results are views of the copied buffer."""
    out: dict[str, torch.Tensor] = {}
    for dtype in (np.int64, np.float32):
        names = [name for name, array in arrays.items() if array.dtype == dtype]
        flat = torch.from_numpy(np.concatenate([arrays[name] for name in names]))
        pieces = to_device(flat, device).split([arrays[name].size for name in names])
        out.update(zip(names, pieces, strict=True))
    return out


def _truncation(top_k: np.ndarray, top_p: np.ndarray, vocab_size: int) -> dict[str, Any]:
    """How the sampled rows run top-k / top-p: not at all, over a partial sort, or a full sort."""
    has_k = top_k < vocab_size
    p_only = ~has_k & (top_p < 1)
    widest = int(top_k[has_k].max()) if has_k.any() else 0
    width = max(widest, truncation.CANDIDATES if p_only.any() else 0)
    # Any width >= every top_k is exact; past CANDIDATES a top-k costs about as much as a full sort.
    partial = widest <= truncation.CANDIDATES and width < vocab_size
    return {
        "truncates": bool(has_k.any() or p_only.any()),
        "sort_width": width if partial else None,
        "verify_nucleus": bool(p_only.any()),
    }


def plan_batch(table: SlotTable, slots: list[int]) -> BatchPlan:
    """Group the rows of a batch whose row i belongs to slots[i], and upload what the device needs."""
    s = np.asarray(slots, dtype=np.int64)
    table.check_active(s)
    greedy, seeded = table.greedy[s], table.seeded[s]
    unseeded_rows = np.flatnonzero(~greedy & ~seeded)
    sample_rows = np.concatenate([unseeded_rows, np.flatnonzero(~greedy & seeded)])
    sampled = s[sample_rows]
    plan = BatchPlan(
        slots=s,
        greedy_rows=np.flatnonzero(greedy),
        sample_rows=sample_rows,
        num_unseeded=len(unseeded_rows),
        penalised_rows=np.flatnonzero(table.penalised[s]),
        logprob_rows=np.flatnonzero(table.logprobs[s]),
        need_min_p=bool((table.min_p[sampled] > 0).any()),
        **_truncation(table.top_k[sampled], table.top_p[sampled], table.vocab_size),
    )
    plan.dev = _upload(_device_arrays(table, plan), table.device)
    return plan


def _device_arrays(table: SlotTable, plan: BatchPlan) -> dict[str, np.ndarray]:
    s, extras = plan.slots, table.extras
    sampled, penalised = s[plan.sample_rows], s[plan.penalised_rows]
    biased_rows = np.flatnonzero(table.has_bias[s])
    bias_rows, bias_ids = _pairs(biased_rows, [extras[slot].bias_ids for slot in s[biased_rows]])
    bias_values = [np.zeros(0, np.float32)] + [extras[slot].bias_values for slot in s[biased_rows]]
    blocked_rows = np.flatnonzero(table.num_output[s] < table.min_new_tokens[s])
    block_rows, block_ids = _pairs(blocked_rows, [extras[slot].blocked_ids for slot in s[blocked_rows]])
    return {
        "greedy_rows": plan.greedy_rows.astype(np.int64),
        "sample_rows": plan.sample_rows.astype(np.int64),
        "top_k": table.top_k[sampled],
        "temperature": table.temperature[sampled],
        "top_p": table.top_p[sampled],
        "min_p": table.min_p[sampled],
        "penalised_rows": plan.penalised_rows.astype(np.int64),
        "penalised_slots": penalised,
        "repetition": table.repetition[penalised],
        "presence": table.presence[penalised],
        "frequency": table.frequency[penalised],
        "bias_rows": bias_rows,
        "bias_ids": bias_ids,
        "bias_values": np.concatenate(bias_values).astype(np.float32),
        "block_rows": block_rows,
        "block_ids": block_ids,
        "logprob_rows": plan.logprob_rows.astype(np.int64),
    }
