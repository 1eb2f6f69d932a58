#!/usr/bin/env python3
"""Where a CPU step's time goes: the model runner alone (no IPC), at a few batch sizes.

Builds the ModelRunner on the CPU from the default recipe's settings, prefills `batch` sequences of
--prompt-len tokens, then times --steps decode steps (each a full launch + finish, sampling included)
and, with --profile, prints torch.profiler's table of one window grouped by op, and the shares of the
step in model layers, attention, the LM head and sampling.

  python scripts/profile_cpu_step.py --batch 1 8 --dtype float32 bfloat16 --threads 1 2

--ab-plain R alternates, R rounds per batch, the weights' run-time form (app/worker/layers/cpu_weights.py)
with the plain form before it (every linear the transpose of a contiguous [in, out], the LM head a plain
mm), in one process: the ratio is what packing gains on a machine others share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan
from app.worker.cpu_host import available_cores, worker_threads

DEFAULT_MODEL = Path("~/.cache/tokenspeed/models/smollm2-135m-instruct").expanduser()


def make_runner(model: Path, dtype: str, max_num_seqs: int) -> Any:
    from app.config import Settings
    from app.worker.model_runner import ModelRunner

    settings = Settings(model=str(model), dtype=dtype, device="cpu", max_num_seqs=max_num_seqs,
                        max_model_len=2048, block_size=16, max_total_tokens=8192, chunked_prefill_size=2048)
    return ModelRunner(settings, torch.device("cpu"))


class Driver:
    """Feeds the runner plans as the scheduler would: one prefill, then decode steps."""

    def __init__(self, runner: Any, batch: int, prompt_len: int, block_size: int = 16) -> None:
        self.runner, self.step, self.batch, self.block_size = runner, 0, batch, block_size
        self.lens = [prompt_len] * batch
        per_seq = min(512 // block_size, runner.pool.num_blocks // batch)  # up to 512 tokens each
        self.blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        g = torch.Generator().manual_seed(0)
        new = [NewSeq(slot=i, rid=f"r{i}", sampling=SamplingParams(temperature=0.0), num_prompt_tokens=prompt_len,
                      block_ids=self.blocks[i][: -(-prompt_len // block_size) + 4])
               for i in range(batch)]
        chunks = [SeqChunk(slot=i, token_ids=torch.randint(100, 40000, (prompt_len,), generator=g).tolist())
                  for i in range(batch)]
        self.owned = [len(s.block_ids) for s in new]
        self.run(StepPlan(self.next_step(), new_seqs=new, chunks=chunks))

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def run(self, plan: StepPlan) -> Any:
        return self.runner.finish(self.runner.launch(plan))

    def decode(self) -> Any:
        chunks = []
        for i in range(self.batch):
            self.lens[i] += 1
            need = -(-(self.lens[i] + 1) // self.block_size)
            append = self.blocks[i][self.owned[i]:need] if need > self.owned[i] else []
            self.owned[i] += len(append)
            chunks.append(SeqChunk(slot=i, append_block_ids=append))
        return self.run(StepPlan(self.next_step(), chunks=chunks))

    def free(self) -> None:
        self.run(StepPlan(self.next_step(), free_slots=list(range(self.batch))))


def time_steps(driver: Driver, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        driver.decode()
        times.append(time.perf_counter() - start)
    return times


def ab_plain(driver: Driver, steps: int, rounds: int) -> dict[str, float]:
    """Step p50 (ms) with the model's weights as loaded ('packed') and in the plain layout, alternated."""
    from app.worker.layers.cpu_weights import plain_weights, transpose_layout
    from app.worker.layers.linear import Linear

    model = driver.runner.model
    times: dict[str, list[float]] = {"packed": [], "plain": []}
    for _ in range(rounds):
        times["packed"] += time_steps(driver, steps)
        with plain_weights(model):
            for module in model.modules():
                if isinstance(module, Linear) and module.quant is None:
                    transpose_layout(module)
            time_steps(driver, 2)
            times["plain"] += time_steps(driver, steps)
        time_steps(driver, 2)
    return {f"{name}_ms_p50": statistics.median(t) * 1e3 for name, t in times.items()}


def profile(driver: Driver, steps: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            driver.decode()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", nargs="+", default=["float32"])
    parser.add_argument("--threads", type=int, nargs="+", default=[worker_threads(available_cores())],
                        help="torch threads (default: what the worker process would use here)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ab-plain", type=int, default=0, metavar="ROUNDS",
                        help="alternate the packed weights with the plain layout, ROUNDS rounds of --steps")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = []
    for dtype in args.dtype:
        runner = make_runner(args.model_dir, dtype, max(args.batch))
        for batch in args.batch:
            driver = Driver(runner, batch, args.prompt_len)
            time_steps(driver, 3)  # warm
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = time_steps(driver, args.steps)
                row = {"dtype": dtype, "batch": batch, "threads": threads,
                       "step_ms_p50": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3}
                results.append(row)
                print(json.dumps(row), flush=True)
            if args.ab_plain:
                row = {"dtype": dtype, "batch": batch, "threads": torch.get_num_threads(),
                       **ab_plain(driver, args.steps, args.ab_plain)}
                results.append(row)
                print(json.dumps(row), flush=True)
            if args.profile:
                print(f"--- {dtype} batch {batch} threads {torch.get_num_threads()}")
                print(profile(driver, args.steps))
            driver.free()
        del runner
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
