#!/usr/bin/env python3
"""Does asking the L2 for a weight ahead of time (cp.async.bulk.prefetch) make the GEMV that reads it later
faster? (Session 12 on the H200: no. After a prefetch the GEMV took 1.6 to 2.1 times as long, even with
10 us between them; a prefetch by the GEMV itself before its PDL wait slowed it too. Kept as the record.) At batch 1 the HBM idles while the small kernels between two GEMVs
run (rotary, attention, norms: ~10 us before o_proj); a prefetch issued there could fill the L2 with the
next weight.

Per case, a CUDA graph of 8 rounds, each on its own copy of the weight (rotated past the L2): [a prefetch
kernel of G programs over the whole weight] -> [a one-program kernel that spins T us: the small kernels]
-> [the W8A8 GEMV at one row, the table's configuration]. Reported: the round's time less the spin's, in us,
against the same round without the prefetch; also the prefetch then the GEMV at once (T = 0).

  python scripts/gpu/bench_l2_prefetch.py [--json OUT]
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
from tokenspeed_kernels.gemv import gemv, pick_config  # noqa: E402

from scripts.gpu.bench_gemv import SHAPES as GEMV_SHAPES  # noqa: E402
from scripts.gpu.bench_gemv import time_ms  # noqa: E402

DEV = torch.device("cuda")
ROUNDS = 8
SHAPES = {name: GEMV_SHAPES[name] for name in ("o", "qkv", "down")}


@triton.jit
def prefetch_to_l2(addresses, nbytes):
    """Ask the L2 to fetch nbytes from each address (sm_90; multiples of 16): fire and forget."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
                              [addresses, nbytes], dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _spin_kernel(out_ptr, ns):
    start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    now = start
    while now - start < ns:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr, now - start)


@triton.jit
def _prefetch_kernel(w_ptr, per_program, total, CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p asks for bytes [p * per_program, (p + 1) * per_program) in CHUNK-byte pieces."""
    offs = tl.program_id(0).to(tl.int64) * per_program + tl.arange(0, CHUNKS).to(tl.int64) * CHUNK
    size = tl.minimum(total - offs, CHUNK).to(tl.int32)
    prefetch_to_l2(w_ptr + tl.minimum(offs, total - 16), tl.where(size > 0, size, 16))


def prefetch(w: torch.Tensor, programs: int, chunk: int) -> None:
    total = w.numel() * w.element_size()
    per = triton.cdiv(triton.cdiv(total, programs), chunk) * chunk
    _prefetch_kernel[(triton.cdiv(total, per),)](w, per, total, CHUNK=chunk, CHUNKS=triton.next_power_of_2(per // chunk))


def round_us(fn, copies: int) -> float:
    return time_ms(fn, copies) * 1e3


def shape_rows(n: int, k: int, gen: torch.Generator, sink: torch.Tensor) -> dict[str, float]:
    """Every case at one weight shape, us a round (the spin's time taken off)."""
    weights = [fp8_quant.quantize_rows(torch.randn(n, k, generator=gen, device=DEV) * 0.02) for _ in range(ROUNDS)]
    weights = [(w, s.view(-1)) for w, s in weights]
    codes, scales = fp8_quant.quantize_rows(torch.randn(1, k, generator=gen, device=DEV).bfloat16())
    cfg = pick_config(1, n, k, torch.float8_e4m3fn, fp8_x=True)

    def run(i: int, spin_us: int = 0, programs: int = 0, chunk: int = 0) -> None:
        if programs:
            prefetch(weights[i][0], programs, chunk)
        if spin_us:
            _spin_kernel[(1,)](sink, spin_us * 1000)
        gemv(codes, weights[i][0], weights[i][1], cfg, scales, torch.bfloat16)

    rows: dict[str, float] = {"gemv alone": round_us(run, ROUNDS)}
    for spin_us in (0, 5, 10):
        spin = round_us(lambda i, s=spin_us: _spin_kernel[(1,)](sink, s * 1000), ROUNDS) if spin_us else 0.0
        rows[f"spin {spin_us}"] = spin
        rows[f"spin {spin_us} + gemv"] = round_us(lambda i, s=spin_us: run(i, s), ROUNDS) - spin
        for programs in (16, 66, 132):
            for chunk in (16 << 10, 64 << 10):
                us = round_us(lambda i, s=spin_us, p=programs, c=chunk: run(i, s, p, c), ROUNDS) - spin
                rows[f"prefetch {programs}x{chunk >> 10}K, spin {spin_us} + gemv"] = us
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    sink = torch.zeros(1, dtype=torch.int64, device=DEV)
    report: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        report[name] = shape_rows(n, k, gen, sink)
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    for name, rows in report.items():
        print(f"\n{name}: us a round, the spin's time taken off")
        for case, us in rows.items():
            print(f"| {case} | {us:.2f} |")


if __name__ == "__main__":
    main()
