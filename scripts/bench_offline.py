#!/usr/bin/env python3
"""Offline throughput, in process: the real Scheduler drives a ModelRunner directly (no HTTP, no IPC).

N requests of --input-len random prompt tokens and exactly --output-len new tokens (ignore_eos) are
queued at once; the loop plans, executes and feeds results back until all finish. Reported: output
and total tokens/s, requests/s, steps and mean step time.

  python scripts/bench_offline.py --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16 --num-requests 256 --input-len 512 --output-len 256 --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_latency import add_common_flags, runner_settings, sync  # noqa: E402

from app import protocol as p  # noqa: E402
from app.scheduler.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    from app.worker.model_runner import ModelRunner

    device = torch.device(args.device)
    started = time.perf_counter()
    settings = runner_settings(
        args,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or args.input_len + args.output_len,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    runner = ModelRunner(settings, device)
    device = runner.device  # with its index
    runner.warmup()
    ready = runner.ready_message()
    ready_s = time.perf_counter() - started
    scheduler = Scheduler(SchedulerConfig.from_settings(settings, ready))
    gen = torch.Generator().manual_seed(1)
    sampling = p.SamplingParams(temperature=args.temperature, max_new_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        prompt = torch.randint(0, runner.vocab_size, (args.input_len,), generator=gen).tolist()
        scheduler.add_request(p.TokenizedRequest(f"r{i}", prompt, sampling, time.time()))
    sync(device)
    t0 = time.perf_counter()
    steps, output_tokens, finished = 0, 0, 0
    while scheduler.has_work():
        plan = scheduler.schedule()
        if plan is None:
            continue
        result = runner.execute(plan)
        steps += 1
        for delta in scheduler.process_result(result):
            output_tokens += len(delta.token_ids)
            finished += delta.finish_reason is not None
    sync(device)
    elapsed = time.perf_counter() - t0
    return {
        "model": args.model,
        "attention_backend": runner.attention_backend_name,
        "cuda_graphs": runner.graphs is not None,
        "num_requests": args.num_requests,
        "finished": finished,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_pool_tokens": ready.info["kv_pool_tokens"],
        "start_to_ready_s": ready_s,
        "elapsed_s": elapsed,
        "steps": steps,
        "mean_step_ms": elapsed * 1e3 / max(steps, 1),
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + args.num_requests * args.input_len) / elapsed,
        "requests_per_s": finished / elapsed,
    }


def main(argv: list[str] | None = None) -> None:
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
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
