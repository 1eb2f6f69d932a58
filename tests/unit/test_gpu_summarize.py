"""scripts/gpu/summarize.py's TTFT split: the scheduler's per-request stats of a serving benchmark's window."""

from __future__ import annotations

import json
from pathlib import Path

from app.metrics.request_stats import RequestStats
from scripts.gpu import summarize

T0 = 1_764_523_456.0


def stats_line(rid: str, recv_ts: float, ttft_ms: float | None) -> str:
    stats = RequestStats(status="finished", reason="length", prompt_tokens=1024, cache_tokens=0, output_tokens=128,
                         cache_hit_rate=0.0, queue_ms=3.0, prefill_ms=20.0, ttft_ms=ttft_ms, total_ms=700.0,
                         preempt_ms=0.0, preempt_count=0, decode_tps=210.0, acc_len=None, acc_rate=None,
                         recv_ts=recv_ts, commit_ts=None, finish_ts=recv_ts + 0.7)  # fmt: skip
    return f"INFO tokenspeed.scheduler: Req: {rid} Finish! {stats!r}"


def test_scheduler_view_of_each_benchmark_window(tmp_path: Path) -> None:
    log = [stats_line("a", T0 + 1, 30.0), stats_line("b", T0 + 2, 34.0), stats_line("c", T0 + 3, None),
           stats_line("d", T0 + 50, 90.0)]  # fmt: skip
    (tmp_path / "serving-serve.log").write_text("\n".join(["starting", *log, "stopped"]))
    results = {
        "serving-b1": {"started_at": T0, "duration_s": 10.0, "ttft_ms": {"p50": 40.0}},
        "serving": {"started_at": T0 + 49, "duration_s": 5.0, "ttft_ms": {"p50": 95.0}},
        "latency_flashinfer_b1": {"prefill_ms": 14.9},
    }
    for name, r in results.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(r))
    lines = summarize.scheduler_lines(tmp_path, summarize.load(tmp_path))
    assert lines == [
        "serving-b1, scheduler's view of 3 requests: queue p50 3.0 ms, prefill p50 20.0 ms, TTFT p50 32.0 ms "
        "against the client's 40.0 ms (8.0 ms outside the scheduler)",
        "serving, scheduler's view of 1 requests: queue p50 3.0 ms, prefill p50 20.0 ms, TTFT p50 90.0 ms "
        "against the client's 95.0 ms (5.0 ms outside the scheduler)",
    ]


def test_tp_ratios_with_and_without_the_one_shot_all_reduce() -> None:
    one_shot = "one-shot over peer memory (torch symmetric memory) for bf16/fp32 tensors up to 512 KiB, NCCL above"
    results = {
        "latency_tp1_b1": {"decode_tokens_per_s": 180.0, "tensor_parallel_size": 1},
        "latency_tp2_b1": {"decode_tokens_per_s": 297.0, "tensor_parallel_size": 2, "all_reduce": one_shot},
        "latency_tp2_b1_nccl": {"decode_tokens_per_s": 198.0, "tensor_parallel_size": 2,
                                "all_reduce": "NCCL only (rank 0: --disable-custom-all-reduce)"},
    }
    assert summarize.ratio_lines(results) == [
        "batch-1 decode tok/s, TP=2 / TP=1 (flashinfer, execute; goal >= 1.6): 297 / 180 = 1.650",
        "batch-1 decode tok/s, TP=2 NCCL only / TP=1 (--disable-custom-all-reduce): 198 / 180 = 1.100",
        "batch-1 decode tok/s, TP=2 one-shot all-reduce / NCCL only: 297 / 198 = 1.500",
    ]
    assert summarize.other_lines(results) == [
        f"latency_tp2_b1: TP 2, all-reduce: {one_shot}",
        "latency_tp2_b1_nccl: TP 2, all-reduce: NCCL only (rank 0: --disable-custom-all-reduce)",
    ]


def test_moe_lines_against_the_goals() -> None:
    """The MoE stages' table: batch-1 decode bf16 and FP8 beside the active-weight roofline, the FP8 ratio,
    transformers, the offline figure against its goal, and the tuning's rows at one token."""
    results = {
        "moe_decode": {"none": {"graph_tokens_per_s": 400.0, "decode_tokens_per_s": 380.0,
                                "pipelined_tokens_per_s": 395.0, "active_roofline_tokens_per_s": 696.0},
                       "fp8": {"graph_tokens_per_s": 600.0, "decode_tokens_per_s": 570.0},
                       "fp8_over_bf16": 1.5, "transformers": {"decode_tokens_per_s": 12.0}},
        "moe_tune": {"source": "x", "skipped": [], "choices": [],
                     "configs": [{"model": "q", "weights": "16", "path": "gemv", "n": 1536, "k": 2048, "tokens": 1,
                                  "us": 9.0, "default_us": 12.0, "config": {"block_n": 4}}]},
    }  # fmt: skip
    lines = summarize.moe_lines(results)
    assert "| batch-1 decode tok/s, bf16 (graph replay) | 400.0 (decode loop 380.0, pipelined 395.0) | 450 | 696.0 |" in lines
    assert "| FP8 / bf16 (decode loop) | 1.500 | 1.5 | |" in lines
    assert "| transformers generate, batch 1 | 12.0 | | |" in lines
    assert any("[1536x2048] 1 token: 9.0 us (default 12.0 us)" in line for line in lines)
    assert summarize.moe_lines({}) == []
