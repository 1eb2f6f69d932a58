"""RMSNorm, alone or fused with the residual add that precedes it, as Hugging Face computes it:
statistics in float32, the normalised row cast back to the input dtype, then times the weight in
that dtype. The fused form first forms residual = x + residual in the input dtype (transformers'
`hidden = residual + hidden`), stores it, and normalises it: one read of each input, two writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2, pdl_options, wait_for_predecessor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows contiguous in their last dimension")
    x2 = x.reshape(-1, x.shape[-1])
    res2 = residual.view(-1, residual.shape[-1]) if residual is not None else x2
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, x2.stride(0), res2.stride(0), out.stride(0), x2.shape[1], eps,
            HAS_RESIDUAL=residual is not None, BLOCK=next_power_of_2(x2.shape[1]), **pdl_options(),
        )  # fmt: skip
    return out.view(*x.shape[:-1], x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- x + residual (in place); returns rms_norm(residual)."""
    if not residual.is_contiguous():
        raise ValueError("the residual is updated in place and must be contiguous")
    return _launch(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.copy_(x + residual)
    return rms_norm_reference(residual, weight, eps)
