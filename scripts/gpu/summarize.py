#!/usr/bin/env python3
"""Merge the run's JSON results into one file and print the table (the last thing run_h200.sh prints).

Besides the latency table and one line per offline, kv_pool and hf result, it prints the ratios the
stages were run for (each only when both of its results are there): FP8 against bf16 weights, FP8
against bf16 KV pool, overlapped against sequential steps, and the 1000 x 1000 offline figures
against the issue's goal and TRT-LLM's FP8 figure on one H200.

usage: summarize.py RUN_DIR OUT_JSON"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

# Output tokens/s of the 1000 x 1000/1000 offline benchmark: the issue's goal, and TRT-LLM's on one
# H200 with Llama-3.1-8B FP8 (shared/reference/peers.md, row 11).
OFFLINE_GOALS = {"goal": 12_000.0, "TRT-LLM FP8": 17_744.0}

# (label, numerator run, denominator run, field): printed as numerator / denominator.
RATIOS = [
    ("batch-1 decode tok/s, FP8 / bf16 weights (flashinfer, execute)",
     "latency_flashinfer_b1_fp8w", "latency_flashinfer_b1_bf16w", "decode_tokens_per_s"),
    ("batch-1 decode tok/s, FP8 / bf16 weights (flashinfer, graph replay)",
     "latency_flashinfer_b1_fp8w", "latency_flashinfer_b1_bf16w", "graph_tokens_per_s"),
    ("weights bytes, FP8 / bf16", "latency_flashinfer_b1_fp8w", "latency_flashinfer_b1_bf16w", "weights_gb"),
    ("batch-1 decode tok/s, FP8 / bf16 weights (triton, graph replay)",
     "latency_triton_b1_fp8w", "latency_triton_b1_bf16w", "graph_tokens_per_s"),
    ("KV pool tokens, FP8 / bf16 KV", "kv_pool_fp8kv", "kv_pool_bf16", "kv_pool_tokens"),
    ("KV pool GiB, FP8 / bf16 KV", "kv_pool_fp8kv", "kv_pool_bf16", "kv_pool_gib"),
    ("KV bytes per token, FP8 / bf16 KV", "kv_pool_fp8kv", "kv_pool_bf16", "kv_bytes_per_token"),
    ("offline 128 x 512/128 output tok/s, overlapped / sequential steps",
     "offline", "offline_no_overlap", "output_tokens_per_s"),
    ("offline 1000 x 1000/1000 output tok/s, FP8 / bf16 weights",
     "offline_1000_fp8", "offline_1000", "output_tokens_per_s"),
    ("offline 1000 x 1000/1000 output tok/s, FP8 weights + FP8 KV / bf16",
     "offline_1000_fp8kv", "offline_1000", "output_tokens_per_s"),
    ("offline 1000 x 1000/1000 output tok/s, FP8 weights + FP8 KV / FP8 weights",
     "offline_1000_fp8kv", "offline_1000_fp8", "output_tokens_per_s"),
    ("batch-1 decode tok/s, TP=2 / TP=1 (flashinfer, execute; goal >= 1.6)",
     "latency_tp2_b1", "latency_tp1_b1", "decode_tokens_per_s"),
    ("batch-1 decode tok/s, TP=2 NCCL only / TP=1 (--disable-custom-all-reduce)",
     "latency_tp2_b1_nccl", "latency_tp1_b1", "decode_tokens_per_s"),
    ("batch-1 decode tok/s, TP=2 one-shot all-reduce / NCCL only",
     "latency_tp2_b1", "latency_tp2_b1_nccl", "decode_tokens_per_s"),
    ("appliance output tok/s, 2 replicas / 1 (--data-parallel-size; goal 2 within 10%)",
     "serving_dp2", "serving_dp1", "output_token_throughput"),
]  # fmt: skip


def load(run: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(run.glob("*.json"))}


def fmt(value: object, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def num(value: float | None) -> str:
    """A figure for the ratio lines: thousands separated, small ones to 4 significant digits."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def field(result: dict, name: str) -> float | None:
    """A figure of one result; kv_pool_gib is derived from kv_pool_bytes."""
    if name == "kv_pool_gib":
        nbytes = result.get("kv_pool_bytes")
        return nbytes / 2**30 if nbytes is not None else None
    return result.get(name)


def precision(r: dict) -> str:
    return f"weights {r.get('quantization') or 'unquantized'}, KV {r.get('kv_cache_detail', 'auto')}"


def latency_table(results: dict[str, dict]) -> list[str]:
    roof = results.get("roofline", {})
    bw = roof.get("copy_bandwidth_bytes_per_s")
    lines = [
        f"device {roof.get('device', '?')}: copy {fmt(bw and bw / 1e12, '.2f')} TB/s, "
        f"bf16 matmul {fmt(roof.get('bf16_matmul_tflops'), '.0f')} TFLOP/s",
        "| run | backend | graphs | batch | step p50 ms | tok/s | graph replay ms | graph tok/s | "
        "x roofline | prefill ms | ready s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if not name.startswith("latency"):
            continue
        lines.append(
            f"| {name} | {r['attention_backend']} | {r['cuda_graphs']} | {r['batch_size']} | "
            f"{fmt(r['decode_step_ms']['p50'], '.2f')} | {fmt(r['decode_tokens_per_s'])} | "
            f"{fmt(r.get('graph_replay_ms'), '.2f')} | {fmt(r.get('graph_tokens_per_s'))} | "
            f"{fmt(r.get('ratio_to_roofline'), '.3f')} | {fmt(r['prefill_ms'])} | {fmt(r['start_to_ready_s'])} |"
        )
    return lines


def offline_line(name: str, r: dict) -> str:
    line = (
        f"{name}: {r['attention_backend']}, {r['num_requests']} x {r['input_len']}/{r['output_len']}, "
        f"output {fmt(r['output_tokens_per_s'], '.0f')} tok/s, total {fmt(r['total_tokens_per_s'], '.0f')} "
        f"tok/s, mean step {fmt(r['mean_step_ms'], '.2f')} ms, ready {fmt(r['start_to_ready_s'])} s"
    )
    if "overlap" in r:  # results written before these fields existed lack them
        line += (
            f"; {precision(r)}, overlap {r['overlap']}, max_num_seqs {r['max_num_seqs']} (most running "
            f"{r['max_running']}), {r['preemptions']} preemptions, KV pool {r['kv_pool_tokens']} tokens, "
            f"{r['finished']} finished in {fmt(r['elapsed_s'])} s, {r['steps']} steps"
        )
    for kind, k in r.get("step_kinds", {}).items():
        line += f"; {k['steps']} {kind} steps of {fmt(k['mean_ms'], '.1f')} ms"
    return line


def other_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    for name, r in results.items():
        if name.startswith("offline"):
            lines.append(offline_line(name, r))
        elif name.startswith("latency") and r.get("tensor_parallel_size", 1) > 1:
            lines.append(f"{name}: TP {r['tensor_parallel_size']}, all-reduce: {r.get('all_reduce', '-')}")
        elif name.startswith("kv_pool"):
            lines.append(
                f"{name}: {r['attention_backend']}, {precision(r)}: KV pool {r['kv_pool_tokens']} tokens, "
                f"{fmt(field(r, 'kv_pool_gib'), '.2f')} GiB, {r['kv_bytes_per_token']} bytes/token, weights "
                f"{fmt(r['weights_gb'], '.2f')} GB, CUDA graphs {r['cuda_graphs']}"
            )
        elif "ttft_ms" in r and "output_token_throughput" in r:  # bench_serving through the appliance
            lines.append(
                f"{name}: {r['completed']}/{r['num_prompts']} ok, {r['input_len']}/{r['output_len']} tokens "
                f"(range ratio {r.get('random_range_ratio', 0)}) at concurrency {r['max_concurrency']}: output "
                f"{fmt(r['output_token_throughput'], '.0f')} tok/s, TTFT p50 {fmt(r['ttft_ms']['p50'])} ms "
                f"(mean {fmt(r['ttft_ms']['mean'])}), TPOT p50 {fmt(r['tpot_ms']['p50'], '.2f')} ms, "
                f"ITL p50 {fmt(r['itl_ms']['p50'], '.2f')} ms"
            )
        elif name.startswith("hf_"):
            lines.append(
                f"{name}: transformers generate batch {r['batch_size']}: {fmt(r['tokens_per_s'])} tok/s"
            )
    return lines


def ratio_lines(results: dict[str, dict]) -> list[str]:
    lines = []
    for label, top, bottom, name in RATIOS:
        if top not in results or bottom not in results:
            continue
        a, b = field(results[top], name), field(results[bottom], name)
        value = a / b if a is not None and b else None
        lines.append(f"{label}: {num(a)} / {num(b)} = {fmt(value, '.3f')}")
    for name, r in results.items():
        if name.startswith("offline_1000"):
            rate = r["output_tokens_per_s"]
            against = ", ".join(f"{fmt(rate / goal, '.2f')} of the {label} ({goal:,.0f})"
                                for label, goal in OFFLINE_GOALS.items())  # fmt: skip
            lines.append(f"{name}: {rate:,.0f} output tok/s = {against}")
    return lines


def gemv_lines(results: dict) -> list[str]:
    """bench_gemv.py's rows (a list): the fastest kernels/gemv.py configuration per weight dtype, rows and shape."""
    return [f"gemv {r['weights']} {r['layer']} m={r['m']}: {r.get('best_ms', float('nan')) * 1e3:.1f} us "
            f"({r.get('best_tb_s', float('nan')):.2f} TB/s)" + (f", cuBLAS {r['cublas_ms'] * 1e3:.1f} us" if "cublas_ms" in r else "")
            for r in results.get("gemv", [])]


def pyspy_lines(run: Path, top: int = 5) -> list[str]:
    """The leaf frames holding most samples in each py-spy profile (serve_and_bench.sh's PYSPY_BENCH)."""
    lines = []
    for path in sorted(run.glob("*.pyspy.txt")):
        leaves: Counter[str] = Counter()
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            leaves[stack.rsplit(";", 1)[-1]] += int(count)
        total = sum(leaves.values()) or 1
        lines.append(f"{path.name}: {total} samples; " + "; ".join(
            f"{n / total:.0%} {frame}" for frame, n in leaves.most_common(top)))
    return lines


_STATS = re.compile(r"Finish! RequestStats\((.*)\)")
_FIELD = re.compile(r"(\w+)=([-\w.']+)")


def request_stats(log: str) -> list[dict[str, float | None]]:
    """The scheduler's per-request lines (--enable-log-request-stats) of a server log: the numeric fields."""
    rows = []
    for match in _STATS.finditer(log):
        fields = dict(_FIELD.findall(match.group(1)))
        rows.append({k: None if v == "None" else float(v) for k, v in fields.items() if not v.startswith("'")})
    return rows


def scheduler_lines(run: Path, results: dict[str, dict]) -> list[str]:
    """Each serving benchmark's TTFT split: the scheduler's view (HTTP arrival to the first token, from the
    server log's per-request stats within the benchmark's time window) against the client's."""
    lines = []
    stats = {p.name.removesuffix("-serve.log"): request_stats(p.read_text(errors="replace"))
             for p in run.glob("*-serve.log")}  # fmt: skip
    for name, r in results.items():
        if not isinstance(r, dict) or "started_at" not in r or "ttft_ms" not in r:
            continue
        servers = [server for server in stats if name.startswith(server)]  # serving, serving_eager_prefill, ..
        if not servers:
            continue
        window = (r["started_at"], r["started_at"] + r["duration_s"])
        rows = [s for s in stats[max(servers, key=len)]
                if s.get("recv_ts") is not None and window[0] - 0.5 <= s["recv_ts"] <= window[1]]  # fmt: skip

        def p50(key: str, rows: list = rows) -> float | None:
            values = [s[key] for s in rows if s.get(key) is not None]
            return statistics.median(values) if values else None

        client, server = r["ttft_ms"]["p50"], p50("ttft_ms")
        outside = client - server if client is not None and server is not None else None
        lines.append(f"{name}, scheduler's view of {len(rows)} requests: queue p50 {fmt(p50('queue_ms'))} ms, "
                     f"prefill p50 {fmt(p50('prefill_ms'))} ms, TTFT p50 {fmt(server)} ms against the client's "
                     f"{fmt(client)} ms ({fmt(outside)} ms outside the scheduler)")  # fmt: skip
    return lines


def moe_lines(results: dict[str, dict]) -> list[str]:
    """The MoE stages: batch-1 decode bf16 and FP8 against the active-weight roofline and transformers,
    the 1000 x 1000 offline figure, and the tuning's gain over the default tiles at one token."""
    lines = []
    d = results.get("moe_decode")
    if d:
        lines.append("| MoE figure | value | goal | limit |")
        lines.append("|---|---|---|---|")
        for name, label in (("none", "bf16"), ("fp8", "FP8")):
            r = d.get(name)
            if r:
                lines.append(f"| batch-1 decode tok/s, {label} (graph replay) | {fmt(r.get('graph_tokens_per_s'))} "
                             f"(decode loop {fmt(r.get('decode_tokens_per_s'))}, pipelined "
                             f"{fmt(r.get('pipelined_tokens_per_s'))}) | "
                             f"{'450' if name == 'none' else ''} | {fmt(r.get('active_roofline_tokens_per_s'))} |")  # fmt: skip
        if d.get("fp8_over_bf16"):
            lines.append(f"| FP8 / bf16 (decode loop) | {d['fp8_over_bf16']:.3f} | 1.5 | |")
        if d.get("transformers"):
            lines.append(f"| transformers generate, batch 1 | {fmt(d['transformers']['decode_tokens_per_s'])} | | |")
    for name, o in results.items():
        if name.startswith("moe_offline_1000"):
            lines.append(f"| {name}: offline {o['num_requests']} x {o['input_len']}/{o['output_len']} output "
                         f"tok/s | {fmt(o['output_tokens_per_s'], '.0f')} | 15,000 | |")
            lines.append(offline_line(name, o))
    prof = (results.get("moe_profile") or {}).get("profile")
    if prof:
        lines.append(f"moe_profile: {prof['steps']} batch-1 decode steps, {prof['wall_ms'] / prof['steps']:.3f} ms a "
                     f"step, GPU busy {prof['gpu_busy_share']:.0%}; the kernels' GPU time a step:")  # fmt: skip
        for k in prof["kernels"][:12]:
            lines.append(f"  {k['ms'] * 1e3 / prof['steps']:8.1f} us {k['share']:6.1%} {k['calls'] // prof['steps']:4d}x "
                         f"{k['name']}")  # fmt: skip
    t = results.get("moe_tune")
    if t:
        lines.append(f"moe_tune: {t.get('source')}; {len(t.get('configs', []))} configurations, skipped "
                     f"{t.get('skipped')}")  # fmt: skip
        for row in t.get("configs", []):
            if row["tokens"] == 1:
                lines.append(f"  {row['model']} {row['weights']} {row['path']} [{row['n']}x{row['k']}] 1 token: "
                             f"{row['us']} us (default {row['default_us']} us) {row['config']}")  # fmt: skip
        for row in t.get("choices", []):
            lines.append(f"  {row['model']} {row['weights']} {row['tokens']} tokens: decode shape "
                         f"{row['decode_us']} us, grouped {row['grouped_us']} us")  # fmt: skip
    return lines


def table(results: dict[str, dict]) -> list[str]:
    ratios = ratio_lines(results)
    dicts = {name: r for name, r in results.items() if isinstance(r, dict)}
    return (latency_table(dicts) + other_lines(dicts) + gemv_lines(results)
            + (["ratios:", *ratios] if ratios else []) + moe_lines(dicts))


def main() -> None:
    run, out = Path(sys.argv[1]), Path(sys.argv[2])
    results = load(run)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for status in sorted(run.glob("*.status")):
        print(f"{status.stem}: {status.read_text().strip()}")
    print("\n".join(table(results) + scheduler_lines(run, results) + pyspy_lines(run)))


if __name__ == "__main__":
    main()
