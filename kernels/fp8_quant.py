"""FP8 (e4m3) quantization in Triton: the rounding shared by the kernels that write FP8 codes, and
per-row quantization of activations (one program per row: the row's amax, then its codes).

quantize_rows(x) gives what torch's `scale = max(amax(|x|), 1e-12) / 448; (x / scale).clamp(-448,
448).to(float8_e4m3fn)` gives with IEEE divisions (app/worker/quantization/fp8.py's quantize_rows),
bit for bit, in one launch instead of about six (abs, amax, clamp, divide, clamp, cast); at 512 rows
the unfused ops were ~18% of the 8B model's FP8 decode step on the H200.

The kernels round to the e4m3 grid themselves (to nearest, ties to even) before the cast, so the cast
only sees representable values: on the GPU the cast would round the same way, but Triton's
interpreter (the CPU tests) rounds half up and drops the carry into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, check_last_dim_contiguous

FP8_MAX = 448.0  # the largest finite e4m3 value; the cast alone does not saturate on the GPU
MIN_AMAX = 1e-12  # an all-zero row still gets a positive scale
BLOCK = 1024


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


@triton.jit
def _quantize_e4m3(x, scale):
    y = tl.math.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's x / scale
    return _round_to_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scales_ptr, K, stride_x, stride_codes, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
    tl.store(scales_ptr + row, scale)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        codes = _quantize_e4m3(x, scale)
        tl.store(codes_ptr + row * stride_codes + offs, codes.to(codes_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16, fp16 or fp32; rows contiguous) -> (FP8 codes [M, K], float32 scales [M, 1])."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes [M, K] rows, got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _quantize_rows_kernel[(x.shape[0],)](
            x, codes, scales, x.shape[1], x.stride(0), codes.stride(0), BLOCK=min(BLOCK, triton.next_power_of_2(x.shape[1]))
        )  # fmt: skip
    return codes, scales


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_AMAX)
    scale = amax / torch.full_like(amax, FP8_MAX)  # a true division on every device (CUDA torch turns
    # division by a Python number into a multiply by its reciprocal)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
