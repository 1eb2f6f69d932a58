#!/usr/bin/env python3
"""Batch 1, FP8 weights: the W8A8 GEMV's configurations timed where the decode step runs them, after the
kernel that makes their input, under programmatic dependent launch, in a CUDA graph.

bench_gemv.py times each GEMV alone, without PDL. In the step every GEMV follows a small kernel (the
RMSNorm before qkv and gate_up, quantize_rows before o, SiLU-and-mul before down) and, under PDL, is
scheduled while that kernel runs, so a configuration's ramp and tail weigh differently.
Here: 8 (producer, GEMV) pairs over 8 weights (rotated past the L2) per graph, each of bench_gemv's W8A8
tiles at splits 1, 2, 4 and 8; the median of 10 replays (bench_gemv's time_ms), in us a pair. Prints, per
layer, the table's configuration (kernels/gemv.py's _MEASURED) and the fastest ones.

  python scripts/gpu/bench_gemv_chain.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tokenspeed_kernels import activation, fp8_quant, rmsnorm  # noqa: E402
from tokenspeed_kernels.gemv import GemvConfig, gemv, pick_config  # noqa: E402

from scripts.gpu.bench_gemv import SHAPES, W8A8_TILES, time_ms  # noqa: E402

DEV = torch.device("cuda")
PAIRS = 8


def configs() -> list[GemvConfig]:
    return [GemvConfig(True, bn, bk, split, warps, stages, bn >= 64, fp8_operands=True)
            for split in (1, 2, 4, 8) for bn, bk, stages, warps in W8A8_TILES]  # fmt: skip


def deeper_pipelines(table: GemvConfig, k: int) -> list[GemvConfig]:
    """The table's tile with more loads in flight a program: up to a whole split's tiles (8 stages), while
    the stages' weight tiles fit in 200 KB of shared memory."""
    out = []
    for split in (1, 2, 4, 8):
        for stages in (2, 3, 4, 5, 6, 8):
            if stages * table.block_n * table.block_k <= 200 * 1024 and k // split >= table.block_k:
                out.append(replace(table, split_k=split, num_stages=stages))
    return out


def producer(name: str, k: int, gen: torch.Generator) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The kernel that makes the layer's input at one row, as the FP8 model runs it."""
    if name == "down":
        gate_up = torch.randn(1, 2 * k, generator=gen, device=DEV).bfloat16()
        return lambda: activation.silu_and_mul_fp8(gate_up)
    x = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
    if name == "o":
        return lambda: fp8_quant.quantize_rows(x)
    residual = torch.randn(1, k, generator=gen, device=DEV).bfloat16()
    weight = torch.rand(k, generator=gen, device=DEV).bfloat16() + 0.5
    return lambda: rmsnorm.add_rms_norm_fp8(x, residual, weight, 1e-5)


def fp8_weights(n: int, k: int, copies: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """copies [n, k] weights as FP8 codes with their per-channel scales [n]."""
    weights = []
    for _ in range(copies):
        codes, scales = fp8_quant.quantize_rows(torch.randn(n, k, generator=gen, device=DEV) * 0.02)
        weights.append((codes, scales.view(-1)))
    return weights


def print_fastest(report: dict[str, dict]) -> None:
    """Per layer the table's pair and the three fastest of report[layer]["us"] ({configuration: us})."""
    print("| layer | table, us a pair | fastest | us | x table |\n|---|---|---|---|---|")
    for name, r in report.items():
        for cfg, us in sorted(r["us"].items(), key=lambda item: item[1])[:3]:
            short = re.sub(r"^\w+Config\(|\)$", "", cfg).replace("use_dot=True, ", "")
            print(f"| {name} | {r['table_us']:.2f} | {short} | {us:.2f} | {us / r['table_us']:.3f} |")


def pair_us(make_input: Callable, weights: list, cfg: GemvConfig) -> float:
    def pair(i: int) -> None:
        codes, scales = make_input()
        gemv(codes, weights[i][0], weights[i][1], cfg, scales, torch.bfloat16)

    return time_ms(pair, len(weights), pdl=True) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stages", action="store_true",
                        help="the table's tiles at 2 to 8 stages and 1 to 8 splits instead of the sweep")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    report = {}
    for name, (n, k) in SHAPES.items():
        weights = fp8_weights(n, k, PAIRS, gen)
        make_input = producer(name, k, gen)
        table = pick_config(1, n, k, torch.float8_e4m3fn, fp8_x=True)
        times = {}
        candidates = deeper_pipelines(table, k) if args.stages else configs()
        for cfg in dict.fromkeys([table, *candidates]):
            try:
                times[str(cfg)] = pair_us(make_input, weights, cfg)
            except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is left out
                print(f"{name} {cfg}: {type(exc).__name__}", file=sys.stderr)
        report[name] = {"table": str(table), "table_us": times[str(table)], "us": times}
        del weights
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_fastest(report)


if __name__ == "__main__":
    main()
