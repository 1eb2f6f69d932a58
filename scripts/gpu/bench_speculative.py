#!/usr/bin/env python3
"""Speculative decoding's cost a step at batch 1: a step that verifies k + 1 positions of one sequence
against a plain decode step, and a whole EAGLE-3 round.

In process, the real Scheduler driving a ModelRunner (as `tokenspeed bench offline` does), one request of
--input-len random tokens decoding --steps steps: without speculation (the decode step replays its CUDA
graph), with NGRAM and --num-steps k drafts a step (the verify row's k + 1 positions replay the decode
graph of k + 1 rows where graphs are captured: app/worker/cuda_graphs.py), and with --eagle3, with an
EAGLE-3 head of the published layout for the target (dummy weights, --draft-vocab-size): a step there is
a whole round (the chain's drafts, the verify, the head's catch-up over the kept positions). Dummy
weights cannot show real acceptance, so NGRAM's drafts are forced: the proposer is wrapped to always
offer k tokens (the n-gram's when it finds some, else the last token repeated), and every verify step
runs its k + 1 positions; the head's chain always drafts k.
Reported: the median ms of a whole step (plan, launch, forward, acceptance, read-back, result) of each
kind, the verify's ratio to the decode step (the issue's goal: <= 1.15x), and the batch-1 tok/s
projected at a given acceptance length from the measured round (tokens a round / round time: the
papers' way; a projection, not a measurement). JSON goes to $OUT (or --json) and a table to stdout.

  python scripts/gpu/bench_speculative.py --model configs/models/llama-3.1-8b --load-format dummy \\
      --dtype bfloat16 --eagle3
  (CPU check: --model <a tiny model dir> --load-format dummy --device cpu --steps 8 --input-len 32
   [--eagle3 --draft-vocab-size 40])
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
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
    time_graph_replay,
)
from app.worker.loader import load_hf_config  # noqa: E402
from app.worker.spec.proposer import Draft, Proposer, TargetStep  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_eagle3 import head_config  # noqa: E402


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
    """One request decoded step by step; per-step wall ms (device synchronised) by kind, and how many
    steps replayed a decode graph with verify rows in it."""
    graphed = count_verify_replays(runner)
    scheduler = one_at_a_time(runner, 8192, k)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, runner.vocab_size, (args.input_len,), generator=gen).tolist()
    rounds = 2 if args.profile_host else 1  # the steps again under cProfile
    max_new = (rounds * args.steps + args.warmup_steps + 2) * (k + 1)
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
    result = {"times": times, "tokens": tokens, "drafts": counters.spec_draft_tokens,
              "accepted": counters.spec_accepted_tokens, "verify_in_decode_graph": graphed["steps"]}
    if args.profile_host:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            scheduler.process_result(runner.execute(scheduler.schedule()))
            sync(runner.device)
        profile.disable()
        result["host_profile"] = host_profile(profile)
    return result


def count_verify_replays(runner: Any) -> dict[str, int]:
    """Counts the decode-graph replays given their rows' tokens (steps with verify rows)."""
    counts = {"steps": 0}
    graphs = runner.graphs
    if graphs is None:
        return counts
    run = graphs.run

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts["steps"] += (len(args) > 4 and args[4] is not None) or kwargs.get("input_ids") is not None
        return run(*args, **kwargs)

    graphs.run = counting
    return counts


def host_profile(profile: Any, top: int = 30) -> list[str]:
    """The functions with the most cumulative host time in a cProfile run."""
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)  # where the host itself spends (waits show as such)
    return text.getvalue().splitlines()


def measure(args: argparse.Namespace, device: torch.device, method: str, k: int, **extra: Any) -> dict[str, Any]:
    """One runner (a plain one for k = 0), its steps timed, then freed: the next one sizes its pool
    from the free memory."""
    need = args.input_len + (2 * args.steps + args.warmup_steps + 2) * (args.num_steps + 1) + 8
    need = -(-need // args.block_size) * args.block_size  # whole blocks: the CPU pool is seqs x max_model_len
    spec = {"speculative_algorithm": method, "speculative_num_steps": k, **extra} if k else {}
    settings = runner_settings(args, max_num_seqs=1, max_model_len=args.max_model_len or need,
                               chunked_prefill_size=max(8192, args.input_len), **spec)
    runner = make_runner(settings, device)
    if method == "NGRAM" and k:
        runner.spec.proposer = ForcedDrafts(runner.spec.proposer)
    with torch.inference_mode():
        result = timed_steps(runner, args, k)
    result["cuda_graphs"] = runner.graphs is not None
    if runner.graphs is not None:  # the GPU's share of a step: its graph's replay alone
        result["graph_replay_ms"] = {rows: time_graph_replay(runner, rows) for rows in (1, k + 1)}
    close_runner(runner)
    del runner
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_flags(parser)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50, help="timed steps of each kind")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--num-steps", type=int, default=3, help="k: draft tokens a verify step checks")
    parser.add_argument("--acceptance-length", type=float, default=3.5,
                        help="tokens a verify step gives, for the projection")
    parser.add_argument("--eagle3", action="store_true", help="also time whole EAGLE-3 rounds (dummy head)")
    parser.add_argument("--draft-vocab-size", type=int, default=32000, help="the EAGLE-3 head's vocabulary")
    parser.add_argument("--profile-host", action="store_true", help="cProfile each method's steps once more")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    k = args.num_steps
    results = {"decode": measure(args, device, "", 0), "ngram": measure(args, device, "NGRAM", k)}
    if args.eagle3:
        with tempfile.TemporaryDirectory() as head:
            target = load_hf_config(Path(args.model))
            (Path(head) / "config.json").write_text(json.dumps(head_config(target, args.draft_vocab_size)))
            results["eagle3"] = measure(args, device, "EAGLE3", k, speculative_draft_model_path=head)
    decode_ms = statistics.median(results["decode"]["times"]["decode"])
    verify_ms = statistics.median(results["ngram"]["times"]["verify"])
    ratio = verify_ms / decode_ms
    report: dict[str, Any] = {
        "model": args.model, "device": str(device), "dtype": args.dtype, "input_len": args.input_len,
        "k": k, "positions_verified": k + 1, "steps": args.steps,
        "decode_step_ms": round(decode_ms, 4), "verify_step_ms": round(verify_ms, 4),
        "verify_over_decode": round(ratio, 4), "goal_verify_over_decode": 1.15,
        "decode_tok_s": round(1e3 / decode_ms, 1), "cuda_graphs": results["decode"]["cuda_graphs"],
        "decode_ms_all": [round(x, 4) for x in results["decode"]["times"]["decode"]],
        "verify_ms_all": [round(x, 4) for x in results["ngram"]["times"]["verify"]],
        "verify_steps_in_decode_graph": results["ngram"]["verify_in_decode_graph"],
        "graph_replay_ms": results["ngram"].get("graph_replay_ms"),
        "host_profiles": {name: r["host_profile"] for name, r in results.items() if "host_profile" in r},
        "projection_acceptance_length": args.acceptance_length,
    }
    rows = [("decode (1 position)", decode_ms), (f"verify ({k + 1} positions, n-gram)", verify_ms)]
    if "eagle3" in results:
        eagle = results["eagle3"]
        round_ms = statistics.median(eagle["times"]["verify"])
        report["eagle3"] = {
            "draft_vocab_size": args.draft_vocab_size, "round_ms": round(round_ms, 4),
            "round_over_decode": round(round_ms / decode_ms, 4),
            "projected_tok_s": round(args.acceptance_length * 1e3 / round_ms, 1), "goal_tok_s": 550,
            "round_ms_all": [round(x, 4) for x in eagle["times"]["verify"]],
            "dummy_acceptance": {"drafts": eagle["drafts"], "accepted": eagle["accepted"]},
        }
        rows.append((f"EAGLE-3 round (k = {k})", round_ms))
    print(f"{'step':34} {'median ms':>10} {'x decode':>9}")
    for name, ms in rows:
        print(f"{name:34} {ms:10.3f} {ms / decode_ms:9.3f}")
    for rows, ms in (report["graph_replay_ms"] or {}).items():
        print(f"{f'graph replay alone, {rows} rows':34} {ms:10.3f} {ms / decode_ms:9.3f}")
    print(f"verify / decode = {ratio:.3f} (goal <= 1.15)")
    if "eagle3" in report:
        print(f"EAGLE-3 batch 1, PROJECTED at acceptance length {args.acceptance_length}: "
              f"{report['eagle3']['projected_tok_s']} tok/s (goal >= 550; decode alone {report['decode_tok_s']})")
    out = args.json or (os.path.join(os.environ["OUT"], "bench_speculative.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
