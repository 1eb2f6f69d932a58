"""RMSNorm, computed exactly as Hugging Face does (float32 statistics, weight applied in the input dtype).

On CUDA one fused kernel does it, and add_forward also folds in the residual add before it. For an FP8
linear the normed rows come out in the form it takes (Handoff): quantized per token (Fp8Rows: on CUDA in
the same kernel, with the codes quantize_rows gives for the unquantized output), or with their amax
(RowsWithAmax, for the decode-sized GEMV that quantizes them as it reads them).
"""

from __future__ import annotations

import torch
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.quantization.fp8 import Fp8Input, Fp8Rows, Handoff, RowsWithAmax, hand_over


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor, handoff: Handoff = Handoff.PLAIN) -> torch.Tensor | Fp8Input:
        if use_fused(x):
            kernels = kernel_module("rmsnorm")
            if handoff is Handoff.CODES:
                return Fp8Rows(*kernels.rms_norm_fp8(x, self.weight, self.eps), self._out_dtype(x))
            if handoff is Handoff.AMAX:
                return RowsWithAmax(*kernels.rms_norm_amax(x, self.weight, self.eps))
            return kernels.rms_norm(x, self.weight, self.eps)
        return hand_over(self._torch_forward(x), handoff)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, handoff: Handoff = Handoff.PLAIN
    ) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, then this norm. On CUDA the
        residual tensor is updated in place (the caller owns it)."""
        if use_fused(x):
            kernels = kernel_module("rmsnorm")
            if handoff is Handoff.CODES:
                codes, scales = kernels.add_rms_norm_fp8(x, residual, self.weight, self.eps)
                return Fp8Rows(codes, scales, self._out_dtype(x)), residual
            if handoff is Handoff.AMAX:
                return RowsWithAmax(*kernels.add_rms_norm_amax(x, residual, self.weight, self.eps)), residual
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return hand_over(self._torch_forward(residual), handoff), residual

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(self.weight.dtype, x.dtype)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)
