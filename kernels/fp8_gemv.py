"""FP8-weight GEMM for a few rows (decode): y [M, N] = x [M, K] @ (W [N, K] e4m3 codes x scale [N])^T.

At decode sizes the FP8 linear is bound by reading its weights: this kernel reads the codes once, casts
each tile to the activations' dtype in registers (exact: every e4m3 value is a float16 / bfloat16 value)
and multiplies on the tensor cores with float32 accumulation, applying the per-output-channel scales at
the end. The activations are not quantized (W8A16): half the weight bytes of bf16 and no per-token
quantize step, with at least the accuracy of the W8A8 path it replaces for small M.

Grid: one program per BLOCK_N output channels, each looping over K; the rows (M <= MAX_M) are padded to
the dot's 16 in registers. Tile sizes are autotuned per (N, K) on first use (eagerly: the runner's
warm-up and CUDA-graph warm-up call it before any capture).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, check_last_dim_contiguous, dot_precision

MAX_M = 16  # rows this kernel serves; larger batches are compute-bound: FP8 tensor-core GEMMs
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_CONFIGS = (
    [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64})]
    if _INTERPRETING
    else [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4, num_stages=s)
        for n, k, s in ((16, 256, 4), (16, 512, 3), (32, 256, 4), (32, 512, 3), (64, 128, 4), (64, 256, 3))
    ]
)


@triton.autotune(configs=_CONFIGS, key=["N", "K"])
@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    acc = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= MAX_M; float16, bfloat16 or float32), weight [N, K] float8_e4m3fn, scale [N] float32
    -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_M:
        raise ValueError(f"fp8_gemv serves up to {MAX_M} rows, got {m}")
    if weight.dtype != FP8_DTYPE or weight.shape[1] != k or scale.numel() != n:
        raise ValueError(f"fp8_gemv needs an [N, {k}] {FP8_DTYPE} weight and N scales, got "
                         f"{tuple(weight.shape)} {weight.dtype} and {scale.numel()} scales")
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _fp8_gemv_kernel[grid](x, weight, scale.reshape(-1).float().contiguous(), y, m, n, k, x.stride(0),
                           weight.stride(0), y.stride(0), PRECISION=dot_precision(x.dtype), BLOCK_M=16)
    return y


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product in float64 (codes times scales), rounded to x's dtype once."""
    dequantized = weight.double() * scale.reshape(-1, 1).double()
    return (x.double() @ dequantized.t()).to(x.dtype)
