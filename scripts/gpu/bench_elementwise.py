#!/usr/bin/env python3
"""The memory-bound kernels around the GEMMs, at the Llama-3.1-8B shape and the row counts of the
offline run's steps (512: a decode step; 8704: an 8,192-token prefill chunk beside 512 decodes): time
and the share of the copy bandwidth (bytes read + written, measured in the same run) for
- the rotary + KV write (bf16 and FP8 cache) per heads-a-program (kernels/rotary.py's HEADS_PER_PROGRAM);
- RMSNorm with the residual add, and SiLU-and-mul, each alone, followed by the per-token FP8
  quantization, and fused with it (the FP8 model's W8A8 inputs);
- the per-token quantization alone (o_proj's input);
- a greedy step's reduction over the logits: torch's argmax and bad-row max against kernels/greedy.py;
- SiLU-and-mul's fused quantization and quantize_rows per row plan (fp8_quant.row_plan's two ways: the
  row held in registers, or read twice in pieces), and SiLU's spread over programs in two launches
  (activation.SPREAD_MAX_ROWS, its default at a few rows).
Each figure is the median of 10 CUDA-graph replays of 10 launches (bench_gemv's time_ms). Correctness:
every fused output and every launch setting is compared with the unfused composition (bit for bit)
before it is timed; the unfused kernels are the references ("reference" in the table).

  python scripts/gpu/bench_elementwise.py [--json OUT] [--rows 1,512,8704]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tokenspeed_kernels import activation, fp8_quant, greedy, kv_write, rmsnorm, rotary  # noqa: E402

from app.bench.latency import copy_bandwidth  # noqa: E402
from app.worker.quantization.fp8 import quantize_rows as torch_quantize_rows  # noqa: E402
from app.worker.sampling.processors import find_bad_rows  # noqa: E402
from app.worker.sampling.reduce import argmax_rows  # noqa: E402
from scripts.gpu.bench_gemv import time_ms  # noqa: E402

HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD, VOCAB = 4096, 14336, 32, 8, 128, 128256
LAUNCHES = 10
DEV = torch.device("cuda")
T = TypeVar("T")


def replay_us(fn: Callable[[], object]) -> float:
    """Median microseconds of one fn() from graph replays of LAUNCHES calls."""
    return time_ms(lambda _: fn(), LAUNCHES) * 1e3


# SiLU-and-mul's fused quantization per row plan: the whole row in registers (the default at 14336), or
# two passes over LOOP_BLOCK pieces with LOOP_WARPS warps.
ROW_PLANS = {
    "registers": {},
    **{f"loop {block}x{warps}": {"MAX_ROW_IN_REGISTERS": 0, "LOOP_BLOCK": block, "LOOP_WARPS": warps}
       for block, warps in ((1024, 4), (2048, 8), (4096, 8))},
}  # fmt: skip


def with_settings(module: ModuleType, settings: dict[str, int], fn: Callable[[], T]) -> Callable[[], T]:
    """fn run with the module's launch settings (read at each launch) set, then restored."""

    def run() -> T:
        saved = {name: getattr(module, name) for name in settings}
        for name, value in settings.items():
            setattr(module, name, value)
        try:
            return fn()
        finally:
            for name, value in saved.items():
                setattr(module, name, value)

    return run


def same_codes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


def rotary_cases(rows: int) -> list[tuple[str, Callable[[], object], int, bool | None]]:
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD, device=DEV).bfloat16()
    q = qkv[:, : Q_HEADS * HEAD].view(rows, Q_HEADS, HEAD)
    k = qkv[:, Q_HEADS * HEAD : (Q_HEADS + KV_HEADS) * HEAD].view(rows, KV_HEADS, HEAD)
    v = qkv[:, (Q_HEADS + KV_HEADS) * HEAD :].view(rows, KV_HEADS, HEAD)
    angles = torch.rand(4096, HEAD // 2, device=DEV) * 6
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, 4096, (rows,), device=DEV)
    slots = torch.randperm(rows * 2, device=DEV)[:rows]
    cases = []
    for cache_dtype, name in ((torch.bfloat16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        caches = [torch.zeros(rows * 2, KV_HEADS, HEAD, device=DEV).to(cache_dtype) for _ in range(2)]
        kv_bytes = 2 * rows * KV_HEADS * HEAD * caches[0].element_size()
        moved = 2 * rows * (Q_HEADS + KV_HEADS) * HEAD * 2 + rows * KV_HEADS * HEAD * 2 + kv_bytes
        for heads in (8, 16, 32, 64):
            run = with_settings(rotary, {"HEADS_PER_PROGRAM": heads}, lambda caches=caches: rotary.rotate_and_write_kv(
                q, k, v, cos, sin, positions, *caches, slots))  # fmt: skip
            ok = rotary_equals_unfused(qkv, cos, sin, positions, slots, cache_dtype, heads)
            cases.append((f"rotary+kv {name} cache, {heads} heads/program", run, moved, ok))
    return cases


def rotary_equals_unfused(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                          slots: torch.Tensor, cache_dtype: torch.dtype, heads: int) -> bool:  # fmt: skip
    """The fused rotary + KV write at `heads` a program gives rotary_inplace then write_kv's bits."""
    results = []
    for fused in (True, False):
        x = qkv.clone()
        q = x[:, : Q_HEADS * HEAD].view(-1, Q_HEADS, HEAD)
        k = x[:, Q_HEADS * HEAD : (Q_HEADS + KV_HEADS) * HEAD].view(-1, KV_HEADS, HEAD)
        v = x[:, (Q_HEADS + KV_HEADS) * HEAD :].view(-1, KV_HEADS, HEAD)
        caches = [torch.zeros(len(slots) * 2, KV_HEADS, HEAD, device=DEV).to(cache_dtype) for _ in range(2)]
        if fused:
            with_settings(rotary, {"HEADS_PER_PROGRAM": heads}, lambda q=q, k=k, v=v, caches=caches: (
                rotary.rotate_and_write_kv(q, k, v, cos, sin, positions, *caches, slots)))()  # fmt: skip
        else:
            rotary.rotary_inplace(q, k, cos, sin, positions)
            kv_write.write_kv(k, v, *caches, slots)
        results.append([x, *(c.view(torch.uint8) for c in caches)])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def norm_and_activation_cases(rows: int) -> list[tuple[str, Callable[[], object], int, bool | None]]:
    x = torch.randn(rows, HIDDEN, device=DEV).bfloat16()
    residual = torch.randn(rows, HIDDEN, device=DEV).bfloat16()
    weight = torch.rand(HIDDEN, device=DEV).bfloat16() + 0.5
    gate_up = torch.randn(rows, 2 * INTER, device=DEV).bfloat16()
    wide = torch.randn(rows, INTER, device=DEV).bfloat16()
    res_a, res_b = residual.clone(), residual.clone()
    norm_ok = same_codes(rmsnorm.add_rms_norm_fp8(x, res_a, weight, 1e-5),
                         fp8_quant.quantize_rows(rmsnorm.add_rms_norm(x, res_b, weight, 1e-5)))  # fmt: skip
    unfused_silu = fp8_quant.quantize_rows(activation.silu_and_mul(gate_up))

    def silu_fp8() -> tuple[torch.Tensor, torch.Tensor]:
        return activation.silu_and_mul_fp8(gate_up)

    # SiLU's fused quantization one program a row (per row plan), or spread over programs in two launches
    # (activation.SPREAD_MAX_ROWS), at any number of rows
    one_program_a_row = with_settings(activation, {"SPREAD_MAX_ROWS": 0}, silu_fp8)
    spread = with_settings(activation, {"SPREAD_MAX_ROWS": 1 << 30}, silu_fp8)

    def quantize_wide() -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_quant.quantize_rows(wide)

    h, i = rows * HIDDEN, rows * INTER
    return [
        ("add_rms_norm", lambda: rmsnorm.add_rms_norm(x, residual, weight, 1e-5), 8 * h, None),
        ("add_rms_norm, then quantize_rows",
         lambda: fp8_quant.quantize_rows(rmsnorm.add_rms_norm(x, residual, weight, 1e-5)), 8 * h + 3 * h, None),
        ("add_rms_norm_fp8", lambda: rmsnorm.add_rms_norm_fp8(x, residual, weight, 1e-5), 7 * h, norm_ok),
        ("silu_and_mul", lambda: activation.silu_and_mul(gate_up), 6 * i, None),
        ("silu_and_mul, then quantize_rows",
         lambda: fp8_quant.quantize_rows(activation.silu_and_mul(gate_up)), 6 * i + 3 * i, None),
        *[(f"silu_and_mul_fp8, {name}", with_settings(fp8_quant, plan, one_program_a_row), 5 * i,
           same_codes(with_settings(fp8_quant, plan, one_program_a_row)(), unfused_silu))
          for name, plan in ROW_PLANS.items()],
        ("silu_and_mul_fp8, spread over programs", spread, 5 * i + 4 * i, same_codes(spread(), unfused_silu)),
        ("quantize_rows 4096", lambda: fp8_quant.quantize_rows(x), 3 * h, None),
        *[(f"quantize_rows 14336, {name}", with_settings(fp8_quant, plan, quantize_wide), 3 * i,
           same_codes(with_settings(fp8_quant, plan, quantize_wide)(), torch_quantize_rows(wide)))
          for name, plan in ROW_PLANS.items()],
    ]  # fmt: skip


def greedy_cases(rows: int) -> list[tuple[str, Callable[[], object], int, bool | None]]:
    """A greedy step's reduction over bf16 logits: torch's two (argmax_rows, find_bad_rows) against the
    fused one (kernels/greedy.py)."""
    logits = (torch.randn(rows, VOCAB, device=DEV) * 4).bfloat16()
    tokens, bad = greedy.greedy_tokens(logits)
    ok = torch.equal(tokens, argmax_rows(logits)) and torch.equal(bad, find_bad_rows(logits))
    return [
        ("greedy: argmax_rows + find_bad_rows", lambda: (argmax_rows(logits), find_bad_rows(logits)),
         2 * rows * VOCAB * 2, None),
        ("greedy: greedy_tokens", lambda: greedy.greedy_tokens(logits), rows * VOCAB * 2, ok),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rows", default="1,512,8704")
    args = parser.parse_args()
    bandwidth = copy_bandwidth(DEV)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, fn, moved, ok in rotary_cases(rows) + norm_and_activation_cases(rows) + greedy_cases(rows):
            us = replay_us(fn)
            results.append({"rows": rows, "kernel": name, "us": us, "bytes": moved,
                            "share_of_copy": moved / (us / 1e6) / bandwidth, "equal_to_unfused": ok})  # fmt: skip
    report = {"copy_bandwidth_bytes_per_s": bandwidth, "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| rows | kernel | us | share of copy | equal to unfused |\n|---|---|---|---|---|")
    for r in results:
        checked = "reference" if r["equal_to_unfused"] is None else r["equal_to_unfused"]
        print(f"| {r['rows']} | {r['kernel']} | {r['us']:.1f} | {r['share_of_copy']:.2f} | {checked} |")
    if any(r["equal_to_unfused"] is False for r in results):
        sys.exit("a fused kernel differs from its unfused composition")


if __name__ == "__main__":
    main()
