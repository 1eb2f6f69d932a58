#!/usr/bin/env python3
"""Batch 1, FP8 weights: the kernel that makes a linear's input and the W8A8 GEMV after it, two ways.

- codes: the producer quantizes its row (rms_norm_fp8 / silu_and_mul_fp8: one program a row) and the
  GEMV multiplies the codes (the measured table's configuration);
- amax: the producer stores its row and its amax (rms_norm_amax / silu_and_mul_amax: silu over many
  programs) and the GEMV quantizes the row as it reads it (gemv's x_amax), per configuration.

Each case is captured in a CUDA graph under programmatic dependent launch, as the decode step runs: 8
(producer, GEMV) pairs over 8 weights (rotated past the L2), timed with CUDA events. Reported: us a
pair, and each GEMV output's relative error against the codes path's.

  python scripts/gpu/bench_amax_handoff.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tokenspeed_kernels import activation, rmsnorm  # noqa: E402
from tokenspeed_kernels.common import set_pdl  # noqa: E402
from tokenspeed_kernels.gemv import GemvConfig, gemv, pick_config  # noqa: E402

from app.worker.quantization.fp8 import quantize_rows  # noqa: E402
from scripts.bench_latency import median_cuda_ms  # noqa: E402
from tests.support.numerics import relative_error  # noqa: E402

DEV = torch.device("cuda")
PAIRS = 8
HIDDEN, INTER = 4096, 14336
SHAPES = {"qkv": (6144, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}


def amax_configs(n: int, k: int) -> list[GemvConfig]:
    table = pick_config(1, n, k, torch.float8_e4m3fn, fp8_x=True)
    split = 4 if k > 8192 else 1
    out = [table]
    for block_n in (32, 64, 128):
        for block_k in (128, 256):
            for stages in (3, 4):
                out.append(GemvConfig(True, block_n, block_k, split, 4, stages, w_as_a=False, fp8_operands=True))
    out.append(GemvConfig(True, 64, 256, split, 4, 3, w_as_a=True, fp8_operands=True))
    return list(dict.fromkeys(out))


def graph_us(pair: Callable[[int], object]) -> float:
    """Median us of one (producer, GEMV) pair from replays of PAIRS of them under PDL."""
    set_pdl(True)
    try:
        for i in range(PAIRS):
            pair(i)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(PAIRS):
                pair(i)
    finally:
        set_pdl(False)
    graph.replay()
    return median_cuda_ms(graph.replay, 30) * 1e3 / PAIRS


def bench_shape(name: str, n: int, k: int, gen: torch.Generator) -> list[dict]:
    weights = [quantize_rows(torch.randn(n, k, generator=gen, device=DEV) * 0.02) for _ in range(PAIRS)]
    weights = [(w, s.view(-1)) for w, s in weights]
    norm_w = torch.rand(k, generator=gen, device=DEV).to(torch.bfloat16)
    source = torch.randn(1, 2 * k if name == "down" else k, generator=gen, device=DEV).to(torch.bfloat16)

    def codes_in() -> tuple[torch.Tensor, torch.Tensor]:
        if name == "down":
            return activation.silu_and_mul_fp8(source)
        return rmsnorm.rms_norm_fp8(source, norm_w, 1e-5)

    def amax_in() -> tuple[torch.Tensor, torch.Tensor]:
        if name == "down":
            return activation.silu_and_mul_amax(source)
        return rmsnorm.rms_norm_amax(source, norm_w, 1e-5)

    outs: dict[str, torch.Tensor] = {}

    def codes_pair(i: int) -> None:
        codes, scales = codes_in()
        outs["codes"] = gemv(codes, weights[i][0], weights[i][1], None, scales, torch.bfloat16)

    rows = [{"shape": name, "path": "codes", "config": "table", "us": graph_us(codes_pair), "rel_err": 0.0}]
    want = outs["codes"].clone()
    for cfg in amax_configs(n, k):
        def amax_pair(i: int, cfg: GemvConfig = cfg) -> None:
            values, amax = amax_in()
            outs["amax"] = gemv(values, weights[i][0], weights[i][1], cfg, x_amax=amax)

        try:
            us = graph_us(amax_pair)
            err = relative_error(outs["amax"], want)
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is reported, not fatal
            rows.append({"shape": name, "path": "amax", "config": str(cfg), "error": repr(exc)[:200]})
            continue
        rows.append({"shape": name, "path": "amax", "config": str(cfg), "us": us, "rel_err": err})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows = [row for name, (n, k) in SHAPES.items() for row in bench_shape(name, n, k, gen)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print("| shape | path | config | us a pair | rel. error vs codes |\n|---|---|---|---|---|")
    for r in rows:
        cfg = r["config"].replace("GemvConfig(", "").replace(")", "")
        print(f"| {r['shape']} | {r['path']} | {cfg} | {r.get('us', float('nan')):.2f} | "
              f"{r.get('rel_err', r.get('error'))} |")


if __name__ == "__main__":
    main()
