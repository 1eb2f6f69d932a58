"""A decoder layer's FP8 linears at decode sizes, with the kernels around them folded into their GEMVs
(kernels/gemv_fused.py): the norms and the per-token quantization of their outputs run inside the qkv and
gate_up GEMVs, SiLU(gate) * up in gate_up's epilogue, the quantization of the attention output and of the
products in the o and down GEMVs, and both residual adds in o's and down's epilogues. Per layer four
kernels around the attention instead of nine: at one row each hand-over between kernels costs more than
the work it carries.

A layer runs so for a batch of up to MAX_ROWS rows on CUDA when its four linears run the W8A8 GEMV with
per-token scales (FP8 weights, dynamic activation scales, FP8 tensor cores), on one GPU (row-parallel
layers all-reduce before the residual add), with no bias on o, gate_up and down (qkv's is added after
its GEMV) and rows the GEMV reads whole (kernels/gemv_fused.MAX_ROW). Otherwise the unfused layer runs.
"""

from __future__ import annotations

import torch

from app.worker.layers.fused import kernel_module
from app.worker.layers.linear import Linear, MergedLinear, RowParallelLinear
from app.worker.layers.norm import RMSNorm

MAX_ROWS = 16


def serves(qkv: MergedLinear, o: RowParallelLinear, gate_up: MergedLinear, down: RowParallelLinear) -> bool:
    """Whether a layer with these linears can run fused (see the module docstring); rows aside."""
    widest = kernel_module("gemv_fused").MAX_ROW
    return (
        all(linear.quant is not None and linear.quant.runs_w8a8_gemv(linear) for linear in (qkv, o, gate_up, down))
        and o.tp.size == 1
        and down.tp.size == 1
        and o.bias is None
        and gate_up.bias is None
        and down.bias is None
        and qkv.weight.shape[1] <= widest
        and o.weight.shape[1] <= widest
    )


def norm_linear(residual: torch.Tensor, norm: RMSNorm, linear: Linear) -> torch.Tensor:
    """linear(norm(residual)), the norm's output quantized per token inside the GEMV."""
    y = kernel_module("gemv_fused").norm_gemv(residual, norm.weight, norm.eps, linear.weight, linear.weight_scale)
    return y if linear.bias is None else y + linear.bias


def norm_gate_up(residual: torch.Tensor, norm: RMSNorm, gate_up: MergedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate) * up of gate_up(norm(residual)), and the partial maxima that quantize it (add_linear's
    parts)."""
    return kernel_module("gemv_fused").norm_gemv(
        residual, norm.weight, norm.eps, gate_up.weight, gate_up.weight_scale, gated=True
    )


def add_linear(x: torch.Tensor, linear: Linear, residual: torch.Tensor, parts: torch.Tensor | None = None) -> None:
    """residual += linear(x), in place; x quantized per token inside the GEMV (its amax from parts when
    given)."""
    kernel_module("gemv_fused").gemv_add(x, linear.weight, linear.weight_scale, residual, parts)
