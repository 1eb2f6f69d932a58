"""A tensor-parallel group driven from one process (benchmarks, tests): this process is TP rank 0 and
spawned processes run the other ranks' worker loop (app/worker/process.follow_steps), as the appliance's
worker processes do. The leader's runner relays every plan to them before it runs it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any

import torch

from app import protocol as p
from app.config.settings import Settings
from app.net import free_port
from app.worker.model_runner import ModelRunner
from app.worker.parallel import TensorParallel

FOLLOWER_STOP_S = 30.0


class LeaderRunner:
    """ModelRunner's interface (launch / finish / execute and its attributes) for TP rank 0."""

    def __init__(self, runner: ModelRunner, tp: TensorParallel, followers: list[mp.process.BaseProcess]) -> None:
        self.runner = runner
        self.tp = tp
        self.followers = followers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def launch(self, plan: p.StepPlan) -> Any:
        self.tp.relay(p.encode(plan))
        return self.runner.launch(plan)

    def finish(self, pending: Any) -> p.StepResult:
        return self.runner.finish(pending)

    def execute(self, plan: p.StepPlan) -> p.StepResult:
        return self.finish(self.launch(plan))

    def close(self) -> None:
        """Stop the followers (they finish what they were relayed first). On CUDA this process keeps its
        NCCL group until it exits (app/worker/parallel.py): one group per process."""
        self.tp.relay(p.encode(p.Shutdown()))
        for proc in self.followers:
            proc.join(FOLLOWER_STOP_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.tp.close()


def _follower_main(settings: Settings, device: str, rank: int, size: int, init_method: str) -> None:
    from app.worker.process import follow_steps

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)
    tp = TensorParallel.join(rank, size, dev, init_method, custom_all_reduce=not settings.disable_custom_all_reduce)
    runner = ModelRunner(settings, dev, tp)
    runner.warmup()
    with torch.inference_mode():
        follow_steps(runner, tp)
    os._exit(0)  # no interpreter teardown: an NCCL group that CUDA graphs captured cannot be destroyed


def start_tp_group(settings: Settings, device: torch.device, size: int) -> LeaderRunner:
    """Rank 0's runner here, ranks 1..size-1 in spawned processes (on CUDA, the next device indices)."""
    init = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    first = device.index or 0
    followers = []
    for rank in range(1, size):
        where = f"cuda:{first + rank}" if device.type == "cuda" else "cpu"
        proc = ctx.Process(target=_follower_main, args=(settings, where, rank, size, init), daemon=True)
        proc.start()
        followers.append(proc)
    tp = TensorParallel.join(0, size, device, init, custom_all_reduce=not settings.disable_custom_all_reduce)
    runner = ModelRunner(settings, device, tp)
    runner.warmup()
    return LeaderRunner(runner, tp, followers)
