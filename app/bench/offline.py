#!/usr/bin/env python3
"""Offline throughput, in process: the real Scheduler drives a ModelRunner directly (no HTTP, no IPC).

N requests of --input-len random prompt tokens and exactly --output-len new tokens (ignore_eos) are
queued at once; the loop plans, executes and feeds results back until all finish. Reported: output
and total tokens/s, requests/s, steps, mean step time, preemptions, the most requests running at
once, the KV pool (tokens and bytes) and the precision, and a digest of every request's token ids.

Steps overlap as in the appliance (app/scheduler/process.py, app/worker/process.py): the scheduler
keeps MAX_INFLIGHT_STEPS plans out, and the worker's StepPipeline launches step N+1 before it reads
step N's tokens back, so planning, staging and result processing run while the GPU computes.
--no-overlap runs each step start to end instead (execute, then process_result).

  tokenspeed bench offline --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16 --num-requests 256 --input-len 512 --output-len 256 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from app import protocol as p
from app.bench.latency import (
    add_common_flags,
    close_runner,
    emit,
    make_runner,
    runner_figures,
    runner_settings,
    sync,
    tp_size,
)
from app.scheduler.process import MAX_INFLIGHT_STEPS
from app.scheduler.scheduler import Scheduler, SchedulerConfig
from app.worker.process import StepPipeline


@dataclass
class Outcome:
    """What one drive of the scheduler produced."""

    steps: int = 0
    finished: int = 0
    max_running: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # request id -> its token ids
    report_every: float = 0.0  # seconds between progress lines on stderr (0: none)
    # Per step kind ("decode": every chunk feeds one sampled token; "mixed": a prefill chunk in it): how
    # many, and the wall time between a step's result and the one before it (its share of the run).
    kinds: dict[str, list[float]] = field(default_factory=dict)
    profile: StepProfiler | None = None
    started: float = field(default_factory=time.perf_counter)
    last_report: float = field(default_factory=time.perf_counter)

    @property
    def output_tokens(self) -> int:
        return sum(len(ids) for ids in self.outputs.values())

    def digest(self) -> str:
        """sha256 of every request's token ids, in request id order: equal runs have equal digests."""
        text = json.dumps(sorted(self.outputs.items()), separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def take(self, deltas: list[p.TokenDelta]) -> None:
        """Record a step's deltas; a failed request fails the benchmark (its figures would be wrong)."""
        for delta in deltas:
            if delta.error is not None:
                raise RuntimeError(f"request {delta.rid} failed: {delta.error}")
            self.outputs.setdefault(delta.rid, []).extend(delta.token_ids)
            self.finished += delta.finish_reason is not None

    def timed(self, kind: str, started: float) -> float:
        """A step of `kind` ended now; returns now (the next step's start)."""
        now = time.perf_counter()
        count_and_seconds = self.kinds.setdefault(kind, [0, 0.0])
        count_and_seconds[0] += 1
        count_and_seconds[1] += now - started
        return now

    def note(self, scheduler: Scheduler) -> None:
        """After each processed step: the concurrency reached, and now and then a progress line (a run
        cut by its time limit still tells how far it got)."""
        self.max_running = max(self.max_running, len(scheduler.running))
        now = time.perf_counter()
        if self.report_every and now - self.last_report >= self.report_every:
            self.last_report = now
            elapsed = now - self.started
            print(f"{elapsed:.1f} s: {self.steps} steps, {self.finished} finished, {self.output_tokens} output "
                  f"tokens ({self.output_tokens / elapsed:.0f}/s), {len(scheduler.running)} running, "
                  f"{len(scheduler.waiting)} waiting, {scheduler.num_preemptions} preemptions",
                  file=sys.stderr, flush=True)  # fmt: skip


def step_kind(plan: p.StepPlan) -> str:
    return "mixed" if any(chunk.token_ids for chunk in plan.chunks) else "decode"


class StepProfiler:
    """torch.profiler over steps [first, first + count) of the run: the kernels' GPU time by name and the
    GPU's busy share of the window's wall time (the rest is the GPU waiting on the host)."""

    def __init__(self, first: int, count: int) -> None:
        self.first, self.count = first, count
        self._profiler: Any = None
        self._started = 0.0
        self._wall = 0.0  # of the window, once it closed

    def at_step(self, step: int) -> None:
        if step == self.first:
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self._profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
            self._profiler.start()
            self._started = time.perf_counter()
        elif step == self.first + self.count and self._profiler is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._wall = time.perf_counter() - self._started
            self._profiler.stop()

    def report(self) -> dict[str, Any]:
        """The window's figures (empty if the run ended before it closed); called after the timed run,
        since reading the trace takes a while."""
        if self._profiler is None or not self._wall:
            return {}
        wall = self._wall
        kernels = [e for e in self._profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        by_name: dict[str, list[float]] = {}
        for event in kernels:
            entry = by_name.setdefault(event.name[:90], [0, 0.0])
            entry[0] += 1
            entry[1] += event.device_time / 1e3  # us -> ms
        busy_ms = sum(ms for _, ms in by_name.values())
        top = sorted(by_name.items(), key=lambda item: -item[1][1])[:20]
        print(f"profile of steps {self.first}..{self.first + self.count - 1}: wall {wall * 1e3:.1f} ms, GPU busy "
              f"{busy_ms:.1f} ms ({busy_ms / (wall * 1e3):.0%})", file=sys.stderr)
        for name, (calls, ms) in top:
            print(f"  {ms:9.2f} ms {ms / busy_ms:6.1%} {calls:6d}x  {name}", file=sys.stderr)
        gaps = idle_gaps(kernels)
        print("GPU idle between kernels, by the kernels on either side:", file=sys.stderr)
        for gap in gaps:
            print(f"  {gap['ms']:9.2f} ms {gap['count']:6d}x  {gap['before']} -> {gap['after']}", file=sys.stderr)
        host = host_during_longest_gap(self._profiler.events(), kernels)
        print("the host's longest calls during the GPU's longest idle gap:", file=sys.stderr)
        for call in host:
            print(f"  {call['ms']:9.2f} ms  {call['name']}", file=sys.stderr)
        return {
            "steps": self.count, "wall_ms": wall * 1e3, "gpu_busy_ms": busy_ms,
            "gpu_busy_share": busy_ms / (wall * 1e3),
            "kernels": [{"name": name, "calls": calls, "ms": ms, "share": ms / busy_ms} for name, (calls, ms) in top],
            "idle_gaps": gaps,
            "host_during_longest_gap": host,
        }


def _gaps(kernels: list[Any]) -> list[tuple[float, float, str, str]]:
    """The GPU's idle stretches between device events (kernels and copies, by their GPU timestamps; an
    event overlapping another, on another stream, closes none): (start, end, event before, event after)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in kernels)
    gaps = []
    end, before = (spans[0][1], spans[0][2]) if spans else (0.0, "")
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((end, start, before, name))
        if stop >= end:
            end, before = stop, name
    return gaps


def idle_gaps(kernels: list[Any], top: int = 10) -> list[dict[str, Any]]:
    """Where the GPU waited: the idle time summed per (event before, event after) pair, largest first."""
    pairs: dict[tuple[str, str], list[float]] = {}
    for lo, hi, before, after in _gaps(kernels):
        entry = pairs.setdefault((before, after), [0, 0.0])
        entry[0] += 1
        entry[1] += (hi - lo) / 1e3  # us -> ms
    ranked = sorted(pairs.items(), key=lambda item: -item[1][1])[:top]
    return [{"before": b, "after": a, "count": n, "ms": ms} for (b, a), (n, ms) in ranked]


def host_during_longest_gap(events: list[Any], kernels: list[Any], top: int = 20) -> list[dict[str, Any]]:
    """What the host was doing while the GPU idled longest: the host-side events (torch ops, CUDA runtime
    calls) overlapping that gap, by their time inside it, the innermost first among equals. Little or
    nothing: the host was in plain Python (or waiting on a lock) for the rest."""
    gaps = _gaps(kernels)
    if not gaps:
        return []
    lo, hi, _, _ = max(gaps, key=lambda gap: gap[1] - gap[0])
    inside = [(min(e.time_range.end, hi) - max(e.time_range.start, lo), e.time_range.end - e.time_range.start,
               e.name[:90]) for e in events
              if e.device_type != torch.autograd.DeviceType.CUDA and e.time_range.end > lo and e.time_range.start < hi]
    inside.sort(key=lambda item: (-item[0], item[1]))
    return [{"name": name, "ms": us / 1e3} for us, _, name in inside[:top]]


def make_requests(args: argparse.Namespace, vocab_size: int) -> list[p.TokenizedRequest]:
    """--num-requests random prompts (seeded: every run gets the same ones)."""
    gen = torch.Generator().manual_seed(1)
    sampling = p.SamplingParams(temperature=args.temperature, max_new_tokens=args.output_len, ignore_eos=True)
    now = time.time()
    return [
        p.TokenizedRequest(f"r{i}", torch.randint(0, vocab_size, (args.input_len,), generator=gen).tolist(),
                           sampling, now)
        for i in range(args.num_requests)
    ]  # fmt: skip


def drive_sequential(scheduler: Scheduler, runner: Any, outcome: Outcome) -> None:
    """Each step start to end: plan, execute (tokens back on the host), process the result."""
    started = time.perf_counter()
    while scheduler.has_work():
        plan = _next_plan(scheduler)
        outcome.steps += 1
        if outcome.profile is not None:
            outcome.profile.at_step(outcome.steps)
        outcome.take(scheduler.process_result(runner.execute(plan)))
        started = outcome.timed(step_kind(plan), started)
        outcome.note(scheduler)


def drive_overlapped(scheduler: Scheduler, runner: Any, outcome: Outcome) -> None:
    """The appliance's overlap in one process: the scheduler process's loop (plan while fewer than
    MAX_INFLIGHT_STEPS are out, then process the oldest result) around the worker's StepPipeline
    (launch a plan, then finish the step before it), with a list in place of the sockets."""
    results: deque[p.StepResult] = deque()
    kinds: deque[str] = deque()  # of the steps launched and not yet processed, oldest first
    pipeline = StepPipeline(runner, results.append)
    started = time.perf_counter()
    while scheduler.has_work() or scheduler.num_inflight_steps:
        while scheduler.num_inflight_steps < MAX_INFLIGHT_STEPS:
            plan = scheduler.schedule()
            if plan is None:
                break
            outcome.steps += 1
            if outcome.profile is not None:
                outcome.profile.at_step(outcome.steps)
            pipeline.launch(plan)  # finishes the step before it: its result lands in `results`
            kinds.append(step_kind(plan))
        if not results:
            if pipeline.inflight is None:
                raise RuntimeError(_STALLED)
            pipeline.complete()  # nothing more to plan until the step in flight is back
        while results:
            outcome.take(scheduler.process_result(results.popleft()))
            started = outcome.timed(kinds.popleft(), started)
        outcome.note(scheduler)


_STALLED = "the scheduler has work but planned no step and none is in flight"


def _next_plan(scheduler: Scheduler) -> p.StepPlan:
    plan = scheduler.schedule()
    if plan is None:
        raise RuntimeError(_STALLED)
    return plan


DRIVERS: dict[bool, Callable[[Scheduler, Any, Outcome], None]] = {
    True: drive_overlapped,
    False: drive_sequential,
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    started = time.perf_counter()
    settings = runner_settings(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or args.input_len + args.output_len,
        chunked_prefill_size=args.chunked_prefill_size,
        max_queued_requests=max(args.num_requests, 1),  # all are queued at once: none may be refused
    )
    runner = make_runner(settings, device, args.tensor_parallel_size)
    device = runner.device  # with its index
    ready = runner.ready_message()
    ready_s = time.perf_counter() - started
    scheduler = Scheduler(SchedulerConfig.from_settings(settings, ready))
    for request in make_requests(args, runner.vocab_size):
        scheduler.add_request(request)
    overlap = not args.no_overlap
    sync(device)
    outcome = Outcome(report_every=args.progress_every)
    if args.profile_steps:
        first, count = (int(x) for x in args.profile_steps.split(":"))
        outcome.profile = StepProfiler(first, count)
    t0 = time.perf_counter()
    with torch.inference_mode():  # as the worker process runs its steps
        DRIVERS[overlap](scheduler, runner, outcome)
    sync(device)
    elapsed = time.perf_counter() - t0
    close_runner(runner)
    return {
        "model": args.model,
        "attention_backend": runner.attention_backend_name,
        "cuda_graphs": runner.graphs is not None,
        "overlap": overlap,
        "num_requests": args.num_requests,
        "finished": outcome.finished,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "tensor_parallel_size": tp_size(runner),
        "chunked_prefill_size": args.chunked_prefill_size,
        "weights_gb": runner.weights_bytes / 1e9,
        **runner_figures(runner, args),
        "start_to_ready_s": ready_s,
        "elapsed_s": elapsed,
        "steps": outcome.steps,
        "mean_step_ms": elapsed * 1e3 / max(outcome.steps, 1),
        "max_running": outcome.max_running,
        "preemptions": scheduler.num_preemptions,
        "output_tokens": outcome.output_tokens,
        "output_tokens_per_s": outcome.output_tokens / elapsed,
        "total_tokens_per_s": (outcome.output_tokens + args.num_requests * args.input_len) / elapsed,
        "requests_per_s": outcome.finished / elapsed,
        "output_sha256": outcome.digest(),
        "step_kinds": {kind: {"steps": n, "seconds": sec, "mean_ms": sec * 1e3 / n}
                       for kind, (n, sec) in outcome.kinds.items()},
        **({"profile": outcome.profile.report()} if outcome.profile is not None else {}),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_flags(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="run each step start to end (no step in flight while planning)",
    )
    parser.add_argument(
        "--profile-steps",
        default="",
        help="FIRST:COUNT: profile steps FIRST.. FIRST+COUNT-1 with torch.profiler (CUDA): GPU time per "
        "kernel and the GPU's busy share of that window",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=30.0,
        help="seconds between progress lines on stderr (0: none)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    emit(run(args), args)


if __name__ == "__main__":
    main()
