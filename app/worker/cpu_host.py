"""What the CPU host offers a worker: the cores it may really use, and whether half precision is fast.

A container sees every core of its host in os.cpu_count(), but may run on fewer (its CPU set, in
os.sched_getaffinity) and for less time (the cgroup's CPU quota: cgroup v2 cpu.max, v1
cpu.cfs_quota_us / cpu.cfs_period_us). torch's OpenMP threads beyond that budget only wait for each
other, so the worker's thread count comes from the smaller of the two.

Half-precision matmuls are fast on CPUs with native bf16 / fp16 instructions (AVX512-BF16, AMX,
AVX512-FP16); elsewhere (AVX2) oneDNN converts every operand to float32 on the fly, which measured 1.1x
(batch 1) to 5x (batch 8 and more) slower than float32 itself for SmolLM2's shapes. So --dtype auto
on the CPU keeps the checkpoint's half dtype only where the instructions are there.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in cores (None: no limit, or no cgroup file to read)."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "200000 100000"
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_cores(root: Path = CGROUP_ROOT) -> int:
    """The cores this process may use at once: its CPU set, capped by the cgroup quota (rounded up: a
    quota of 1.5 cores keeps two threads busy part of the time)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cores = min(cores, max(1, math.ceil(limit)))
    return max(1, cores)


def worker_threads(cores: int, workers: int = 1) -> int:
    """torch threads for each of `workers` CPU workers on `cores` cores: the cores less two for the
    http, tokenizer and scheduler processes, shared among the workers, at least one and at most eight
    (beyond eight, a small model's ops are too short to split)."""
    return max(1, min(8, (cores - 2) // max(1, workers)))


def native_half(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bf16 / fp16) with native instructions (oneDNN's own check)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False
    return False


def cpu_auto_dtype(checkpoint: torch.dtype | None, native: bool | None = None) -> tuple[torch.dtype, str]:
    """--dtype auto on the CPU: (the dtype, why). The checkpoint's half dtype where the CPU has it
    natively, else float32 (also for a float32 checkpoint)."""
    half = checkpoint if checkpoint in (torch.bfloat16, torch.float16) else None
    if half is None:
        return torch.float32, f"the checkpoint is {checkpoint or 'of unknown dtype'}"
    name = str(half).removeprefix("torch.")
    native = native_half(half) if native is None else native
    if native:
        return half, f"the checkpoint's {name}: this CPU has native {name} matmuls"
    capability = torch.backends.cpu.get_cpu_capability()
    return torch.float32, f"float32 over the checkpoint's {name}: this CPU ({capability}) has no native {name} matmul"
