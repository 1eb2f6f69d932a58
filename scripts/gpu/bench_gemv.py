#!/usr/bin/env python3
"""Decode-sized linears of a model's shapes (--shapes: Llama-3.1-8B's by default, or Qwen3-30B-A3B's
attention and LM head): kernels/gemv.py's configurations swept per shape,
against torch's bf16 linear (cuBLAS) on the same shape, side by side. Weights are rotated
through enough copies to defeat the 50 MB L2 (as in a model step, where every layer reads its own);
each figure is the median of 10 CUDA-graph replays (launch overhead amortised). Bandwidth counts the
weight bytes. Prints the fastest configuration per (weight dtype, rows, shape) as a `_MEASURED` table
for kernels/gemv.py, and the sum over one decode step's GEMVs.

  python scripts/gpu/bench_gemv.py [--json OUT] [--budget-s 240] [--shapes qwen3-30b-a3b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenspeed_kernels.common import set_pdl  # noqa: E402
from tokenspeed_kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv,
    gemv_reference,
    pick_config,
)

from app.bench.latency import median_cuda_ms  # noqa: E402
from app.worker.quantization.fp8 import Fp8Rows, quantize_rows  # noqa: E402

# (N, K) of each linear, and the decoder layers a step runs them in. The MoE model's experts run
# kernels/moe.py; its attention projections and LM head are plain linears.
SHAPE_SETS = {
    "llama-3.1-8b": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}, 32),
    "qwen3-30b-a3b": ({"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048)}, 48),
}
SHAPES = SHAPE_SETS["llama-3.1-8b"][0]  # the 8B's, which bench_gemv_chain.py times too
ROTATE_BYTES = 256 << 20
FMA_TILES = {1: [(2, 2048), (4, 1024), (8, 512), (8, 1024), (16, 512)],
             4: [(1, 1024), (2, 512), (4, 256), (4, 512), (8, 256)]}
DOT_TILES = [(16, 128, 4), (16, 256, 3), (16, 256, 4), (32, 128, 4), (32, 256, 3), (16, 512, 3), (64, 128, 4)]
# The weight as operand A: a warpgroup's 64 rows per MMA, so wider N tiles.
W_AS_A_TILES = [(64, 128, 4), (64, 256, 3), (64, 256, 4), (64, 512, 2), (128, 128, 3), (128, 256, 2), (32, 256, 3)]
# W8A8 (FP8 operands: codes times codes on the tensor cores): tiles of one byte an element, so wider ones;
# (block_n, block_k, stages, warps), the weight as operand A except where block_n < 64.
W8A8_TILES = [(64, 128, 4, 4), (64, 256, 3, 4), (64, 256, 4, 4), (64, 512, 3, 4), (128, 128, 4, 4),
              (128, 256, 3, 4), (128, 256, 3, 8), (256, 128, 3, 8), (32, 256, 4, 4), (16, 512, 3, 4)]


def candidates(m: int, kind: str) -> list[GemvConfig]:
    if kind == "w8a8":
        return [GemvConfig(True, bn, bk, split, warps, stages, bn >= 64, fp8_operands=True)
                for split in (1, 2, 4, 8) for bn, bk, stages, warps in W8A8_TILES]
    fp8 = kind == "fp8"
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


def compile_all(groups: set[tuple[int, str]], deadline: float) -> None:
    """Compile every candidate once on a small shape with the same specialisations (N and K multiples of
    16, K a multiple of every BLOCK_K), so that compile time does not eat the first shape's share."""
    dev = torch.device("cuda")
    for m, kind in sorted(groups):
        w = torch.randn(256, 4096, device=dev) * 0.02
        w, scale = quantize_rows(w) if kind != "bf16" else (w.to(torch.bfloat16), None)
        scale = None if scale is None else scale.view(-1).float()
        x = torch.randn(m, 4096, device=dev).to(torch.bfloat16)
        xq = Fp8Rows.of(x)
        for cfg in candidates(m, kind):
            if time.monotonic() > deadline:
                return
            try:
                if kind == "w8a8":
                    gemv(xq.codes, w, scale, cfg, xq.scales, torch.bfloat16)
                else:
                    gemv(x, w, scale, cfg)
            except Exception:  # noqa: BLE001, S112 (reported when the shapes are timed)
                continue
    torch.cuda.synchronize()


def time_ms(fn, copies: int, pdl: bool = False) -> float:
    """fn(i) uses weight copy i; one graph runs every copy once; median per call. pdl: the kernels are
    captured under programmatic dependent launch (set_pdl), as the decode step runs them."""
    set_pdl(pdl)
    try:
        for i in range(copies):
            fn(i)  # compile / warm up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(copies):
                fn(i)
    finally:
        set_pdl(False)
    return median_cuda_ms(graph.replay, 10) / copies


def rotated_weights(n: int, k: int, kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Enough copies of an [n, k] weight (bf16, or FP8 codes with per-channel scales) to defeat the L2."""
    dev = torch.device("cuda")
    copies = max(8, -(-ROTATE_BYTES // (n * k * (2 if kind == "bf16" else 1))))
    ws, scales = [], []
    for i in range(copies):
        w = torch.randn(n, k, device=dev, generator=torch.Generator(dev).manual_seed(i)) * 0.02
        if kind == "bf16":
            ws.append(w.to(torch.bfloat16))
            scales.append(None)
        else:
            codes, scale = quantize_rows(w)
            ws.append(codes)
            scales.append(scale.view(-1).float())
        del w
    return ws, scales


def sweep_shape(name: str, n: int, k: int, m: int, kind: str, deadline: float) -> dict:
    """Every candidate of `kind` on one shape: bf16 weights, FP8 weights with 16-bit x (fp8: W8A16), or
    FP8 weights with x as FP8 codes (w8a8), each checked against the float64 product first."""
    dev = torch.device("cuda")
    ws, scales = rotated_weights(n, k, kind)
    copies = len(ws)
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    xq = Fp8Rows.of(x)
    row = {"layer": name, "n": n, "k": k, "m": m, "weights": kind, "copies": copies}
    if kind == "w8a8":
        ref = gemv_reference(xq.codes, ws[0], scales[0], xq.scales, torch.bfloat16).float()

        def run(cfg: GemvConfig | None, i: int) -> torch.Tensor:
            return gemv(xq.codes, ws[i], scales[i], cfg, xq.scales, torch.bfloat16)
    else:
        ref = gemv_reference(x, ws[0], scales[0]).float()

        def run(cfg: GemvConfig | None, i: int) -> torch.Tensor:
            return gemv(x, ws[i], scales[i], cfg)
    if kind == "bf16":
        row["cublas_ms"] = time_ms(lambda i: F.linear(x, ws[i]), copies)
    results = []
    for cfg in candidates(m, kind):
        if time.monotonic() > deadline:
            row["cut_short"] = True
            break
        try:
            err = ((run(cfg, 0).float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                results.append({"config": cfg.__dict__, "error": f"relative error {err:.3g}"})
                continue
            results.append({"config": cfg.__dict__, "ms": time_ms(lambda i: run(cfg, i), copies)})  # noqa: B023
        except Exception as exc:  # noqa: BLE001 (a config the compiler refuses is reported, not fatal)
            results.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    timed = [r for r in results if "ms" in r]
    row["default_ms"] = time_ms(lambda i: run(None, i), copies)
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        row["best_ms"], row["best_config"] = best["ms"], best["config"]
        row["best_tb_s"] = n * k * (2 if kind == "bf16" else 1) / best["ms"] / 1e9
    if kind == "w8a8":
        add_w8a8_references(row, x, xq, ws, scales, run)
    row["sweep"] = results
    return row


def add_w8a8_references(row: dict, x: torch.Tensor, xq: Fp8Rows, ws: list, scales: list, run) -> None:
    """Beside the W8A8 GEMV: the W8A16 GEMV (FP8 codes cast to float16, x unquantized) and cuBLAS's FP8
    GEMM on x padded to 16 rows, on the same weights; and cuBLAS's bf16 linear on bf16 weights of the
    shape."""
    copies, m = len(ws), x.shape[0]
    row["w8a16_ms"] = time_ms(lambda i: gemv(x, ws[i], scales[i], pick_config(m, *ws[0].shape, ws[0].dtype)), copies)
    padded = torch.zeros(16, x.shape[1], dtype=xq.codes.dtype, device=x.device)
    padded[:m] = xq.codes
    pad_scales = torch.ones(16, 1, device=x.device)
    pad_scales[:m] = xq.scales
    row["scaled_mm_16_rows_ms"] = time_ms(lambda i: torch._scaled_mm(
        padded, ws[i].t(), scale_a=pad_scales, scale_b=scales[i].view(1, -1), out_dtype=torch.bfloat16), copies)
    bf16_ws, _ = rotated_weights(*ws[0].shape, "bf16")
    row["cublas_ms"] = time_ms(lambda i: F.linear(x, bf16_ws[i]), len(bf16_ws))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping after this long")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--weights", default="bf16,fp8", help="of bf16, fp8 (W8A16), w8a8")
    parser.add_argument("--shapes", default="llama-3.1-8b", choices=sorted(SHAPE_SETS))
    args = parser.parse_args()
    shapes, layers = SHAPE_SETS[args.shapes]
    t0 = time.monotonic()
    rows = []
    ms = [int(v) for v in args.rows.split(",")]
    kinds = args.weights.split(",")
    jobs = [(name, n, k, m, kind) for kind in kinds for m in ms for name, (n, k) in shapes.items()]
    compile_all({(m, kind) for _, _, _, m, kind in jobs}, t0 + args.budget_s / 2)
    for i, (name, n, k, m, kind) in enumerate(jobs):
        share = (args.budget_s - (time.monotonic() - t0)) / (len(jobs) - i)  # even share of what is left
        rows.append(sweep_shape(name, n, k, m, kind, time.monotonic() + share))
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print_table(rows, ms, len(shapes), layers)


def print_table(rows: list[dict], ms: list[int], num_shapes: int, layers: int) -> None:
    """The _MEASURED rows, a table of every shape, and each kind's sum over a step (`layers` decoder
    layers of the shapes, the LM head once)."""
    keys = {"bf16": "16", "fp8": "fp8", "w8a8": "w8a8"}
    print("_MEASURED = {")
    for r in rows:
        if "best_config" in r:
            c = r["best_config"]
            faster = r["weights"] != "bf16" or r["best_ms"] < r["cublas_ms"]
            print(f"    {'' if faster else '# cuBLAS faster: '}(\"{keys[r['weights']]}\", {r['m']}, {r['n']}, {r['k']}): "
                  f"GemvConfig({c['use_dot']}, {c['block_n']}, {c['block_k']}, {c['split_k']}, {c['num_warps']}, "
                  f"{c['num_stages']}, {c['w_as_a']}, {c['fp16_operands']}, {c['fp8_operands']}),")
    print("}")
    cublas = {(r["layer"], r["m"]): r["cublas_ms"] for r in rows if "cublas_ms" in r}
    nan = float("nan")
    print("| weights | m | layer | best ms | TB/s | default ms | W8A16 ms | _scaled_mm 16 rows ms | cuBLAS bf16 ms | "
          "best / cuBLAS time | configs timed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        timed = sum("ms" in s for s in r["sweep"])
        base = cublas.get((r["layer"], r["m"]), nan)
        print(f"| {r['weights']} | {r['m']} | {r['layer']} | {r.get('best_ms', nan):.4f} | "
              f"{r.get('best_tb_s', nan):.2f} | {r['default_ms']:.4f} | {r.get('w8a16_ms', nan):.4f} | {r.get('scaled_mm_16_rows_ms', nan):.4f} | {base:.4f} | "
              f"{r.get('best_ms', nan) / base:.2f} | {timed}/{len(r['sweep'])}{' cut' if r.get('cut_short') else ''} |")
    for weights in ("bf16", "fp8", "w8a8"):
        for m in ms:
            sel = [r for r in rows if r["weights"] == weights and r["m"] == m and "best_ms" in r]
            if len(sel) == num_shapes:
                best = sum(r["best_ms"] * (1 if r["layer"] == "lm_head" else layers) for r in sel)
                base = sum(cublas.get((r["layer"], m), nan) * (1 if r["layer"] == "lm_head" else layers)
                           for r in sel)
                extra = ""
                if weights == "w8a8":
                    extra = f"; W8A16 GEMV {layers * sum(r['w8a16_ms'] for r in sel):.3f} ms"
                print(f"step GEMVs ({weights} weights, m={m}, {layers} layers): best {best:.3f} ms vs "
                      f"cuBLAS bf16 {base:.3f} ms{extra}")


if __name__ == "__main__":
    main()
