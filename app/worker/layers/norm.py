"""RMSNorm, computed exactly as Hugging Face does (float32 statistics, weight applied in the input dtype).

On CUDA one fused kernel does it, and add_forward also folds in the residual add before it. With
quantize=True the normed rows come out quantized per token for an FP8 linear (Fp8Rows: on CUDA in the
same kernel, with the codes quantize_rows gives for the unquantized output).
"""

from __future__ import annotations

import torch
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.quantization.fp8 import Fp8Rows


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor, quantize: bool = False) -> torch.Tensor | Fp8Rows:
        if use_fused(x):
            kernels = kernel_module("rmsnorm")
            if quantize:
                return Fp8Rows(*kernels.rms_norm_fp8(x, self.weight, self.eps), self._out_dtype(x))
            return kernels.rms_norm(x, self.weight, self.eps)
        out = self._torch_forward(x)
        return Fp8Rows.of(out) if quantize else out

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, quantize: bool = False
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, then this norm. On CUDA the
        residual tensor is updated in place (the caller owns it)."""
        if use_fused(x):
            kernels = kernel_module("rmsnorm")
            if quantize:
                codes, scales = kernels.add_rms_norm_fp8(x, residual, self.weight, self.eps)
                return Fp8Rows(codes, scales, self._out_dtype(x)), residual
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        out = self._torch_forward(residual)
        return Fp8Rows.of(out) if quantize else out, residual

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(self.weight.dtype, x.dtype)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)
