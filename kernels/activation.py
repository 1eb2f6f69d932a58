"""SiLU(gate) * up over the fused gate_up projection output [T, 2I] -> [T, I], one pass.

Rounded as torch rounds F.silu(gate) * up in the activation dtype: silu in float32, cast, then the
product in that dtype.

silu_and_mul_fp8 also quantizes the products for the FP8 down projection: per-row e4m3 codes and
float32 scales, bit for bit fp8_quant.quantize_rows(silu_and_mul(x)). The scale needs the row's amax
before any code is written. Many rows: one program takes a whole row, held in registers when it fits
(fp8_quant.row_plan: up to MAX_ROW_IN_REGISTERS products, the 8B model's 14336 included), else two passes
over it in pieces (products and amax, then the products again and their codes), without the round trip
of the products through memory. A few rows (SPREAD_MAX_ROWS: decode at small batches) are spread over
many programs instead, in one launch: each writes its products, and the last of a row's programs to
finish reads the row back from the L2 and quantizes it (common.last_to_arrive).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import fp8_quant
from .common import (
    FP8_DTYPE,
    arrival_counts,
    few_row_warps,
    last_to_arrive,
    next_power_of_2,
    pdl_options,
    wait_for_predecessor,
)
from .fp8_quant import quantize_row_in_registers, row_plan, row_scale, store_codes

BLOCK = 1024
# Up to this many rows silu_and_mul_fp8 spreads each row over programs (the products, then the codes from
# the row's last program): one program a row leaves most SMs idle. On the H200 at the 8B model's 14336
# (scripts/gpu/bench_elementwise.py, the spread in two launches then): 3.5 us against 6.4 at 1 row, 3.9
# against 6.4 at 16, 5.1 against 6.5 at 64. Read at each launch.
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
    x_ptr, out_ptr, codes_ptr, scales_ptr, arrivals_ptr, stride_x, stride_o, stride_c, n_cols,
    CODES_OUT: tl.constexpr, ROW_BLOCK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    y = _silu_mul(x_ptr + row * stride_x, offs, mask, n_cols)
    out_row = out_ptr + row * stride_o
    tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    # The row's last program to finish reads the row's products back (from the L2: the others' stores are
    # ordered before by last_to_arrive) and writes its codes and scale. arrivals: a count per row.
    if CODES_OUT:
        if last_to_arrive(arrivals_ptr + row, tl.num_programs(1)):
            cols = tl.arange(0, ROW_BLOCK)
            products = tl.load(out_row + cols, mask=cols < n_cols, other=0.0, cache_modifier=".cg")
            quantize_row_in_registers(products, codes_ptr + row * stride_c + cols, cols < n_cols, scales_ptr + row)


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


def _silu_and_mul_rows(x2: torch.Tensor, quantized: bool = False) -> tuple[torch.Tensor, ...]:
    """The products of gate_up rows x2 [M, 2I] -> ([M, I],), ceil(I / BLOCK) programs a row; quantized:
    (products, codes [M, I], scales [M, 1]), each row's codes written by its last program (a row of at
    most fp8_quant.MAX_ROW_IN_REGISTERS)."""
    m, n = x2.shape[0], x2.shape[1] // 2
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    codes = torch.empty(m, n, dtype=FP8_DTYPE, device=x2.device) if quantized else out
    scales = torch.empty(m, 1, dtype=torch.float32, device=x2.device) if quantized else out
    row_block = next_power_of_2(n)
    if m:
        _silu_and_mul_kernel[(m, triton.cdiv(n, BLOCK))](
            x2, out, codes, scales, arrival_counts(x2.device, m) if quantized else out, x2.stride(0),
            out.stride(0), codes.stride(0), n,
            CODES_OUT=quantized, ROW_BLOCK=row_block if quantized else BLOCK, BLOCK=BLOCK,
            num_warps=few_row_warps(row_block) if quantized else 4, **pdl_options(),
        )  # fmt: skip
    return (out, codes, scales) if quantized else (out,)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    (out,) = _silu_and_mul_rows(_gate_up_rows(x))
    return out.view(*x.shape[:-1], out.shape[-1])


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> (FP8 codes [M, I], float32 scales [M, 1]), M the number of rows of x:
    quantize_rows(silu_and_mul(x)) flattened to rows, in one launch."""
    x2 = _gate_up_rows(x)
    n = x2.shape[1] // 2
    if 0 < x2.shape[0] <= SPREAD_MAX_ROWS and BLOCK < n <= fp8_quant.MAX_ROW_IN_REGISTERS:  # see SPREAD_MAX_ROWS
        return _silu_and_mul_rows(x2, quantized=True)[1:]
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
