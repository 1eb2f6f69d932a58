#!/usr/bin/env python3
"""Batch 1, FP8 weights: the stream-K GEMV (kernels/gemv_stream_k.py) against the W8A8 table's GEMV, each
after the kernel that makes its input, under PDL, in a CUDA graph (bench_gemv_chain's pairs).

The table's GEMV gives each program whole tiles, so at one row SMs hold one program or two (or none: qkv's
96 programs on 132 SMs); stream-K gives every program the same number of (N block, K chunk) units. Per
layer: the table's pair and every stream-K configuration of the sweep (N blocks of 64 or 128, K chunks of
128 to 512, 3 or 4 stages, one or two programs an SM), each first checked against the table's output
(the sums' order differs: relative L2 within 1e-3). Prints, per layer, the table's pair and the fastest
stream-K ones, in us a pair.

  python scripts/gpu/bench_gemv_stream_k.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tokenspeed_kernels.gemv import gemv, pick_config  # noqa: E402
from tokenspeed_kernels.gemv_stream_k import StreamKConfig, gemv_stream_k  # noqa: E402

from scripts.gpu.bench_gemv import SHAPES, time_ms  # noqa: E402
from scripts.gpu.bench_gemv_chain import (  # noqa: E402
    DEV,
    PAIRS,
    fp8_weights,
    pair_us,
    print_fastest,
    producer,
)
from tests.support.numerics import relative_error  # noqa: E402


def sweep() -> list[StreamKConfig]:
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    return [StreamKConfig(bn, bk, programs, 4, stages)
            for bn in (64, 128) for bk in (128, 256, 512) for stages in (3, 4) for programs in (sms, 2 * sms)
            if stages * bn * bk <= 200 * 1024]  # fmt: skip


def measure_layer(name: str, n: int, k: int, gen: torch.Generator) -> dict:
    """The table's pair and every stream-K configuration's, in us, on PAIRS weights of one layer."""
    weights = fp8_weights(n, k, PAIRS, gen)
    make_input = producer(name, k, gen)
    table = pick_config(1, n, k, torch.float8_e4m3fn, fp8_x=True)
    codes, scales = make_input()
    want = gemv(codes, weights[0][0], weights[0][1], table, scales, torch.bfloat16)
    row = {"table": str(table), "table_us": pair_us(make_input, weights, table), "us": {}}
    for cfg in sweep():
        try:
            got = gemv_stream_k(codes, weights[0][0], cfg, weights[0][1], scales, torch.bfloat16)
            error = relative_error(got.float(), want.float())
            if error > 1e-3:
                print(f"{name} {cfg}: relative error {error:.2e} against the table's GEMV", file=sys.stderr)
                continue

            def pair(i: int, cfg: StreamKConfig = cfg) -> None:
                codes, scales = make_input()
                gemv_stream_k(codes, weights[i][0], cfg, weights[i][1], scales, torch.bfloat16)

            row["us"][str(cfg)] = time_ms(pair, PAIRS, pdl=True) * 1e3
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is left out
            print(f"{name} {cfg}: {type(exc).__name__}", file=sys.stderr)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    report = {}
    for name, (n, k) in SHAPES.items():
        report[name] = measure_layer(name, n, k, gen)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print_fastest(report)


if __name__ == "__main__":
    main()
