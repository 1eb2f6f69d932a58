"""The host-side plan of one sampling step: which rows need what, uploaded in two copies.

Rows are grouped with numpy over the slot tables (greedy / sampled, penalised, biased, blocked by
min_new_tokens, asking for logprobs), and every index and parameter array the device needs is
packed into one int64 and one float32 buffer: two host-to-device copies per step, whatever the mix.

A sampler backend with kernels of its own (flashinfer) passes a KernelRoute: the unseeded sampled
rows it takes come first among the sample rows, ordered by its groups, so that each group's rows and
parameters are contiguous slices of the uploaded arrays; the portable draw takes the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from app.worker.sampling import truncation
from app.worker.sampling.slots import SlotTable
from app.worker.transfer import to_device


@dataclass(frozen=True)
class KernelRoute:
    """The unseeded sampled rows a sampler backend draws with its own kernels: group(table, slots)
    gives each of those slots a group in [0, num_groups), or -1 to leave it to the portable draw."""

    num_groups: int
    group: Callable[[SlotTable, np.ndarray], np.ndarray]


@dataclass(slots=True)
class BatchPlan:
    """Row groups of a [B, V] batch (host arrays of row indices) and their device twins in `dev`."""

    slots: np.ndarray
    greedy_rows: np.ndarray
    sample_rows: np.ndarray  # the kernel groups' rows, then the other unseeded rows, then seeded ones
    num_unseeded: int
    penalised_rows: np.ndarray
    logprob_rows: np.ndarray
    # The flags below describe the rows of the portable draw (sample_rows[num_kernel_rows:]).
    truncates: bool  # some row uses top_k or top_p
    sort_width: int | None  # partial sort width for apply_top_k_top_p (None: full sort)
    verify_nucleus: bool  # some row uses top_p without top_k
    need_min_p: bool
    kernel_groups: tuple[int, ...] = ()  # rows per KernelRoute group, the first sample rows in group order
    dev: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_kernel_rows(self) -> int:
        return sum(self.kernel_groups)

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its logits as they are: all greedy, nothing that processes a row
        (bias, a min_new_tokens mask, penalties) and no logprobs."""
        return not (
            len(self.sample_rows) or len(self.penalised_rows) or len(self.logprob_rows)
            or self.dev["bias_rows"].numel() or self.dev["block_rows"].numel()
        )  # fmt: skip

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


def _route_rows(
    table: SlotTable, slots: np.ndarray, rows: np.ndarray, route: KernelRoute | None
) -> tuple[np.ndarray, tuple[int, ...]]:
    """rows reordered: route's groups first (group by group, each in row order), then the rest; and
    the number of rows of each group."""
    if route is None or not len(rows):
        return rows, ()
    groups = np.asarray(route.group(table, slots[rows]), dtype=np.int64)
    if groups.shape != rows.shape or ((groups < -1) | (groups >= route.num_groups)).any():
        raise ValueError(f"a kernel route must give each row a group in [-1, {route.num_groups})")
    order = np.argsort(np.where(groups < 0, route.num_groups, groups), kind="stable")
    counts = np.bincount(groups[groups >= 0], minlength=route.num_groups)
    return rows[order], tuple(int(n) for n in counts)


def plan_batch(table: SlotTable, slots: list[int], route: KernelRoute | None = None) -> BatchPlan:
    """Group the rows of a batch whose row i belongs to slots[i], and upload what the device needs.
    route: the unseeded sampled rows a backend's kernels take (see KernelRoute)."""
    s = np.asarray(slots, dtype=np.int64)
    table.check_active(s)
    greedy, seeded = table.greedy[s], table.seeded[s]
    unseeded_rows, kernel_groups = _route_rows(table, s, np.flatnonzero(~greedy & ~seeded), route)
    sample_rows = np.concatenate([unseeded_rows, np.flatnonzero(~greedy & seeded)])
    portable = s[sample_rows[sum(kernel_groups) :]]
    plan = BatchPlan(
        slots=s,
        greedy_rows=np.flatnonzero(greedy),
        sample_rows=sample_rows,
        num_unseeded=len(unseeded_rows),
        penalised_rows=np.flatnonzero(table.penalised[s]),
        logprob_rows=np.flatnonzero(table.logprobs[s]),
        need_min_p=bool((table.min_p[portable] > 0).any()),
        kernel_groups=kernel_groups,
        **_truncation(table.top_k[portable], table.top_p[portable], table.vocab_size),
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
