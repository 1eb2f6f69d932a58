#!/usr/bin/env python3
"""Decode-sized linears of the Llama-3.1-8B shape: kernels/gemv.py's configurations swept per shape,
against torch's bf16 linear (cuBLAS) on the same shape, side by side. Weights are rotated
through enough copies to defeat the 50 MB L2 (as in a model step, where every layer reads its own);
each figure is the median of 10 CUDA-graph replays (launch overhead amortised). Bandwidth counts the
weight bytes. Prints the fastest configuration per (weight dtype, rows, shape) as a `_MEASURED` table
for kernels/gemv.py, and the sum over one decode step's 128 GEMVs.

  python scripts/gpu/bench_gemv.py [--json OUT] [--budget-s 240]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenspeed_kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv,
    gemv_reference,
    pick_config,
)

from app.worker.quantization.fp8 import quantize_rows  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROTATE_BYTES = 256 << 20
FMA_TILES = {1: [(2, 2048), (4, 1024), (8, 512), (8, 1024), (16, 512)],
             4: [(1, 1024), (2, 512), (4, 256), (4, 512), (8, 256)]}
DOT_TILES = [(16, 128, 4), (16, 256, 3), (16, 256, 4), (32, 128, 4), (32, 256, 3), (16, 512, 3), (64, 128, 4)]
# The weight as operand A: a warpgroup's 64 rows per MMA, so wider N tiles.
W_AS_A_TILES = [(64, 128, 4), (64, 256, 3), (64, 256, 4), (64, 512, 2), (128, 128, 3), (128, 256, 2), (32, 256, 3)]


def candidates(m: int, fp8: bool) -> list[GemvConfig]:
    out = []
    for split in (1, 2, 4):
        if m in FMA_TILES:  # FP8 codes: one tile for reference (the FMA body converts every code in hardware)
            tiles = FMA_TILES[m][-2:-1] if fp8 else FMA_TILES[m]
            out += [GemvConfig(False, bn, bk, split, warps, 3) for bn, bk in tiles for warps in ((4,) if fp8 else (4, 8))]
        if m > 1 or fp8:  # FP8 codes: float16 operands (GemvConfig.fp16_operands says why)
            out += [GemvConfig(True, bn, bk, split, 4, stages, False, fp8) for bn, bk, stages in DOT_TILES]
        out += [GemvConfig(True, bn, bk, split, warps, stages, True, fp8)
                for bn, bk, stages in W_AS_A_TILES for warps in ((4, 8) if bn == 128 else (4,))]
    return out


def compile_all(groups: set[tuple[int, bool]], deadline: float) -> None:
    """Compile every candidate once on a small shape with the same specialisations (N and K multiples of
    16, K a multiple of every BLOCK_K), so that compile time does not eat the first shape's share."""
    dev = torch.device("cuda")
    for m, fp8 in sorted(groups):
        w = torch.randn(256, 4096, device=dev) * 0.02
        w, scale = quantize_rows(w) if fp8 else (w.to(torch.bfloat16), None)
        scale = None if scale is None else scale.view(-1).float()
        x = torch.randn(m, 4096, device=dev).to(torch.bfloat16)
        for cfg in candidates(m, fp8):
            if time.monotonic() > deadline:
                return
            try:
                gemv(x, w, scale, cfg)
            except Exception:  # noqa: BLE001, S112 (reported when the shapes are timed)
                continue
    torch.cuda.synchronize()


def time_ms(fn, copies: int) -> float:
    """fn(i) uses weight copy i; one graph runs every copy once; median per call."""
    for i in range(copies):
        fn(i)  # compile / warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / copies)
    return statistics.median(times)


def sweep_shape(name: str, n: int, k: int, m: int, fp8: bool, deadline: float) -> dict:
    dev = torch.device("cuda")
    bytes_per = n * k * (1 if fp8 else 2)
    copies = max(8, -(-ROTATE_BYTES // bytes_per))
    ws, scales = [], []
    for i in range(copies):
        w = torch.randn(n, k, device=dev, generator=torch.Generator(dev).manual_seed(i)) * 0.02
        if fp8:
            codes, scale = quantize_rows(w)
            ws.append(codes)
            scales.append(scale.view(-1).float())
        else:
            ws.append(w.to(torch.bfloat16))
            scales.append(None)
        del w
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    ref = gemv_reference(x, ws[0], scales[0]).float()
    row = {"layer": name, "n": n, "k": k, "m": m, "weights": "fp8" if fp8 else "bf16", "copies": copies}
    if not fp8:
        row["cublas_ms"] = time_ms(lambda i: F.linear(x, ws[i]), copies)
    results = []
    for cfg in candidates(m, fp8):
        if time.monotonic() > deadline:
            row["cut_short"] = True
            break
        try:
            got = gemv(x, ws[0], scales[0], cfg).float()
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                results.append({"config": cfg.__dict__, "error": f"relative error {err:.3g}"})
                continue
            results.append({"config": cfg.__dict__, "ms": time_ms(lambda i: gemv(x, ws[i], scales[i], cfg), copies)})  # noqa: B023
        except Exception as exc:  # noqa: BLE001 (a config the compiler refuses is reported, not fatal)
            results.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    timed = [r for r in results if "ms" in r]
    default_cfg = pick_config(m, n, k, ws[0].dtype)
    row["default_ms"] = time_ms(lambda i: gemv(x, ws[i], scales[i], default_cfg), copies)
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        row["best_ms"], row["best_config"] = best["ms"], best["config"]
        row["best_tb_s"] = bytes_per / best["ms"] / 1e9
    row["sweep"] = results
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this long")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--weights", default="bf16,fp8")
    args = parser.parse_args()
    t0 = time.monotonic()
    rows = []
    ms = [int(v) for v in args.rows.split(",")]
    kinds = [w == "fp8" for w in args.weights.split(",")]
    jobs = [(name, n, k, m, fp8) for fp8 in kinds for m in ms for name, (n, k) in SHAPES.items()]
    compile_all({(m, fp8) for _, _, _, m, fp8 in jobs}, t0 + args.budget_s / 2)
    for i, (name, n, k, m, fp8) in enumerate(jobs):
        share = (args.budget_s - (time.monotonic() - t0)) / (len(jobs) - i)  # even share of what is left
        rows.append(sweep_shape(name, n, k, m, fp8, time.monotonic() + share))
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("_MEASURED = {")
    for r in rows:
        if "best_config" in r:
            c = r["best_config"]
            faster = r["weights"] == "fp8" or r["best_ms"] < r["cublas_ms"]
            print(f"    {'' if faster else '# cuBLAS faster: '}(\"{'fp8' if r['weights'] == 'fp8' else '16'}\", {r['m']}, "
                  f"{r['n']}, {r['k']}): GemvConfig({c['use_dot']}, {c['block_n']}, {c['block_k']}, {c['split_k']}, "
                  f"{c['num_warps']}, {c['num_stages']}, {c['w_as_a']}, {c['fp16_operands']}),")
    print("}")
    cublas = {(r["layer"], r["m"]): r["cublas_ms"] for r in rows if "cublas_ms" in r}
    print("| weights | m | layer | best ms | TB/s | default ms | cuBLAS bf16 ms | best / cuBLAS time | configs timed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        timed = sum("ms" in s for s in r["sweep"])
        base = cublas.get((r["layer"], r["m"]), float("nan"))
        print(f"| {r['weights']} | {r['m']} | {r['layer']} | {r.get('best_ms', float('nan')):.4f} | "
              f"{r.get('best_tb_s', float('nan')):.2f} | {r['default_ms']:.4f} | {base:.4f} | "
              f"{r.get('best_ms', float('nan')) / base:.2f} | {timed}/{len(r['sweep'])}{' cut' if r.get('cut_short') else ''} |")
    for weights in ("bf16", "fp8"):
        for m in ms:
            sel = [r for r in rows if r["weights"] == weights and r["m"] == m and "best_ms" in r]
            if len(sel) == len(SHAPES):
                best = 32 * sum(r["best_ms"] for r in sel)
                base = 32 * sum(cublas.get((r["layer"], m), float("nan")) for r in sel)
                print(f"step GEMVs ({weights} weights, m={m}, 32 layers, no lm_head): best {best:.3f} ms vs "
                      f"cuBLAS bf16 {base:.3f} ms")


if __name__ == "__main__":
    main()
