"""SiLU(gate) * up over the fused gate_up projection output [T, 2I] -> [T, I], one pass.

Rounded as torch rounds F.silu(gate) * up in the activation dtype: silu in float32, cast, then the
product in that dtype.

silu_and_mul_fp8 also quantizes the products for the FP8 down projection: per-row e4m3 codes and
float32 scales, bit for bit fp8_quant.quantize_rows(silu_and_mul(x)), without the round trip of the
products through memory. The scale needs
the row's amax before any code is written, so one program takes a whole row: held in registers when it
fits (fp8_quant.row_plan: up to MAX_ROW_IN_REGISTERS products, the 8B model's 14336 included), else
two passes over it in pieces (products and amax, then the products again and their codes). A few rows
(SPREAD_MAX_ROWS: decode at small batches) are spread over many programs instead, in two launches: the
products with a partial amax a program, then their codes (the same bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .common import FP8_DTYPE, pdl_options, wait_for_predecessor
from .fp8_quant import quantize_row_in_registers, quantize_rows_with_amax, row_plan, row_scale, store_codes

BLOCK = 1024
# Up to this many rows silu_and_mul_fp8 spreads each row over programs in two launches (the products
# with a partial amax a program, then their codes, fp8_quant.quantize_rows_with_amax): one program a row
# leaves most SMs idle. On the H200 at the 8B model's 14336 (scripts/gpu/bench_elementwise.py): 3.5 us
# against 6.4 at 1 row, 3.9 against 6.4 at 16, 5.1 against 6.5 at 64. Read at each launch.
SPREAD_MAX_ROWS = 64


@triton.jit
def _silu_mul(x_row, offs, mask, n_cols):
    """SiLU(gate) * up at offs of a gate_up row, in its dtype (masked lanes 0)."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    return silu * up


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, amax_ptr, stride_x, stride_o, n_cols,
    AMAX_OUT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    y = _silu_mul(x_ptr + row * stride_x, offs, mask, n_cols)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    if AMAX_OUT:  # this program's part of the row's amax: amax [rows, programs a row]
        part = tl.max(tl.where(mask, tl.abs(y.to(tl.float32)), 0.0), axis=0)
        tl.store(amax_ptr + row * tl.num_programs(1) + tl.program_id(1), part)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    stride_x,
    stride_c,
    n_cols,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    codes_row = codes_ptr + row * stride_c
    if ONE_PASS:  # BLOCK covers the row
        offs = tl.arange(0, BLOCK)
        y = _silu_mul(x_row, offs, offs < n_cols, n_cols)
        quantize_row_in_registers(y, codes_row + offs, offs < n_cols, scales_ptr + row)
    else:  # the products twice: cheaper than a round trip through memory
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, offs, offs < n_cols, n_cols).to(tl.float32)))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(scales_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            store_codes(_silu_mul(x_row, offs, offs < n_cols, n_cols), scale, codes_row + offs, offs < n_cols)


def _gate_up_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] as rows [T, 2I] (a view when it can be)."""
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows contiguous in their last dimension")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs [..., 2I] gate_up rows, got width {x.shape[-1]}")
    return x.reshape(-1, x.shape[-1])


def _silu_and_mul_rows(x2: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """The products of gate_up rows x2 [M, 2I] -> [M, I], ceil(I / BLOCK) programs a row; with amax
    [M, programs a row] also each program's largest |product| there."""
    n = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, BLOCK))](
            x2, out, out if amax is None else amax, x2.stride(0), out.stride(0), n,
            AMAX_OUT=amax is not None, BLOCK=BLOCK, **pdl_options(),
        )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = _silu_and_mul_rows(_gate_up_rows(x))
    return out.view(*x.shape[:-1], out.shape[-1])


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> (FP8 codes [M, I], float32 scales [M, 1]), M the number of rows of x:
    quantize_rows(silu_and_mul(x)) flattened to rows: one launch, or two for a few wide rows."""
    x2 = _gate_up_rows(x)
    n = x2.shape[1] // 2
    if 0 < x2.shape[0] <= SPREAD_MAX_ROWS and n > BLOCK:  # see SPREAD_MAX_ROWS
        amax = torch.empty(x2.shape[0], triton.cdiv(n, BLOCK), dtype=torch.float32, device=x.device)
        return quantize_rows_with_amax(_silu_and_mul_rows(x2, amax), amax, BLOCK)
    codes = torch.empty(x2.shape[0], n, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        plan = row_plan(n)
        _silu_and_mul_fp8_kernel[(x2.shape[0],)](
            x2, codes, scales, x2.stride(0), codes.stride(0), n,
            BLOCK=plan.block, ONE_PASS=plan.one_pass, num_warps=plan.num_warps, **pdl_options(),
        )  # fmt: skip
    return codes, scales


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
