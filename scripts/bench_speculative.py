"""Speculative decoding's speed-up at one stream: the same greedy request with and without NGRAM.

The request is a code edit whose answer repeats its prompt (a ~40-line Python file, "rename a variable
and return the whole file"), the case prompt lookup is for. Each round runs the request once without
and once with speculation (alternating, so that a busy machine hurts both alike), in one process: the
real Scheduler and a ModelRunner each, the plain engine with two steps in flight as the appliance
runs it, the speculating one with one (docs/speculative.md). Prints a table and writes JSON with the
output tokens/s of each (wall clock, and per CPU second of the process: with one torch thread that
counts the work alone, whatever else the machine runs), their ratios, the acceptance, and whether the outputs were equal (greedy:
they must be).

    python scripts/bench_speculative.py [--model DIR] [--rounds 3] [--max-new-tokens 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from app import protocol as p
from app.bench.latency import one_at_a_time
from app.scheduler.process import MAX_INFLIGHT_STEPS
from app.worker.model_runner import ModelRunner
from app.worker.process import StepPipeline

DEFAULT_MODEL = Path.home() / ".cache/tokenspeed/models/smollm2-135m-instruct"

SOURCE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    count: int


def load_items(path):
    with open(path) as handle:
        data = json.load(handle)
    items = []
    for entry in data:
        items.append(Item(entry["name"], entry["price"], entry["count"]))
    return items


def total_price(items):
    result = 0.0
    for item in items:
        result = result + item.price * item.count
    return result


def most_expensive(items):
    best = None
    for item in items:
        if best is None or item.price > best.price:
            best = item
    return best


def main(path):
    items = load_items(path)
    result = total_price(items)
    print("total:", result)
    print("most expensive:", most_expensive(items).name)
'''
INSTRUCTION = "Rename the variable `result` to `total` everywhere in this Python file and return the whole file."


def settings_for(args: argparse.Namespace, spec: bool) -> Any:
    from app.config import Settings

    fields: dict[str, Any] = {"model": str(args.model), "dtype": args.dtype, "max_num_seqs": 1,
                              "max_model_len": 2048, "max_total_tokens": 4096, "block_size": 16, "seed": 0}
    if spec:
        fields |= {"speculative_algorithm": "NGRAM", "speculative_num_steps": args.num_steps}
    return Settings(**fields)


def prompt_ids(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    message = f"{INSTRUCTION}\n\n```python\n{SOURCE}```"
    text = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def generate(runner: ModelRunner, prompt: list[int], max_new: int, spec_k: int) -> dict[str, Any]:
    """One request start to end, driven as the appliance's scheduler loop drives it."""
    scheduler = one_at_a_time(runner, 2048, spec_k)
    scheduler.add_request(p.TokenizedRequest("bench", prompt, p.SamplingParams(max_new_tokens=max_new, temperature=0)))
    depth = 1 if spec_k else MAX_INFLIGHT_STEPS
    results: deque[p.StepResult] = deque()
    pipeline = StepPipeline(runner, results.append)
    output: list[int] = []
    first_token = None
    started, cpu_started = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        while scheduler.has_work() or scheduler.num_inflight_steps:
            while scheduler.num_inflight_steps < depth and (plan := scheduler.schedule()) is not None:
                pipeline.launch(plan)
            if not results:
                pipeline.complete()
            while results:
                for delta in scheduler.process_result(results.popleft()):
                    output += delta.token_ids
                    first_token = first_token or time.perf_counter()
    ended, cpu_s = time.perf_counter(), time.process_time() - cpu_started
    counters = scheduler.take_counters()
    decode_s = ended - (first_token or ended)
    return {
        "output_ids": output,
        "output_tokens": len(output),
        "seconds": ended - started,
        "tokens_per_s": len(output) / (ended - started),
        "decode_tokens_per_s": (len(output) - 1) / decode_s if decode_s > 0 else 0.0,
        "tokens_per_cpu_s": len(output) / cpu_s,
        "verify_steps": counters.spec_drafts,
        "draft_tokens": counters.spec_draft_tokens,
        "accepted_tokens": counters.spec_accepted_tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR", DEFAULT_MODEL)))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--num-steps", type=int, default=4, help="--speculative-num-steps")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (0: torch's default); with 1, CPU seconds measure the work alone")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt = prompt_ids(args.model)
    runners = {k: ModelRunner(settings_for(args, bool(k)), torch.device("cpu")) for k in (0, args.num_steps)}
    runs: dict[int, list[dict[str, Any]]] = {0: [], args.num_steps: []}
    for _ in range(args.rounds):
        for k, runner in runners.items():
            runs[k].append(generate(runner, prompt, args.max_new_tokens, k))
    plain, spec = runs[0], runs[args.num_steps]
    plain_tps = statistics.median(r["tokens_per_s"] for r in plain)
    spec_tps = statistics.median(r["tokens_per_s"] for r in spec)
    plain_cpu = statistics.median(r["tokens_per_cpu_s"] for r in plain)
    spec_cpu = statistics.median(r["tokens_per_cpu_s"] for r in spec)
    drafted = sum(r["draft_tokens"] for r in spec)
    accepted = sum(r["accepted_tokens"] for r in spec)
    report = {
        "model": str(args.model), "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prompt_tokens": len(prompt), "output_tokens": plain[0]["output_tokens"], "rounds": args.rounds,
        "num_steps": args.num_steps,
        "plain_tokens_per_s": [round(r["tokens_per_s"], 2) for r in plain],
        "ngram_tokens_per_s": [round(r["tokens_per_s"], 2) for r in spec],
        "plain_median": round(plain_tps, 2), "ngram_median": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 2),
        "plain_tokens_per_cpu_s": round(plain_cpu, 2), "ngram_tokens_per_cpu_s": round(spec_cpu, 2),
        "speedup_cpu_time": round(spec_cpu / plain_cpu, 2),
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "acceptance_length": round(1 + accepted / sum(r["verify_steps"] for r in spec), 2) if drafted else 1.0,
        "outputs_equal": all(r["output_ids"] == plain[0]["output_ids"] for r in plain + spec),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(f"{'':8} {'tok/s (median)':>15} {'tok/CPU-s':>10} {'runs (tok/s)':>30}")
    print(f"{'plain':8} {plain_tps:15.2f} {plain_cpu:10.2f} {str(report['plain_tokens_per_s']):>30}")
    print(f"{'ngram':8} {spec_tps:15.2f} {spec_cpu:10.2f} {str(report['ngram_tokens_per_s']):>30}")
    print(f"speed-up {report['speedup']}x (CPU time: {report['speedup_cpu_time']}x); acceptance rate {report['acceptance_rate']}, length "
          f"{report['acceptance_length']}; outputs equal: {report['outputs_equal']}; {report['output_tokens']} "
          f"output tokens; load {report['load_avg_1m']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
