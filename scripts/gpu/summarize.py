#!/usr/bin/env python3
"""Merge the run's JSON results into one file and print the table (the last thing run_h200.sh prints).

usage: summarize.py RUN_DIR OUT_JSON"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(run: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(run.glob("*.json"))}


def fmt(value: object, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def table(results: dict[str, dict]) -> list[str]:
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
    for name, r in results.items():
        if name.startswith("offline"):
            lines.append(
                f"{name}: {r['attention_backend']}, {r['num_requests']} x {r['input_len']}/{r['output_len']}, "
                f"output {fmt(r['output_tokens_per_s'], '.0f')} tok/s, total {fmt(r['total_tokens_per_s'], '.0f')} "
                f"tok/s, mean step {fmt(r['mean_step_ms'], '.2f')} ms, ready {fmt(r['start_to_ready_s'])} s"
            )
        if name.startswith("hf_"):
            lines.append(
                f"{name}: transformers generate batch {r['batch_size']}: {fmt(r['tokens_per_s'])} tok/s"
            )
    return lines


def main() -> None:
    run, out = Path(sys.argv[1]), Path(sys.argv[2])
    results = load(run)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for status in sorted(run.glob("*.status")):
        print(f"{status.stem}: {status.read_text().strip()}")
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
