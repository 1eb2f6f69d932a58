"""RMSNorm, computed exactly as Hugging Face does (float32 statistics, weight applied in the input dtype).

On CUDA one fused kernel does it, and add_forward also folds in the residual add before it."""

from __future__ import annotations

import torch
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return kernel_module("rmsnorm").rms_norm(x, self.weight, self.eps)
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add, then this norm. On CUDA the
        residual tensor is updated in place (the caller owns it)."""
        if use_fused(x):
            return kernel_module("rmsnorm").add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self._torch_forward(residual), residual

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(in_dtype)
