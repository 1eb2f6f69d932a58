#!/usr/bin/env python3
"""A decoder layer's FP8 linears with the kernels around them, unfused against fused (kernels/gemv_fused.py),
Llama-3.1-8B shapes, under programmatic dependent launch, in a CUDA graph, at 1 to 16 rows.

Unfused, as the step ran them: add_rms_norm_fp8, qkv GEMV, quantize_rows (the attention output), o GEMV,
add_rms_norm_fp8, gate_up GEMV, silu_and_mul_fp8 (two launches), down GEMV. Fused: norm_gemv (qkv),
gemv_add (o), norm_gemv gated (gate_up), gemv_add (down). The attention is left out of both (o reads a
fixed row). LAYERS layers of their own weights (past the L2) a graph; the median of 10 replays, in us a
layer, and the weight bytes' time at the copy rate given (--copy-gbps, H200.md's measured copy rate).
Also checks the fused chain's qkv output against the unfused one's (relative error).

  python scripts/gpu/bench_fused_layer.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from tokenspeed_kernels import activation, fp8_quant, gemv_fused, rmsnorm  # noqa: E402
from tokenspeed_kernels.common import set_pdl  # noqa: E402
from tokenspeed_kernels.gemv import gemv  # noqa: E402
from tokenspeed_kernels.gemv_fused import gemv_add, norm_gemv  # noqa: E402

from scripts.gpu.bench_gemv import time_ms  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HIDDEN, INTER, QKV = 4096, 14336, 6144
LAYERS = 8
EPS = 1e-5


def weights(gen: torch.Generator) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    shapes = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
    out = []
    for _ in range(LAYERS):
        layer = {}
        for name, (n, k) in shapes.items():
            codes, scales = fp8_quant.quantize_rows(torch.randn(n, k, generator=gen, device=DEV) * 0.02)
            layer[name] = (codes, scales.view(-1))
        out.append(layer)
    return out


def unfused_layer(w: dict, residual: torch.Tensor, delta: torch.Tensor, attn: torch.Tensor,
                  norm: torch.Tensor) -> torch.Tensor:  # fmt: skip
    codes, scales = rmsnorm.add_rms_norm_fp8(delta, residual, norm, EPS)
    qkv = gemv(codes, *w["qkv"], x_scale=scales, out_dtype=BF16)
    codes, scales = fp8_quant.quantize_rows(attn)
    o = gemv(codes, *w["o"], x_scale=scales, out_dtype=BF16)
    codes, scales = rmsnorm.add_rms_norm_fp8(o, residual, norm, EPS)
    gate_up = gemv(codes, *w["gate_up"], x_scale=scales, out_dtype=BF16)
    codes, scales = activation.silu_and_mul_fp8(gate_up)
    delta.copy_(gemv(codes, *w["down"], x_scale=scales, out_dtype=BF16))
    return qkv


def fused_layer(w: dict, residual: torch.Tensor, attn: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    qkv = norm_gemv(residual, norm, EPS, *w["qkv"])
    gemv_add(attn, *w["o"], residual)
    products, parts = norm_gemv(residual, norm, EPS, *w["gate_up"], gated=True)
    gemv_add(products, *w["down"], residual, parts)
    return qkv


def pieces_layer(piece: str, w: dict, residual: torch.Tensor, delta: torch.Tensor, attn: torch.Tensor,
                 norm: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The unfused layer with one piece folded (timing only: the residual adds are left where they were)."""
    if piece == "qkv":
        qkv = norm_gemv(residual, norm, EPS, *w["qkv"])
    else:
        codes, scales = rmsnorm.add_rms_norm_fp8(delta, residual, norm, EPS)
        qkv = gemv(codes, *w["qkv"], x_scale=scales, out_dtype=BF16)
    if piece == "o":  # x quantized by the GEMV from its own amax, no add
        o = torch.empty_like(residual)
        gemv_fused._launch(attn, *w["o"], o, None)
    else:
        codes, scales = fp8_quant.quantize_rows(attn)
        o = gemv(codes, *w["o"], x_scale=scales, out_dtype=BF16)
    if piece == "gate_up":  # SiLU in gate_up's epilogue; down quantizes from the partial maxima
        products, parts = norm_gemv(residual, norm, EPS, *w["gate_up"], gated=True)
        codes, scales = fp8_quant.quantize_rows_with_amax(products, parts, 64)
        delta.copy_(gemv(codes, *w["down"], x_scale=scales, out_dtype=BF16))
        return qkv
    codes, scales = rmsnorm.add_rms_norm_fp8(o, residual, norm, EPS)
    gate_up = gemv(codes, *w["gate_up"], x_scale=scales, out_dtype=BF16)
    if piece == "down":  # the products with partial maxima (SiLU's first launch), quantized by down's GEMV
        parts = torch.empty(gate_up.shape[0], INTER // activation.BLOCK, dtype=torch.float32, device=DEV)
        products = activation._silu_and_mul_rows(gate_up, parts)
        gemv_fused._launch(products, *w["down"], delta, None, in_parts=parts)
    else:
        codes, scales = activation.silu_and_mul_fp8(gate_up)
        delta.copy_(gemv(codes, *w["down"], x_scale=scales, out_dtype=BF16))
    return qkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--copy-gbps", type=float, default=4250.0)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--pieces", action="store_true", help="also the unfused layer with one piece folded at a time")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    layers = weights(gen)
    norm = (torch.rand(HIDDEN, generator=gen, device=DEV) + 0.5).to(BF16)
    layer_bytes = sum(w.numel() for w, _ in layers[0].values())
    floor_us = layer_bytes / (args.copy_gbps * 1e3)
    report = {"copy_floor_us": floor_us, "rows": {}}
    set_pdl(True)
    try:
        for m in map(int, args.rows.split(",")):
            attn = torch.randn(m, HIDDEN, generator=gen, device=DEV).to(BF16)
            residual = torch.randn(m, HIDDEN, generator=gen, device=DEV).to(BF16)
            delta = torch.zeros_like(residual)
            # the first layer's qkv output both ways, from the same residual stream
            want = unfused_layer(layers[0], residual.clone(), torch.zeros_like(residual), attn, norm)
            got = fused_layer(layers[0], residual.clone(), attn, norm)
            error = float((got.double() - want.double()).norm() / want.double().norm())
            unfused = time_ms(lambda i, r=residual, d=delta, a=attn: unfused_layer(layers[i], r, d, a, norm), LAYERS)
            fused = time_ms(lambda i, r=residual, a=attn: fused_layer(layers[i], r, a, norm), LAYERS)
            report["rows"][m] = {"unfused_us": unfused * 1e3, "fused_us": fused * 1e3, "qkv_rel_error": error}
            if args.pieces:
                report["rows"][m]["pieces_us"] = {
                    piece: 1e3 * time_ms(lambda i, p=piece, r=residual, d=delta, a=attn: pieces_layer(
                        p, layers[i], r, d, a, norm), LAYERS) for piece in ("qkv", "o", "gate_up", "down")
                }  # fmt: skip
    finally:
        set_pdl(False)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"weights at {args.copy_gbps:.0f} GB/s: {floor_us:.1f} us a layer")
    print("| rows | unfused, us a layer | fused | fused / unfused | qkv rel. error |\n|---|---|---|---|---|")
    for m, r in report["rows"].items():
        print(f"| {m} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | {r['fused_us'] / r['unfused_us']:.3f} | "
              f"{r['qkv_rel_error']:.1e} |")
    for m, r in report["rows"].items():
        for piece, us in r.get("pieces_us", {}).items():
            print(f"rows {m}: {piece} folded alone: {us:.1f} us a layer ({us - r['unfused_us']:+.1f})")


if __name__ == "__main__":
    main()
