#!/usr/bin/env python3
"""Speculative decoding's verify cost: a step that verifies k + 1 positions of one sequence against a
plain decode step, at batch 1.

In process, the real Scheduler driving a ModelRunner (as `tokenspeed bench offline` does), one request of
--input-len random tokens decoding --steps steps, once without speculation (the decode step replays its
CUDA graph) and once with NGRAM and --num-steps k drafts a step (the verify row is an extend of k + 1
positions: a piecewise-graph step where the runner has them, else eager). Dummy weights cannot show real
acceptance, so the drafts are forced: the proposer is wrapped to always offer k tokens (the n-gram's
when it finds some, else the last token repeated), and every verify step runs its k + 1 positions.
Reported: the median ms of a whole step (plan, launch, forward, acceptance, read-back, result) of each
kind, their ratio (the issue's goal: <= 1.15x), and a projection of batch-1 tok/s at a given acceptance
length from those two measured costs (tokens a step / verify step time: the papers' way; a projection,
not a measurement). JSON goes to $OUT (or --json) and a table to stdout.

  python scripts/gpu/bench_speculative.py --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16
  (CPU check: --model <a tiny model dir> --device cpu --steps 8 --input-len 32)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app import protocol as p  # noqa: E402
from app.bench.latency import (  # noqa: E402
    add_common_flags,
    close_runner,
    make_runner,
    one_at_a_time,
    runner_settings,
    sync,
)
from app.worker.spec.proposer import Draft, Proposer, TargetStep  # noqa: E402


class ForcedDrafts(Proposer):
    """Wraps a proposer so that every slot gets k drafts (its own, padded with the last token)."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.last: dict[int, int] = {}

    def register(self, slot: int, token_ids: list[int]) -> None:
        self.last[slot] = token_ids[-1]
        self.inner.register(slot, token_ids)

    def release(self, slot: int) -> None:
        self.last.pop(slot, None)
        self.inner.release(slot)

    def observe(self, step: TargetStep) -> None:
        for slot, tokens in zip(step.slots, step.new_tokens, strict=True):
            if tokens:
                self.last[slot] = tokens[-1]
        self.inner.observe(step)

    def propose(self, slots: list[int], k: int) -> Draft:
        draft = self.inner.propose(slots, k)
        ids = draft.token_ids.clone()
        for row, slot in enumerate(slots):
            ids[row, draft.length(row):] = self.last[slot]
        return Draft(ids, None, [k] * len(slots))


def timed_steps(runner: Any, args: argparse.Namespace, k: int) -> dict[str, Any]:
    """One request decoded step by step; per-step wall ms (device synchronised) by kind."""
    scheduler = one_at_a_time(runner, 8192, k)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, runner.vocab_size, (args.input_len,), generator=gen).tolist()
    max_new = (args.steps + args.warmup_steps + 2) * (k + 1)
    sampling = p.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    scheduler.add_request(p.TokenizedRequest("bench", prompt, sampling))
    times: dict[str, list[float]] = {"decode": [], "verify": [], "other": []}
    tokens = 0
    for i in range(args.steps + args.warmup_steps + 1):
        sync(runner.device)
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        assert plan is not None
        result = runner.execute(plan)
        deltas = scheduler.process_result(result)
        sync(runner.device)
        ms = (time.perf_counter() - t0) * 1e3
        chunk = plan.chunks[0]
        kind = "other" if chunk.token_ids and not result.draft_counts else (
            "verify" if any(result.draft_counts) else "decode")
        if i > args.warmup_steps:  # the prefill and the first steps are left out
            times[kind].append(ms)
            tokens += sum(len(d.token_ids) for d in deltas)
    counters = scheduler.take_counters()
    return {"times": times, "tokens": tokens, "drafts": counters.spec_draft_tokens,
            "accepted": counters.spec_accepted_tokens}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_flags(parser)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50, help="timed steps of each kind")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--num-steps", type=int, default=3, help="k: draft tokens a verify step checks")
    parser.add_argument("--acceptance-length", type=float, default=3.5,
                        help="tokens a verify step gives, for the projection")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    need = args.input_len + (args.steps + args.warmup_steps + 2) * (args.num_steps + 1) + 8
    need = -(-need // args.block_size) * args.block_size  # whole blocks: the CPU pool is seqs x max_model_len
    results: dict[str, Any] = {}
    for k in (0, args.num_steps):
        extra = {"speculative_algorithm": "NGRAM", "speculative_num_steps": k} if k else {}
        settings = runner_settings(args, max_num_seqs=1, max_model_len=args.max_model_len or need,
                                   chunked_prefill_size=max(8192, args.input_len), **extra)
        runner = make_runner(settings, device)
        if k:
            runner.spec.proposer = ForcedDrafts(runner.spec.proposer)
        with torch.inference_mode():
            results[k] = timed_steps(runner, args, k)
        results[k]["cuda_graphs"] = runner.graphs is not None
        results[k]["piecewise_graphs"] = runner.pieces is not None
        close_runner(runner)
        del runner  # the next runner sizes its pool from the free memory: this one's must be gone
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    decode_ms = statistics.median(results[0]["times"]["decode"])
    verify_ms = statistics.median(results[args.num_steps]["times"]["verify"])
    ratio = verify_ms / decode_ms
    report = {
        "model": args.model, "device": str(device), "dtype": args.dtype, "input_len": args.input_len,
        "k": args.num_steps, "positions_verified": args.num_steps + 1, "steps": args.steps,
        "decode_step_ms": round(decode_ms, 4), "verify_step_ms": round(verify_ms, 4),
        "verify_over_decode": round(ratio, 4), "goal_verify_over_decode": 1.15,
        "decode_tok_s": round(1e3 / decode_ms, 1),
        "projection_acceptance_length": args.acceptance_length,
        "projected_tok_s": round(args.acceptance_length * 1e3 / verify_ms, 1),
        "decode_graph": results[0]["cuda_graphs"], "verify_piecewise_graph": results[args.num_steps]["piecewise_graphs"],
        "decode_ms_all": [round(x, 4) for x in results[0]["times"]["decode"]],
        "verify_ms_all": [round(x, 4) for x in results[args.num_steps]["times"]["verify"]],
        "dummy_acceptance": {"drafts": results[args.num_steps]["drafts"],
                             "accepted": results[args.num_steps]["accepted"]},
    }
    print(f"{'step':28} {'median ms':>10}")
    print(f"{'decode (1 position)':28} {decode_ms:10.3f}")
    print(f"{f'verify ({args.num_steps + 1} positions)':28} {verify_ms:10.3f}")
    print(f"verify / decode = {ratio:.3f} (goal <= 1.15); projected at acceptance length {args.acceptance_length}: "
          f"{report['projected_tok_s']} tok/s (decode alone {report['decode_tok_s']})")
    out = args.json or (os.path.join(os.environ["OUT"], "bench_speculative.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
