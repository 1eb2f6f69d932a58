"""SiLU(gate) * up on the fused gate_up projection output (one fused kernel on CUDA). For an FP8 linear
the product comes out in the form it takes (Handoff): quantized per token (Fp8Rows; on CUDA in the same
kernel), or with its amax (RowsWithAmax, for the decode-sized GEMV)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.quantization.fp8 import Fp8Input, Fp8Rows, Handoff, RowsWithAmax, hand_over


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor, handoff: Handoff = Handoff.PLAIN) -> torch.Tensor | Fp8Input:
        if use_fused(gate_up):
            kernels = kernel_module("activation")
            if handoff is Handoff.CODES:
                return Fp8Rows(*kernels.silu_and_mul_fp8(gate_up), gate_up.dtype)
            if handoff is Handoff.AMAX:
                return RowsWithAmax(*kernels.silu_and_mul_amax(gate_up))
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return hand_over(F.silu(gate) * up, handoff)
