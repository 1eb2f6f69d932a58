"""SiLU(gate) * up on the fused gate_up projection output (one fused kernel on CUDA). With quantize=True
the product comes out quantized per token for an FP8 linear (Fp8Rows; on CUDA in the same kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.quantization.fp8 import Fp8Rows


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, quantize: bool = False) -> torch.Tensor | Fp8Rows:
        if use_fused(gate_up):
            kernels = kernel_module("activation")
            if quantize:
                return Fp8Rows(*kernels.silu_and_mul_fp8(gate_up), gate_up.dtype)
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return Fp8Rows.of(out) if quantize else out
