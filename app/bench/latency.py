#!/usr/bin/env python3
"""Fixed-batch latency of the model runner, in process (no scheduler, no HTTP).

B random prompts of --input-len tokens are prefilled (in plans of at most --chunked-prefill-size
tokens), then decoded for --output-len - 1 steps, all greedy. Reported: start-to-ready seconds,
prefill time, per-step decode wall time (the first half of the steps one at a time, ModelRunner.execute:
host work and sampling included, none hidden; median, p90, mean), the batch's decode tokens/s from the
median, the mean step of the second half pipelined as the worker serves a GPU (step N + 1 launched
before step N's tokens are read, so the host's work hides under the device's), and, with CUDA graphs,
the graph replay alone timed with CUDA events (the GPU-side step). On CUDA the copy bandwidth (bytes/s, read +
write) is measured in the same process (or given by --copy-bandwidth) for the weight-read roofline
(bandwidth / weight bytes steps per second) and the ratio of the measured step rate to it.
Also recorded: the precision (--quantization, --kv-cache-dtype, as given and as the worker describes
them) and the KV pool the runner sized (tokens and bytes); with --output-len 2 the run is little more
than a start-up, which is how the KV pool of one setting is read.

  tokenspeed bench latency --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16 --batch-size 1 --input-len 512 --output-len 128 --json out.json
  (FP8 weights quantized at load from the dummy bf16 ones, FP8 KV cache: add
      --quantization fp8 --kv-cache-dtype fp8_e4m3)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from app.config import Settings
from app.lifecycle import settle_heap
from app.protocol import NewSeq, SamplingParams, SeqChunk, StepPlan

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def runner_settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    """A validated Settings for the runner from the common benchmark flags."""
    fields: dict[str, Any] = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "block_size": args.block_size,
        "seed": 0,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_total_tokens": args.max_total_tokens,
        "enable_pdl": not args.no_pdl,
        "disable_custom_all_reduce": args.disable_custom_all_reduce,
    }
    if args.piecewise_cuda_graph_max_tokens is not None:
        fields["piecewise_cuda_graph_max_tokens"] = args.piecewise_cuda_graph_max_tokens
    if args.attention_backend:
        fields["attention_backend"] = args.attention_backend
    if args.max_model_len:
        fields["max_model_len"] = args.max_model_len
    if args.max_cudagraph_capture_size:
        fields["max_cudagraph_capture_size"] = args.max_cudagraph_capture_size
    fields.update(overrides)
    return Settings(**fields)


def runner_figures(runner: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What the runner built, for the JSON: the precision flags as given and as the worker describes
    them, and the KV pool (tokens and bytes: an FP8 cache holds twice the tokens of bf16 in the same
    bytes)."""
    info = runner.ready_message().info
    return {
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "weights_detail": info.quantization,
        "kv_cache_detail": info.kv_cache_dtype,
        "kv_pool_tokens": info.kv_pool_tokens,
        "kv_pool_bytes": runner.kv_cache.nbytes,  # the pool plus the CUDA-graph scratch block
        "kv_bytes_per_token": runner.model.kv_cache_spec(runner.kv_dtype).bytes_per_token,
        "max_total_tokens": args.max_total_tokens,
        "cuda_graph_sizes": info.cuda_graph_sizes,
        "piecewise_graph_sizes": info.piecewise_graph_sizes,
        "pdl": info.pdl,
        "startup_phases_s": info.startup_phases,
    }


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model dir (config.json; weights unless dummy)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--quantization",
        default=None,
        help="weight quantization (fp8, w8a8_fp8, ...); default: the checkpoint's",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8_e4m3 (alias fp8)"
    )
    parser.add_argument("--max-total-tokens", type=int, default=None, help="cap the KV pool (tokens)")
    parser.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        default=None,
        help="largest decode batch captured (default 256)",
    )
    parser.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                        help="largest prefill or mixed step run as CUDA graph pieces (0: all eager; default: the "
                             "appliance's)")  # fmt: skip
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="TP ranks (rank 0 here, the rest spawned; next GPUs)"
    )
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="with --tensor-parallel-size > 1: every all-reduce on NCCL (default: the small ones "
                             "as one kernel over peer memory)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch the decode kernels plainly (default: programmatic dependent launch where the GPU has it)")  # fmt: skip


def make_runner(settings: Settings, device: torch.device, tensor_parallel_size: int = 1) -> Any:
    """A warmed-up ModelRunner, or with TP > 1 rank 0's (the other ranks in spawned processes, on the next
    GPUs; app/worker/tp_group.py). Its weights_bytes are one rank's share. The heap is then settled as the
    worker process settles its own once ready: unfrozen, the collector's full passes over the model's
    objects stall the timed steps."""
    if tensor_parallel_size > 1:
        from app.worker.tp_group import start_tp_group

        runner = start_tp_group(settings, device, tensor_parallel_size)
    else:
        from app.worker.model_runner import ModelRunner

        runner = ModelRunner(settings, device)
        runner.warmup()
    settle_heap()
    return runner


def one_at_a_time(runner: Any, chunk_tokens: int, num_speculative_tokens: int = 0) -> Any:
    """A Scheduler over the runner's pool that runs one sequence at a time (the benchmarks of one stream),
    its counters started."""
    from app.scheduler.scheduler import Scheduler, SchedulerConfig

    ready = runner.ready_message()
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=ready.num_blocks, block_size=ready.block_size, max_model_len=ready.max_model_len, max_num_seqs=1,
        chunked_prefill_size=chunk_tokens, max_prefill_tokens=chunk_tokens, enable_prefix_caching=False,
        eos_token_ids=tuple(ready.eos_token_ids), num_speculative_tokens=num_speculative_tokens))
    scheduler.take_counters()
    return scheduler


def tp_size(runner: Any) -> int:
    return runner.tp.size


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the result as JSON and write it to --json. A TP leader on CUDA cannot destroy its NCCL
    group once graphs captured it (app/worker/parallel.py): it then leaves without the interpreter's
    teardown, the results written."""
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.tensor_parallel_size > 1:
        os._exit(0)


def close_runner(runner: Any) -> None:
    if hasattr(runner, "close"):  # a TP group's leader: stop the other ranks
        runner.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "p50": statistics.median(values),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_cuda_ms(fn: Any, iters: int) -> float:
    """Median ms of fn() over iters runs, each timed with CUDA events on the current stream."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_replay(runner: Any, batch: int, iters: int = 50) -> float | None:
    """Median ms of one replay of the batch's captured graph (its inputs as the last step left them)."""
    graphs = runner.graphs
    size = graphs.size_for(batch) if graphs is not None else None
    if size is None:
        return None
    return median_cuda_ms(graphs.graphs[size].graph.replay, iters)


def copy_bandwidth(device: torch.device, iters: int = 10) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median): the roofline's
    denominator, measured in the same process as the benchmark it judges."""
    src = torch.randn(1 << 29, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * src.element_size() / (median_cuda_ms(lambda: dst.copy_(src), iters) / 1e3)


def read_bandwidth(device: torch.device, iters: int = 10) -> float:
    """Bytes read per second by torch's sum over 2 GiB (median): what a kernel that only reads can reach."""
    x = torch.randn(1 << 29, device=device)
    x.sum()
    return x.numel() * x.element_size() / (median_cuda_ms(x.sum, iters) / 1e3)


def prefill(runner: Any, seqs: list[NewSeq], prompts: list[list[int]], per_plan: int, last: bool) -> tuple[float, float]:
    """Prefill every prompt, per_plan sequences a step; (total ms, ms the host spent queuing the steps'
    device work). Unless last, the slots are released afterwards for the next repetition."""
    device = runner.device
    sync(device)
    t0 = time.perf_counter()
    queued = 0.0
    for first in range(0, len(seqs), per_plan):
        group = seqs[first : first + per_plan]
        t1 = time.perf_counter()
        pending = runner.launch(
            StepPlan(step=0, new_seqs=group, chunks=[SeqChunk(s.slot, prompts[s.slot]) for s in group])
        )
        queued += time.perf_counter() - t1
        runner.finish(pending)
    sync(device)
    total = time.perf_counter() - t0
    if not last:
        runner.execute(StepPlan(step=0, free_slots=[s.slot for s in seqs]))
    return total * 1e3, queued * 1e3


def pipelined_step_ms(runner: Any, plan: StepPlan, steps: int) -> float | None:
    """Mean ms a step over `steps` decode steps, each launched before the one before it is finished (the
    worker's overlap); None for fewer than two."""
    if steps < 2:
        return None
    t0 = time.perf_counter()
    pending = runner.launch(plan)
    for _ in range(steps - 1):
        launched = runner.launch(plan)
        runner.finish(pending)
        pending = launched
    runner.finish(pending)
    return (time.perf_counter() - t0) * 1e3 / steps


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    device = torch.device(args.device)
    need = args.input_len + args.output_len
    settings = runner_settings(
        args,
        max_num_seqs=args.batch_size,
        max_model_len=args.max_model_len or need,
        chunked_prefill_size=max(args.chunked_prefill_size, args.input_len),
    )
    runner = make_runner(settings, device, args.tensor_parallel_size)
    device = runner.device  # with its index
    ready_s = time.perf_counter() - started
    blocks = math.ceil(need / runner.block_size)
    if blocks * args.batch_size > runner.pool.num_blocks:
        raise SystemExit(
            f"the KV pool holds {runner.pool.num_blocks} blocks; the batch needs {blocks * args.batch_size}"
        )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, runner.vocab_size, (args.batch_size, args.input_len), generator=gen).tolist()
    seqs = [
        NewSeq(b, f"r{b}", GREEDY, args.input_len, list(range(b * blocks, (b + 1) * blocks)), prompt_ids=p)
        for b, p in enumerate(prompts)
    ]
    per_plan = max(1, settings.chunked_prefill_size // args.input_len)
    prefills = [prefill(runner, seqs, prompts, per_plan, last=rep == args.prefill_reps - 1)
                for rep in range(args.prefill_reps)]  # fmt: skip
    prefill_ms = statistics.median(total for total, _ in prefills)
    prefill_queued_ms = statistics.median(queued for _, queued in prefills)
    decode_plan = StepPlan(step=1, chunks=[SeqChunk(b) for b in range(args.batch_size)])
    steps = args.output_len - 1
    step_ms = []
    for _ in range(steps - steps // 2):
        t0 = time.perf_counter()
        runner.execute(decode_plan)  # returns after the sampled ids reached the host
        step_ms.append((time.perf_counter() - t0) * 1e3)
    measured = step_ms[args.warmup_steps :] or step_ms
    stats = summary(measured)
    pipelined_ms = pipelined_step_ms(runner, decode_plan, steps // 2)
    # A TP graph's all-reduces wait for every rank: replaying rank 0's alone would hang.
    replay_ms = time_graph_replay(runner, args.batch_size) if device.type == "cuda" and tp_size(runner) == 1 else None
    close_runner(runner)
    result: dict[str, Any] = {
        "model": args.model,
        "attention_backend": runner.attention_backend_name,
        "cuda_graphs": runner.graphs is not None,
        "batch_size": args.batch_size,
        "tensor_parallel_size": tp_size(runner),
        "all_reduce": runner.tp.all_reduce_path,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "weights_gb": runner.weights_bytes / 1e9,
        **runner_figures(runner, args),
        "start_to_ready_s": ready_s,
        "prefill_ms": prefill_ms,
        # Host time to queue the prefill's device work: near prefill_ms, the host bounds the prefill.
        "prefill_queued_ms": prefill_queued_ms,
        "decode_step_ms": stats,
        "decode_tokens_per_s": args.batch_size * 1e3 / stats["p50"],
        "pipelined_step_ms": pipelined_ms,
        "pipelined_tokens_per_s": args.batch_size * 1e3 / pipelined_ms if pipelined_ms else None,
        "graph_replay_ms": replay_ms,
        "graph_tokens_per_s": args.batch_size * 1e3 / replay_ms if replay_ms else None,
    }
    bandwidth = args.copy_bandwidth or (copy_bandwidth(device) if device.type == "cuda" else None)
    if bandwidth:
        # Steps/s if a step only read the weights once at copy speed; the ratio compares step times.
        roofline = bandwidth / runner.weights_bytes
        result["copy_bandwidth_bytes_per_s"] = bandwidth
        result["roofline_tokens_per_s_batch1"] = roofline
        result["ratio_to_roofline"] = result["decode_tokens_per_s"] / (roofline * args.batch_size)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_flags(parser)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--chunked-prefill-size", type=int, default=8192)
    parser.add_argument("--warmup-steps", type=int, default=5, help="decode steps left out of the statistics")
    parser.add_argument("--prefill-reps", type=int, default=3, help="prefills timed (the median is reported)")
    parser.add_argument(
        "--copy-bandwidth", type=float, default=None, help="bytes/s (read + write); default: measure"
    )
    args = parser.parse_args(argv)
    emit(run(args), args)


if __name__ == "__main__":
    main()
