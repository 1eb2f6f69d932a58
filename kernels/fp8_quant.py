"""FP8 (e4m3) quantization in Triton: the rounding shared by the kernels that write FP8 codes, and
per-row quantization of activations (one program per row: the row's amax, then its codes).

quantize_rows(x) gives what torch's `scale = max(amax(|x|), 1e-12) / 448; (x / scale).clamp(-448,
448).to(float8_e4m3fn)` gives with IEEE divisions (app/worker/quantization/fp8.py's quantize_rows),
bit for bit, in one launch instead of about six (abs, amax, clamp, divide, clamp, cast); at 512 rows
the unfused ops were ~18% of the 8B model's FP8 decode step on the H200.

The cast to e4m3 rounds to nearest, ties to even, on the GPU, as torch's does. Under Triton's
interpreter (the CPU tests), whose cast rounds half up, the kernels round to the e4m3 grid themselves
first (_round_to_e4m3), so both give the codes torch gives.

quantize_rows_with_amax(x, amax) takes the rows' amax from partial maxima that the kernel which made x
found (activation.silu_and_mul_fp8 at a few rows), and spreads each row's codes over many programs.

A row of up to MAX_ROW_IN_REGISTERS elements is read once and held in registers (amax and codes from
the same values, warps chosen by its width: row_plan); a wider one is read twice in LOOP_BLOCK pieces
(amax, then codes). The kernels that produce activations quantize their own rows with the same jitted
helpers (row_scale, quantize_row_in_registers, store_codes): rmsnorm.rms_norm_fp8 / add_rms_norm_fp8 and
activation.silu_and_mul_fp8 give quantize_rows' codes and scales of their unfused output, bit for bit.

cast_to_e4m3(x) gives the codes of x at scale 1 (torch's `x.clamp(-448, 448).to(float8_e4m3fn)`): the
attention queries that flashinfer's FP8 prefill kernels (FA3, Hopper) read beside an FP8 cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (
    FEW_ROWS,
    FP8_DTYPE,
    INTERPRETING,
    check_last_dim_contiguous,
    check_rows,
    few_row_warps,
    next_power_of_2,
    pdl_options,
    wait_for_predecessor,
)

# The largest finite e4m3 value; codes are clamped to it. The interpreter's cast does not saturate; on the
# GPU (sm_89+) the cast is cvt.rn.satfinite, which saturates finite values too.
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # an all-zero row still gets a positive scale
# The widest row a program holds in registers: 16384 elements at 16 warps are 32 a thread (the 8B
# model's 14336-wide MLP rows fit). Read at each launch, so tests can lower it to run the loop.
MAX_ROW_IN_REGISTERS = 16384
LOOP_BLOCK = 1024  # the piece a wider row is read in, twice
LOOP_WARPS = 4
CAST_BLOCK = 1024  # elements a cast_to_e4m3 program covers


class RowPlan(NamedTuple):
    """How a one-program-per-row kernel covers its row: BLOCK, ONE_PASS and num_warps."""

    block: int
    one_pass: bool
    num_warps: int


def row_plan(k: int, few_rows: bool = False) -> RowPlan:
    """The whole row in registers when it fits (one read of it), else two passes over LOOP_BLOCK pieces.
    Warps grow with the row, about 16 elements a thread up to 16 warps (8 for few_rows: at most FEW_ROWS),
    so that a program has enough loads in flight: at a few hundred rows there are only a few programs an SM."""
    if k > MAX_ROW_IN_REGISTERS:
        return RowPlan(LOOP_BLOCK, False, LOOP_WARPS)
    block = next_power_of_2(k)
    return RowPlan(block, True, few_row_warps(block) if few_rows else min(16, max(4, block // 512)))


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as float32.

    Adding and subtracting C = 1.5 * 2^23 * ulp rounds |x| to a multiple of ulp in float32 arithmetic
    (round to nearest even); ulp is 2^(e - 3) for |x| in [2^e, 2^(e+1)) and 2^-9 (the subnormal step)
    below 2^-6. The sign is put back afterwards so that -0 stays -0, as torch keeps it.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    magnitude_bits = bits & 0x7FFFFFFF
    exponent = tl.maximum(magnitude_bits >> 23, 121)  # biased; 121 is 2^-6, the smallest normal e4m3
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    rounded = (magnitude + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# Under Triton's interpreter (the CPU tests) the cast to e4m3 rounds half up and drops the carry into the
# exponent, so values are put on the e4m3 grid first. On the GPU the cast (cvt.rn.satfinite) rounds to
# nearest even itself, as torch's does: the same codes without the ~10 integer operations a value
# (the FP8 KV write took twice the bf16 one's time with them; tests/gpu check the codes bit for bit).
_ROUND_BEFORE_CAST = tl.constexpr(INTERPRETING)


@triton.jit
def _quantize_e4m3(x, scale):
    """x / scale (IEEE division, as torch's) clamped to +-448, ready for the cast to e4m3."""
    y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), scale), -448.0), 448.0)
    if _ROUND_BEFORE_CAST:
        y = _round_to_e4m3(y)
    return y


@triton.jit
def row_scale(amax):
    """The scale of a row from its amax (float32): IEEE division, as torch's tensor division gives."""
    return tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def store_codes(x, scale, codes_ptrs, mask):
    tl.store(codes_ptrs, _quantize_e4m3(x, scale).to(codes_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def quantize_row_in_registers(x, codes_ptrs, mask, scale_ptr):
    """A whole row held in registers (x over a block, mask the row's lanes) -> its scale and codes stored.
    The lanes past the row are left out of the amax whatever they hold."""
    scale = row_scale(tl.max(tl.where(mask, tl.abs(x.to(tl.float32)), 0.0), axis=0))
    tl.store(scale_ptr, scale)
    store_codes(x, scale, codes_ptrs, mask)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scales_ptr, K, stride_x, stride_codes, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    codes_row = codes_ptr + row * stride_codes
    if ONE_PASS:  # BLOCK covers the row
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        quantize_row_in_registers(x, codes_row + offs, offs < K, scales_ptr + row)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = row_scale(tl.max(amax, axis=0))
        tl.store(scales_ptr + row, scale)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            store_codes(tl.load(x_row + offs, mask=offs < K, other=0.0), scale, codes_row + offs, offs < K)


@triton.jit
def _quantize_pieces_kernel(
    x_ptr, amax_ptr, codes_ptr, scales_ptr, K, stride_x, stride_codes,
    PARTS: tl.constexpr, PARTS_BLOCK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_predecessor(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, PARTS_BLOCK)
    amax = tl.max(tl.load(amax_ptr + row * PARTS + parts, mask=parts < PARTS, other=0.0), axis=0)
    scale = row_scale(amax)
    if tl.program_id(1) == 0:
        tl.store(scales_ptr + row, scale)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    store_codes(tl.load(x_ptr + row * stride_x + offs, mask=mask), scale, codes_ptr + row * stride_codes + offs, mask)


def quantize_rows_with_amax(x: torch.Tensor, amax: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with partial maxima of its rows' magnitudes amax [M, P] (the row's amax the largest) ->
    quantize_rows(x), over M x ceil(K / block) programs: where few rows leave one program a row on a few
    SMs, the producer finds the amax across many programs and this kernel spreads the codes likewise."""
    check_last_dim_contiguous("x", x)
    if amax.dim() != 2 or amax.shape[0] != x.shape[0] or amax.dtype != torch.float32 or not amax.is_contiguous():
        raise ValueError(f"amax must be contiguous float32 [M={x.shape[0]}, parts], got {tuple(amax.shape)} {amax.dtype}")
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        parts = amax.shape[1]
        _quantize_pieces_kernel[(x.shape[0], triton.cdiv(x.shape[1], block))](
            x, amax, codes, scales, x.shape[1], x.stride(0), codes.stride(0),
            PARTS=parts, PARTS_BLOCK=next_power_of_2(parts), BLOCK=block, **pdl_options(),
        )  # fmt: skip
    return codes, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32; rows contiguous) -> (FP8 codes [M, K], float32 scales [M, 1])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K] rows, got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        plan = row_plan(x.shape[1], few_rows=x.shape[0] <= FEW_ROWS)
        _quantize_rows_kernel[(x.shape[0],)](
            x, codes, scales, x.shape[1], x.stride(0), codes.stride(0),
            BLOCK=plan.block, ONE_PASS=plan.one_pass, num_warps=plan.num_warps, **pdl_options(),
        )  # fmt: skip
    return codes, scales


@triton.jit
def _cast_kernel(x_ptr, codes_ptr, width, stride_x, stride_codes, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < width
    store_codes(tl.load(x_ptr + row * stride_x + offs, mask=mask), 1.0, codes_ptr + row * stride_codes + offs, mask)


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim] (rows may be strided views, as of a fused QKV output) -> its e4m3 codes at scale
    1, contiguous: x clamped to +-448 and rounded to nearest even."""
    check_rows("x", x)
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    width = x.shape[1] * x.shape[2]
    if x.shape[0] and width:
        _cast_kernel[(x.shape[0], triton.cdiv(width, CAST_BLOCK))](
            x, codes, width, x.stride(0), width, BLOCK=CAST_BLOCK
        )
    return codes


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_AMAX)
    scale = amax / torch.full_like(amax, FP8_MAX)  # a true division on every device (CUDA torch turns
    # division by a Python number into a multiply by its reciprocal)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
