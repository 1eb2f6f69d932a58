"""Run one function per rank in spawned processes and collect what each reports."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any

from app.net import free_port


def run_ranks(target: Callable[..., None], size: int, *args: Any, timeout_s: float) -> dict[int, tuple[Any, Any]]:
    """target(rank, init_method, *args, queue) in `size` spawned processes; each puts (rank, a, b) on
    the queue once. Returns {rank: (a, b)}; every process is gone afterwards."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(rank, init, *args, queue), daemon=True) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        results = {}
        for _ in procs:
            rank, first, second = queue.get(timeout=timeout_s)
            results[rank] = (first, second)
        return results
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
