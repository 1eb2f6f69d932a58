"""FP8 (e4m3) numerics: quantize and dequantize with per-row, per-tensor and block scales.

A value v is stored as q = round_e4m3(clamp(v / s, -448, 448)) (round to nearest even) and read back
as q * s. Scales are float32 and always multiply on the way back; checkpoints that call them
`weight_scale_inv` mean the same thing.

Error of one round trip (the bound the tests check): e4m3 keeps 3 mantissa bits, so a value in the
normal range (|v| >= 2^-6 s) is off by at most half an ulp, REL_ERROR = 2^-4 of |v|; below it
(subnormals) the error is at most SUBNORMAL_ERROR = 2^-10 s. With a per-row scale s = amax / 448
nothing is clipped.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
REL_ERROR = 2.0**-4
SUBNORMAL_ERROR = 2.0**-10  # in units of the scale
# amax floor: an all-zero row gets a tiny positive scale instead of a division by zero.
_MIN_AMAX = 1e-12


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale clamped to the e4m3 range (the cast alone may give NaN out of range on CUDA)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row (last dimension) scales amax / 448, float32, shape [..., 1]."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=_MIN_AMAX)
    # Divided by a tensor, not the number: CUDA torch turns division by a Python scalar into a multiply
    # by its reciprocal (an ulp off at times), so the scales would differ between devices and from
    # the fused kernel's IEEE division (kernels/fp8_quant.py).
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row quantization: (codes like x, scales [..., 1]). Rows are output channels of a weight or
    tokens of an activation."""
    scale = row_scales(x)
    return quantize(x, scale), scale


class Fp8Rows(NamedTuple):
    """Activations already quantized per row (token) for an FP8 linear, by the kernel that produced them
    (RMSNorm, SiLU-and-mul): the codes and scales quantize_rows would give, and the activation dtype
    the linear returns."""

    codes: torch.Tensor  # [..., K] float8_e4m3fn
    scales: torch.Tensor  # [..., 1] float32
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> Fp8Rows:
        return cls(*quantize_rows(x), x.dtype)


def dequantize(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def block_scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Scales of a [rows, cols] weight in block x block tiles; edge tiles may be partial."""
    return -(-rows // block[0]), -(-cols // block[1])


def expand_block_scales(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(rows/b0), ceil(cols/b1)] tile scales -> the per-element scales of a [rows, cols] weight."""
    full = scales.float().repeat_interleave(block[0], dim=0)[:rows]
    return full.repeat_interleave(block[1], dim=1)[:, :cols]


def requantize_blocks_to_rows(
    q: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], chunk_rows: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled codes -> per-row codes and scales [rows, 1], a chunk of rows at a time so the
    float32 copy stays small. Each element is rounded once more (to its row's grid), so the result is
    within REL_ERROR of the block-scaled value (plus the subnormal floor)."""
    rows, cols = q.shape
    chunk_rows = max(block[0], chunk_rows // block[0] * block[0])  # chunks start on a tile boundary
    out = torch.empty_like(q)
    out_scales = torch.empty(rows, 1, dtype=torch.float32, device=q.device)
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        tile_rows = scales[start // block[0] : -(-(start + n) // block[0])]
        values = q[start : start + n].float() * expand_block_scales(tile_rows, n, cols, block)
        out[start : start + n], out_scales[start : start + n] = quantize_rows(values)
    return out, out_scales
