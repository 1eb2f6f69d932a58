"""Scheduler CPU overhead per step: planning, msgpack encoding and ZMQ IPC, with a simulated worker.

A fake worker process answers each StepPlan after --step-ms (the GPU time it stands for) with one
token per sampling sequence. The scheduler side times only its own work: schedule() + encode +
send, and decode + process_result() once the result has arrived (waiting is excluded).

    python scripts/bench_step_overhead.py --batch-sizes 1 64 256 --steps 200 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import tempfile
import time

import zmq

from app import ipc
from app import protocol as p
from app.ipc import Endpoints
from app.scheduler.scheduler import Scheduler, SchedulerConfig


def fake_worker(endpoints: Endpoints, step_ms: float) -> None:
    ctx = zmq.Context()
    inbox = ipc.bind_pull(ctx, endpoints.inbox("worker", 0))
    out = ipc.connect_push(ctx, endpoints.inbox("scheduler_results"))
    while True:
        plan = ipc.recv(inbox)
        if isinstance(plan, p.Shutdown):
            return
        time.sleep(step_ms / 1000)
        slots = [c.slot for c in plan.chunks if c.sample]
        ipc.send(out, p.StepResult(plan.step, slots, [7] * len(slots)))


def measure(batch: int, steps: int, step_ms: float, prompt_len: int) -> dict:
    endpoints = Endpoints(tempfile.mkdtemp(prefix="ts-bench-"))
    ctx = zmq.Context()
    results = ipc.bind_pull(ctx, endpoints.inbox("scheduler_results"))
    worker = mp.get_context("spawn").Process(target=fake_worker, args=(endpoints, step_ms), daemon=True)
    worker.start()
    to_worker = ipc.connect_push(ctx, endpoints.inbox("worker", 0))
    cfg = SchedulerConfig(
        num_blocks=batch * (prompt_len + steps + 64) // 16 + 16,
        block_size=16,
        max_model_len=prompt_len + steps + 64,
        max_num_seqs=batch,
        chunked_prefill_size=8192,
        max_prefill_tokens=8192,
        enable_prefix_caching=True,
        eos_token_ids=(0,),
    )
    sched = Scheduler(cfg)
    for i in range(batch):
        prompt = [(i * 131 + j) % 50000 + 1 for j in range(prompt_len)]
        sp = p.SamplingParams(max_new_tokens=steps + 32, temperature=0, ignore_eos=True)
        sched.add_request(p.TokenizedRequest(f"r{i}", prompt, sp))
    overheads = []
    for step in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        assert plan is not None
        ipc.send(to_worker, plan)
        t1 = time.perf_counter()
        results.poll()
        t2 = time.perf_counter()
        sched.process_result(ipc.recv(results))
        t3 = time.perf_counter()
        if step >= 5:  # past the prefill steps: steady-state decode
            overheads.append((t1 - t0) + (t3 - t2))
    ipc.send(to_worker, p.Shutdown())
    worker.join(5)
    ctx.destroy(linger=0)
    ms = [o * 1000 for o in overheads]
    return {
        "running_requests": batch,
        "simulated_step_ms": step_ms,
        "overhead_ms_median": statistics.median(ms),
        "overhead_ms_p90": statistics.quantiles(ms, n=10)[-1],
        "overhead_fraction_of_step": statistics.median(ms) / step_ms if step_ms else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = [measure(b, args.steps, args.step_ms, args.prompt_len) for b in args.batch_sizes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    step_label = f"of a {args.step_ms:.0f} ms step"
    print(f"{'running':>8} {'overhead ms (median)':>22} {'p90':>8} {step_label:>18}")
    for r in rows:
        print(
            f"{r['running_requests']:>8} {r['overhead_ms_median']:>22.3f} {r['overhead_ms_p90']:>8.3f} "
            f"{100 * r['overhead_fraction_of_step']:>17.1f}%"
        )


if __name__ == "__main__":
    main()
