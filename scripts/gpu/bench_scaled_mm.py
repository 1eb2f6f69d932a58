#!/usr/bin/env python3
"""The FP8 GEMMs of the Llama-3.1-8B shape at the offline run's row counts (512: a decode step; 8704: an
8,192-token prefill chunk beside 512 decodes), torch._scaled_mm with row-wise scales as
app/worker/quantization/gemm.py calls it, with and without fast accumulation (cuBLAS's FP8 mode that
keeps partial sums in the tensor cores' own accumulator instead of promoting them to float32 every few
steps), side by side: time, TFLOP/s, and each output's relative error against the float64 product of
the same codes and scales. Weights rotate past the L2 as in bench_gemv; each figure is the median of 10
CUDA-graph replays.

  python scripts/gpu/bench_scaled_mm.py [--json OUT] [--rows 512,8704]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from app.worker.quantization.fp8 import quantize_rows  # noqa: E402
from scripts.gpu.bench_gemv import SHAPES, rotated_weights, time_ms  # noqa: E402


def scaled_mm(codes: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              fast: bool) -> torch.Tensor:  # fmt: skip
    return torch._scaled_mm(codes, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1),
                            out_dtype=torch.bfloat16, use_fast_accum=fast)  # fmt: skip


def measure(name: str, n: int, k: int, m: int) -> dict:
    ws, scales = rotated_weights(n, k, "fp8")
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    codes, x_scale = quantize_rows(x)
    want = (codes.double() * x_scale.double()) @ (ws[0].double() * scales[0].double().view(-1, 1)).t()
    row = {"layer": name, "m": m, "n": n, "k": k}
    for fast in (False, True):
        got = scaled_mm(codes, x_scale, ws[0], scales[0], fast).double()
        ms = time_ms(lambda i: scaled_mm(codes, x_scale, ws[i], scales[i], fast), len(ws))  # noqa: B023
        key = "fast" if fast else "exact"
        row[f"{key}_ms"] = ms
        row[f"{key}_tflop_s"] = 2 * m * n * k / ms / 1e9
        row[f"{key}_rel_error"] = ((got - want).norm() / want.norm()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--rows", default="512,8704")
    args = parser.parse_args()
    rows = [measure(name, n, k, m) for m in map(int, args.rows.split(",")) for name, (n, k) in SHAPES.items()]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("| m | layer | float32 accumulation ms | TFLOP/s | fast accumulation ms | TFLOP/s | time ratio | "
          "rel. error float32 / fast |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['layer']} | {r['exact_ms']:.4f} | {r['exact_tflop_s']:.0f} | {r['fast_ms']:.4f} | "
              f"{r['fast_tflop_s']:.0f} | {r['fast_ms'] / r['exact_ms']:.3f} | "
              f"{r['exact_rel_error']:.2e} / {r['fast_rel_error']:.2e} |")
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        exact, fast = (32 * sum(r[f"{key}_ms"] for r in sel) for key in ("exact", "fast"))
        print(f"m={m}: a step's 128 GEMMs {exact:.3f} ms with float32 accumulation, {fast:.3f} ms fast "
              f"({fast / exact:.3f})")


if __name__ == "__main__":
    main()
