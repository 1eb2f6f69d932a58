#!/usr/bin/env python3
"""Decode-sized linears of the Llama-3.1-8B shape: the FP8-weight GEMV (kernels/fp8_gemv.py) against
torch's bf16 linear (cuBLAS) and _scaled_mm on the same shapes, side by side. Each figure is the median
of 20 CUDA-graph replays of 20 calls (launch overhead amortised); bandwidth counts the weight bytes.

  python scripts/gpu/bench_fp8_gemv.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenspeed_kernels.fp8_gemv import fp8_gemv  # noqa: E402

from app.worker.quantization.fp8 import quantize_rows  # noqa: E402
from app.worker.quantization.gemm import SCALED_MM_ROWWISE, fp8_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS = 20


def time_ms(fn) -> float:
    fn()  # autotune / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=dev) * 0.02
        codes, scale = quantize_rows(w)
        w16 = w.to(torch.bfloat16)
        for m in (1, 8, 16):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            gemv = time_ms(lambda: fp8_gemv(x, codes, scale.view(-1)))  # noqa: B023
            bf16 = time_ms(lambda: F.linear(x, w16))  # noqa: B023
            xq = x.repeat(17, 1)[: max(m, 17)]  # _scaled_mm path (17 rows: above the GEMV's range)
            scaled = time_ms(lambda: fp8_linear(xq, codes, scale.view(1, -1), None, None, SCALED_MM_ROWWISE))  # noqa: B023
            rows.append({"layer": name, "n": n, "k": k, "m": m, "fp8_gemv_ms": gemv, "bf16_linear_ms": bf16,
                         "scaled_mm_17_rows_ms": scaled, "fp8_gemv_tb_s": n * k / gemv / 1e9,
                         "bf16_tb_s": 2 * n * k / bf16 / 1e9, "speedup_vs_bf16": bf16 / gemv})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print("| layer | m | FP8 GEMV ms | TB/s | bf16 linear ms | TB/s | x bf16 | _scaled_mm (17 rows) ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['m']} | {r['fp8_gemv_ms']:.4f} | {r['fp8_gemv_tb_s']:.2f} | "
              f"{r['bf16_linear_ms']:.4f} | {r['bf16_tb_s']:.2f} | {r['speedup_vs_bf16']:.2f} | "
              f"{r['scaled_mm_17_rows_ms']:.4f} |")


if __name__ == "__main__":
    main()
