"""SiLU(gate) * up on the fused gate_up projection output (one fused kernel on CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if use_fused(gate_up):
            return kernel_module("activation").silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
