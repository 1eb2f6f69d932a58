"""The CPU host's core budget (CPU set and cgroup quota) and the CPU's dtype choice."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from app.worker import cpu_host
from app.worker.cpu_host import available_cores, cgroup_cpu_limit, cpu_auto_dtype, worker_threads


def write(root: Path, name: str, text: str) -> None:
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "400000 100000\n"}, 4.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu.max": "garbage\n"}, None),
        ({}, None),
    ],
)
def test_cgroup_quota(tmp_path: Path, files: dict[str, str], expected: float | None) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    assert cgroup_cpu_limit(tmp_path) == expected


def test_available_cores_is_the_cpu_set_capped_by_the_quota(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert available_cores(tmp_path) == 8  # no cgroup file: the CPU set
    write(tmp_path, "cpu.max", "250000 100000")
    assert available_cores(tmp_path) == 3  # 2.5 cores keep three threads busy part of the time
    write(tmp_path, "cpu.max", "1600000 100000")
    assert available_cores(tmp_path) == 8  # a quota above the CPU set does not add cores
    write(tmp_path, "cpu.max", "10000 100000")
    assert available_cores(tmp_path) == 1


@pytest.mark.parametrize(
    ("cores", "workers", "expected"), [(1, 1, 1), (2, 1, 1), (4, 1, 2), (10, 2, 4), (64, 1, 8), (3, 4, 1)]
)
def test_worker_threads(cores: int, workers: int, expected: int) -> None:
    assert worker_threads(cores, workers) == expected


def test_cpu_auto_dtype() -> None:
    assert cpu_auto_dtype(torch.bfloat16, native=True)[0] == torch.bfloat16
    dtype, why = cpu_auto_dtype(torch.bfloat16, native=False)
    assert dtype == torch.float32 and "no native bfloat16" in why
    assert cpu_auto_dtype(torch.float16, native=True)[0] == torch.float16
    assert cpu_auto_dtype(torch.float32, native=True)[0] == torch.float32
    assert cpu_auto_dtype(None)[0] == torch.float32


def test_native_half_asks_onednn(monkeypatch) -> None:
    assert cpu_host.native_half(torch.float32) is False
    assert isinstance(cpu_host.native_half(torch.bfloat16), bool)
