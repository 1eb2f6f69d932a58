#!/usr/bin/env python3
"""GPU idle time between decode steps: the worker's pipelined serve path against plain execute.

For each batch size B and sampling mode, B sequences of --input-len random tokens are prefilled, then
--steps decode steps (after --warmup-steps) run twice on fresh sequences:
  plain      ModelRunner.execute per step: step N's tokens are read back before step N+1 is launched;
  pipelined  the serve path's StepPipeline (app/worker/process.py), plans fed from a list, no sockets:
             step N+1 is launched before step N's tokens are read back.
Each step's device work is bracketed by CUDA events recorded as launch() starts and once it has queued
the readback. On the GPU's clock, busy = the sum of those spans, idle = the gaps between one step's
end and the next one's start, and the idle fraction = idle / (last end - first start): the time the
GPU waited for the host between steps (gaps inside a step, which only the unpipelined path has, count
as busy: the figure for plain execute is a lower bound). With --profile, the measured steps run again
under torch.profiler and the union of kernel and copy intervals gives the GPU busy fraction including
those gaps. Also reported: host wall time per step and the captured graph's replay alone.

  python scripts/gpu/gpu_idle.py --json out.json     (Llama-3.1-8B shape, dummy bf16 weights, triton)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from app.bench.latency import time_graph_replay as graph_replay_ms  # noqa: E402
from app.config import Settings  # noqa: E402
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan, StepResult  # noqa: E402
from app.worker.process import StepPipeline  # noqa: E402

SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),  # the sampler's one sync (truncation.py)
    "logprobs": SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
}
MODES = ("plain", "pipelined")


class TimedRunner:
    """A ModelRunner whose launches are bracketed by CUDA timing events (one (start, end) pair each)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def launch(self, plan: StepPlan) -> Any:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        pending = self.runner.launch(plan)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.spans.append((start, end))
        return pending

    def finish(self, pending: Any) -> StepResult:
        return self.runner.finish(pending)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))


def runner_settings(args: argparse.Namespace) -> Settings:
    """The runner's settings: graphs captured at exactly the batch sizes measured."""
    need = args.input_len + args.warmup_steps + args.steps + 1
    return Settings(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len or need,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(args.batch_sizes),
        chunked_prefill_size=args.chunked_prefill_size, max_prefill_tokens=args.chunked_prefill_size,
        block_size=args.block_size, attention_backend=args.attention_backend, seed=0,
        cudagraph_capture_sizes=list(args.batch_sizes),
    )  # fmt: skip


def decode_plans(
    runner: Any, batch: int, steps: int, input_len: int, params: SamplingParams
) -> list[StepPlan]:
    """Register and prefill `batch` fresh sequences (run here), then the decode plans; the last frees them."""
    per_seq = math.ceil((input_len + steps + 1) / runner.block_size)
    if per_seq * batch > runner.pool.num_blocks:
        raise SystemExit(
            f"the KV pool holds {runner.pool.num_blocks} blocks; the batch needs {per_seq * batch}"
        )
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, runner.vocab_size, (batch, input_len), generator=gen).tolist()
    seqs = [NewSeq(b, f"r{b}", params, input_len, list(range(b * per_seq, (b + 1) * per_seq)), prompt_ids=p)
            for b, p in enumerate(prompts)]  # fmt: skip
    per_plan = max(1, runner.settings.chunked_prefill_size // input_len)
    for first in range(0, batch, per_plan):
        group = seqs[first : first + per_plan]
        runner.execute(StepPlan(-1, group, [SeqChunk(s.slot, prompts[s.slot]) for s in group]))
    plans = [StepPlan(step, chunks=[SeqChunk(b) for b in range(batch)]) for step in range(steps)]
    plans[-1].free_slots = list(range(batch))
    return plans


def run_mode(runner: Any, mode: str, plans: list[StepPlan]) -> tuple[TimedRunner, list[StepResult], float]:
    """Run the plans one way; returns the timed runner, the results and the host seconds per step."""
    timed = TimedRunner(runner)
    results: list[StepResult] = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    if mode == "plain":
        results = [timed.execute(plan) for plan in plans]
    else:
        pipeline = StepPipeline(timed, results.append)
        for plan in plans:
            pipeline.launch(plan)
        pipeline.complete()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) / len(plans)
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{mode}: a step failed: {errors[0]}")
    return timed, results, wall


def event_figures(spans: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> dict[str, float]:
    """Busy and idle time of the GPU over the spans, from the events' timestamps (ms)."""
    busy = [start.elapsed_time(end) for start, end in spans]
    gaps = [max(end.elapsed_time(nxt), 0.0) for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False)]
    window = spans[0][0].elapsed_time(spans[-1][1])
    return {
        "gpu_step_ms": statistics.fmean(busy),
        "gap_ms_mean": statistics.fmean(gaps) if gaps else 0.0,
        "gap_ms_max": max(gaps, default=0.0),
        "idle_fraction": sum(gaps) / window if window > 0 else 0.0,
    }


def profiled_busy_fraction(runner: Any, mode: str, plans: list[StepPlan]) -> float:
    """The fraction of the run's GPU window covered by kernels and copies, from a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_mode(runner, mode, plans)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not spans:
        return float("nan")
    covered, reach = 0.0, spans[0][0]
    for lo, hi in spans:  # the union of the intervals
        covered += max(hi - max(lo, reach), 0.0)
        reach = max(reach, hi)
    return covered / (reach - spans[0][0])


def measure(runner: Any, batch: int, sampling: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both modes at one batch size and sampling mode; the same tokens are checked where they must be."""
    rows, tokens = [], {}
    total = args.warmup_steps + args.steps
    for mode in MODES:
        plans = decode_plans(runner, batch, total, args.input_len, SAMPLINGS[sampling])
        timed, results, wall = run_mode(runner, mode, plans)
        tokens[mode] = [r.token_ids for r in results]
        row = {"batch": batch, "sampling": sampling, "mode": mode, "steps": args.steps,
               "wall_ms_per_step": wall * 1e3, **event_figures(timed.spans[args.warmup_steps :])}  # fmt: skip
        if args.profile:
            plans = decode_plans(runner, batch, total, args.input_len, SAMPLINGS[sampling])
            row["profiled_busy_fraction"] = profiled_busy_fraction(runner, mode, plans[args.warmup_steps :])
        rows.append(row)
    if SAMPLINGS[sampling].greedy or SAMPLINGS[sampling].seed is not None:
        rows[-1]["same_tokens_as_plain"] = tokens["plain"] == tokens["pipelined"]
    replay = graph_replay_ms(runner, batch)
    for row in rows:
        row["graph_replay_ms"] = replay
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from app.worker.model_runner import ModelRunner

    if not torch.cuda.is_available():
        raise SystemExit("gpu_idle.py measures CUDA steps: no CUDA device is visible")
    runner = ModelRunner(runner_settings(args), torch.device("cuda", 0))
    runner.warmup()
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            for sampling in args.samplings:
                rows += measure(runner, batch, sampling, args)
    return {
        "device": torch.cuda.get_device_name(runner.device),
        "torch": torch.__version__,
        "model": args.model,
        "attention_backend": runner.attention_backend_name,
        "cuda_graphs": runner.graphs is not None,
        "input_len": args.input_len,
        "results": rows,
    }


def table(result: dict[str, Any]) -> str:
    head = f"{'batch':>5} {'sampling':>11} {'mode':>9} {'wall ms':>8} {'GPU ms':>7} {'graph ms':>8} " \
           f"{'idle %':>7} {'max gap':>8} {'busy % (prof)':>13}"  # fmt: skip
    lines = [head]
    for r in result["results"]:
        graph = f"{r['graph_replay_ms']:.3f}" if r["graph_replay_ms"] is not None else "-"
        prof = f"{100 * r['profiled_busy_fraction']:.1f}" if "profiled_busy_fraction" in r else "-"
        lines.append(
            f"{r['batch']:>5} {r['sampling']:>11} {r['mode']:>9} {r['wall_ms_per_step']:>8.3f} "
            f"{r['gpu_step_ms']:>7.3f} {graph:>8} {100 * r['idle_fraction']:>7.2f} {r['gap_ms_max']:>8.3f} {prof:>13}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(REPO / "configs/models/llama-3.1-8b"))
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--batch-sizes", type=lambda s: [int(b) for b in s.split(",")], default=[1, 64])
    parser.add_argument("--samplings", type=lambda s: s.split(","), default=["greedy", "top_k"],
                        help=f"comma-separated, of {', '.join(SAMPLINGS)}")  # fmt: skip
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--profile", action="store_true", help="also measure under torch.profiler")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    unknown = [s for s in args.samplings if s not in SAMPLINGS]
    if unknown:
        parser.error(f"unknown sampling mode(s) {unknown}; choose from {', '.join(SAMPLINGS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    print(table(result))


if __name__ == "__main__":
    main()
