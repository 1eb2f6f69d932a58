"""RMSNorm, alone or fused with the residual add that precedes it, as Hugging Face computes it:
statistics in float32, the normalised row cast back to the input dtype, then times the weight in
that dtype. The fused form first forms residual = x + residual in the input dtype (transformers'
`hidden = residual + hidden`), stores it, and normalises it: one read of each input, two writes.

rms_norm_fp8 / add_rms_norm_fp8 also quantize the normalised row for the FP8 linear that reads it
(per-row e4m3 codes and float32 scales): the same kernel with FP8_OUT set, so that the row, rounded to
the output dtype exactly as rms_norm stores it, gets fp8_quant.quantize_rows' codes and scale, bit for
bit, without that second launch (one write of one byte an element instead of a write and a read of
two). The kernel holds the whole row in registers, so its amax is at hand before the codes are written.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import FEW_ROWS, FP8_DTYPE, few_row_warps, next_power_of_2, pdl_options, wait_for_predecessor
from .fp8_quant import quantize_row_in_registers


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    scales_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    CODES_VECTOR: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if FP8_OUT:  # see _codes_vector
        offs = tl.max_contiguous(offs, CODES_VECTOR)
    mask = offs < n_cols
    # The norm's weight is no kernel's output: under PDL it is read while the kernel before ends (from the
    # HBM at decode: the weights streamed since its last read have evicted it from the L2).
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    wait_for_predecessor(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype)
    # Triton promotes the product as torch.promote_types(weight, x) does: it is rms_norm's output row.
    y = w * normed
    if FP8_OUT:  # out_ptr holds FP8 codes
        quantize_row_in_registers(y, out_ptr + row * stride_o + offs, mask, scales_ptr + row)
    else:
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _codes_vector(x: torch.Tensor, weight: torch.Tensor) -> int:
    """Elements in 16 bytes of the narrower input: how far the FP8 path declares the row's offsets
    contiguous. Else the codes alone would be stored 16 a thread and the compiler would lay the whole row
    out so, summing its squares in another order than rms_norm does (float addition is not associative:
    an ulp off at times). So every access of the fused kernel has rms_norm's vector width, hence its
    layout: the same sum, to the bit (the same ops in the same layouts up to the sum; checked on the
    sm_90 compile by tests/kernels/test_fp8_fused.py). rms_norm's own launch ignores it."""
    return 16 // min(x.element_size(), weight.element_size())


def _check_rows(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows contiguous in their last dimension")
    if residual is not None and not residual.is_contiguous():
        raise ValueError("the residual is updated in place and must be contiguous")


def _norm_rows(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    scales: torch.Tensor | None,
) -> None:
    """The kernel over x's rows into out [rows, K]: the normalised rows, or their FP8 codes when scales
    [rows, 1] is given. Both outputs come from one launch configuration, so that the row sums (whose
    order depends on it) and hence the rows are the same."""
    _check_rows(x, residual)
    x2 = x.reshape(-1, x.shape[-1])
    res2 = residual.view(-1, residual.shape[-1]) if residual is not None else x2
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, scales if scales is not None else out, x2.stride(0), res2.stride(0),
            out.stride(0), x2.shape[1], eps, HAS_RESIDUAL=residual is not None, FP8_OUT=scales is not None,
            CODES_VECTOR=_codes_vector(x, weight), BLOCK=next_power_of_2(x2.shape[1]),
            num_warps=_num_warps(x2.shape[0], x2.shape[1]), **pdl_options(),
        )  # fmt: skip


def _num_warps(rows: int, width: int) -> int:
    """common.few_row_warps for a few rows, else 4. On the H200 at the 8B model's 4096, side by side with
    4 warps: FP8 decode 1.4% faster at batch 1 (8 warps: 1.0%), 0.4% slower at 256; bf16 unchanged at both:
    at one row a program's latency is the kernel's, so more warps share it."""
    return few_row_warps(next_power_of_2(width)) if rows <= FEW_ROWS else 4


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(math.prod(x.shape[:-1]), x.shape[-1], dtype=out_dtype, device=x.device)
    _norm_rows(x, residual, weight, eps, out, None)
    return out.view(*x.shape[:-1], x.shape[-1])


def _launch_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = math.prod(x.shape[:-1])
    codes = torch.empty(rows, x.shape[-1], dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    _norm_rows(x, residual, weight, eps, codes, scales)
    return codes, scales


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual <- x + residual (in place); returns rms_norm(residual)."""
    return _launch(x, residual, weight, eps)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (FP8 codes [M, K], float32 scales [M, 1]), M the number of rows of x:
    quantize_rows(rms_norm(x, weight, eps)) flattened to rows, in one launch."""
    return _launch_fp8(x, None, weight, eps)


def add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in place, as add_rms_norm); returns rms_norm_fp8(residual)."""
    return _launch_fp8(x, residual, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.copy_(x + residual)
    return rms_norm_reference(residual, weight, eps)
