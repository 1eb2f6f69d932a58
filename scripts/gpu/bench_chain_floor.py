#!/usr/bin/env python3
"""What a kernel boundary costs in the batch-1 decode step, and what a GEMV costs beyond its weight bytes:
the floor under the hand-overs that session 13's experiments could not move (docs/benchmarks.md).

1. A chain of CHAIN tiny kernels in a CUDA graph (each waits for the one before under PDL, reads one value
   the one before wrote and writes one): 1 program and 132 programs a kernel, PDL off and on. The time a
   kernel is the cost of a boundary with next to no work.
2. The W8A8 GEMV of each 8B layer shape (the table's configuration, one row, PDL on, after a tiny kernel):
   its weights rotated past the L2 (as the step reads them), and one weight read over and over (from
   the L2 after the first). The difference is what reading from the HBM adds; what is left over the L2 time
   is the kernel's own fixed cost.

  python scripts/gpu/bench_chain_floor.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from tokenspeed_kernels import fp8_quant  # noqa: E402
from tokenspeed_kernels.common import pdl_options, wait_for_predecessor  # noqa: E402
from tokenspeed_kernels.gemv import gemv, pick_config  # noqa: E402

from scripts.gpu.bench_gemv import SHAPES, time_ms  # noqa: E402
from scripts.gpu.bench_gemv_chain import fp8_weights  # noqa: E402

DEV = torch.device("cuda")
CHAIN = 64
GEMVS = 8


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, USE_PDL: tl.constexpr):
    wait_for_predecessor(USE_PDL)
    pid = tl.program_id(0)
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1.0)


def chain_us(programs: int, pdl: bool) -> float:
    buffers = [torch.zeros(programs, device=DEV) for _ in range(2)]
    hop = lambda i: _hop_kernel[(programs,)](buffers[i % 2], buffers[(i + 1) % 2], **pdl_options())  # noqa: E731
    return time_ms(hop, CHAIN, pdl) * 1e3


def gemv_us(n: int, k: int, rotate: bool, gen: torch.Generator) -> float:
    """GEMVS (tiny kernel, GEMV) pairs in a graph under PDL; us a pair."""
    copies = GEMVS if rotate else 1
    weights = fp8_weights(n, k, copies, gen)
    x, xs = fp8_quant.quantize_rows(torch.randn(1, k, generator=gen, device=DEV))
    cfg = pick_config(1, n, k, torch.float8_e4m3fn, fp8_x=True)
    flag = torch.zeros(1, device=DEV)

    def pair(i: int) -> None:
        _hop_kernel[(1,)](flag, flag, **pdl_options())
        gemv(x, *weights[i % copies], cfg, xs, torch.bfloat16)

    return time_ms(pair, GEMVS, pdl=True) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--copy-gbps", type=float, default=4250.0)
    args = parser.parse_args()
    report: dict = {"chain_us": {}, "gemv_us": {}}
    for programs in (1, 132):
        for pdl in (False, True):
            report["chain_us"][f"{programs} programs, PDL {'on' if pdl else 'off'}"] = chain_us(programs, pdl)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        report["gemv_us"][name] = {
            "hbm": gemv_us(n, k, True, gen),
            "l2": gemv_us(n, k, False, gen),
            "bytes_at_copy_rate": n * k / (args.copy_gbps * 1e3),
        }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print("| tiny kernel chain | us a kernel |\n|---|---|")
    for key, us in report["chain_us"].items():
        print(f"| {key} | {us:.2f} |")
    print("| layer (tiny kernel + GEMV) | weights from the HBM, us | one weight, from the L2, us | "
          "bytes at the copy rate, us |\n|---|---|---|---|")
    for name, r in report["gemv_us"].items():
        print(f"| {name} | {r['hbm']:.2f} | {r['l2']:.2f} | {r['bytes_at_copy_rate']:.2f} |")


if __name__ == "__main__":
    main()
