"""The one-shot all-reduce over peer memory (app/worker/peer_all_reduce.py) on CUDA, eager and inside a
captured CUDA graph, bf16 and fp32, several sizes up to the threshold:

- two GPUs (skipped with fewer): a TP=2 group as the worker joins it (NCCL device group); the kernel's
  sums equal NCCL's on the same tensors, bit for bit (two ranks: each element is a + b, rounded once),
  and Distributed.all_reduce routes the small tensors to it and the large ones to NCCL;

Two processes on ONE GPU cannot stand for two ranks: without MPS their kernels never run at the same
time, and each rank's one-shot kernel waits for the other's signal (tried on the H200: it hung).

Each rank runs in a spawned process that leaves with os._exit: a group whose collectives CUDA graphs
captured cannot be torn down (app/worker/parallel.py).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
RANK_TIMEOUT_S = 180
HIDDEN = 4096
# Rows of HIDDEN: one decode row, an odd count, the largest batch under the threshold in bf16 (64 rows:
# 512 KiB) and in fp32 (32 rows), and one row past it (NCCL).
ROWS = {torch.bfloat16: [1, 7, 64, 65], torch.float32: [1, 7, 32, 33]}


def rank_input(rank: int, rows: int, dtype: torch.dtype, step: int, device: torch.device) -> torch.Tensor:
    """Rank `rank`'s tensor: every rank can compute every other rank's (the one-GPU test's reference)."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * rows + rank)
    return torch.randn(rows, HIDDEN, generator=gen).to(dtype).to(device)


def expected_sum(size: int, rows: int, dtype: torch.dtype, step: int, device: torch.device) -> torch.Tensor:
    """Two ranks: a + b in fp32, rounded once to dtype (what both the kernel and NCCL compute)."""
    parts = [rank_input(r, rows, dtype, step, device).float() for r in range(size)]
    return sum(parts[1:], parts[0]).to(dtype)


def check(rank: int, device: torch.device, all_reduce: Callable[[torch.Tensor], torch.Tensor],
          reference: Callable[[torch.Tensor, int, torch.dtype, int], torch.Tensor],
          fits: Callable[[torch.Tensor], bool], large: bool) -> list[str]:
    """Eager calls, then graphs captured over static inputs and replayed on new values: each result
    against reference(x, rows, dtype, step). large: all_reduce takes the sizes past the threshold too
    (Distributed.all_reduce, which sends them to NCCL). Returns what was wrong."""
    wrong = []
    for dtype, all_rows in ROWS.items():
        for rows in all_rows:
            x = rank_input(rank, rows, dtype, 0, device)
            small = rows < all_rows[-1]
            if fits(x) != small:
                wrong.append(f"fits {dtype} x {rows}")
            if not (small or large):
                continue
            for name, got in (("eager", all_reduce(x.clone())), ("eager again", all_reduce(x.clone()))):
                if not torch.equal(got, reference(x, rows, dtype, 0)):
                    wrong.append(f"{name} {dtype} x {rows}")
    # Graphs: one per size that fits, all captured first (as the decode graphs are), then replayed in turn.
    graphs = []
    stream = torch.cuda.Stream(device)
    for dtype, all_rows in ROWS.items():
        for rows in all_rows[:-1]:
            static = rank_input(rank, rows, dtype, 0, device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                all_reduce(static.clone())  # warm-up outside the capture, as torch asks
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = all_reduce(static)
            graphs.append((dtype, rows, static, out, graph))
    for step in (1, 2):
        for dtype, rows, static, out, graph in graphs:
            x = rank_input(rank, rows, dtype, step, device)
            static.copy_(x)
            graph.replay()
            if not torch.equal(out, reference(x, rows, dtype, step)):
                wrong.append(f"graph step {step} {dtype} x {rows}")
    torch.cuda.synchronize(device)
    return wrong


def _two_gpu_rank(rank: int, init: str, queue: Any) -> None:
    try:
        import torch.distributed as dist

        from app.worker.parallel import TensorParallel

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        tp = TensorParallel.join(rank, 2, device, init, custom_all_reduce=True)
        assert tp.one_shot is not None, tp.all_reduce_path

        def nccl(x: torch.Tensor, rows: int, dtype: torch.dtype, step: int) -> torch.Tensor:
            want = x.clone()
            dist.all_reduce(want)
            return want

        wrong = check(rank, device, tp.one_shot, nccl, tp.one_shot.fits, large=False)  # the kernel alone
        wrong += [f"routed: {w}" for w in check(rank, device, tp.all_reduce, nccl, tp.one_shot.fits, large=True)]
        queue.put((rank, wrong, tp.all_reduce_path))
    except Exception:
        queue.put((rank, ["error"], traceback.format_exc()))
    os._exit(0)


@two_gpus
def test_one_shot_equals_nccl_on_two_gpus() -> None:
    results = run_ranks(_two_gpu_rank, 2, timeout_s=RANK_TIMEOUT_S)
    for rank in range(2):
        wrong, path = results[rank]
        assert wrong == [], (rank, wrong, path)
        assert path.startswith("one-shot over peer memory"), path

