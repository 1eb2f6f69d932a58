"""The W8A8 GEMV of kernels/gemv.py with the kernels around it folded in, for a decoder layer's FP8 linears
at a few rows (decode):

- norm_gemv(x, norm_weight, eps, W): RMSNorm of the residual stream x, quantized per token, times W (qkv);
  gated=True: times both halves of gate_up, and SiLU(gate) * up in place of the product, with each
  program's largest |product| a row (the partial maxima that quantize the products for down);
- gemv_add(x, W, residual): x quantized per token (its amax found from x itself, or from the partial
  maxima its producer left), times W, added to the residual stream in place (o, down).

A layer then runs four kernels around its attention where it ran nine (a norm before qkv and gate_up,
quantize_rows before o, SiLU-and-mul in two launches before down): at one row each hand-over from
kernel to kernel costs several microseconds on the H200, far more than the work moved.

How a program quantizes its input: after the PDL wait it reads the whole row of x (a few KB, from the L2,
where the kernel before left it), finds its statistics (the norm's sum of squares, then the amax of the
normed row; or the amax; or the max of the partial maxima), and writes the codes of its own K range and the
row's scale to scratch buffers, as every program of that K range does (the same bytes: a benign race). A
barrier makes them visible to the whole program, whose main loop is the GEMV's own: FP8 codes times FP8
codes on the tensor cores. Rows are quantized one after another: only real rows, not the 16 the tensor
cores pad them to (quantizing in the loop's padded tiles cost more arithmetic than the loads).

The numbers are those of the unfused kernels up to the order of the norm's sum of squares (the rounding
of the rest is the same: rms_norm's, quantize_rows', silu_and_mul's); the residual add is transformers'
`residual + output` in the activation dtype, as add_rms_norm does it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .common import (
    FP8_DTYPE,
    arrival_counts,
    check_last_dim_contiguous,
    dot_precision,
    last_to_arrive,
    next_power_of_2,
    pdl_options,
    wait_for_predecessor,
)
from .fp8_quant import row_scale, store_codes
from .gemv import MAX_M, GemvConfig, _accumulate, _k_loop, _load_k_tile, pick_config

# The widest row a program reads whole for its statistics (all but FROM_PARTS): 32 elements a thread at 4 warps.
MAX_ROW = 8192


@triton.jit
def _row_scale_and_codes(x_row, nw_ptr, parts_row, codes_row, K, k_start, k_end, eps, N_PARTS, NORM: tl.constexpr,
                         FROM_PARTS: tl.constexpr, ROW_BLOCK: tl.constexpr, PARTS_BLOCK: tl.constexpr):  # fmt: skip
    """One row: its scale (from its amax: of x, of RMSNorm(x) with NORM, or the largest partial maximum with
    FROM_PARTS), and the codes of K range [k_start, k_end) stored at codes_row."""
    if FROM_PARTS:  # only the program's range is read
        offs = k_start + tl.arange(0, ROW_BLOCK)
        mask = offs < k_end
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        p = tl.arange(0, PARTS_BLOCK)
        amax = tl.max(tl.load(parts_row + p, mask=p < N_PARTS, other=0.0), axis=0)
    else:
        offs = tl.arange(0, ROW_BLOCK)
        in_row = offs < K
        x = tl.load(x_row + offs, mask=in_row, other=0.0)
        if NORM:  # as rmsnorm's kernel: float32 statistics, cast, times the weight
            x32 = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / K + eps)
            x = tl.load(nw_ptr + offs, mask=in_row, other=0.0) * (x32 * rstd).to(x.dtype)
        amax = tl.max(tl.where(in_row, tl.abs(x.to(tl.float32)), 0.0), axis=0)
        mask = (offs >= k_start) & (offs < k_end)
    scale = row_scale(amax)
    store_codes(x, scale, codes_row + offs, mask)
    return scale


@triton.jit
def _fused_gemv_kernel(
    x_ptr, nw_ptr, in_parts_ptr, codes_ptr, xs_ptr, w_ptr, scale_ptr, y_ptr, out_parts_ptr, sums_ptr,
    arrivals_ptr, M, N, K, K_PER_SPLIT, SPLITS, N_PARTS, eps, stride_xm, stride_wn, stride_ym,
    NORM: tl.constexpr, FROM_PARTS: tl.constexpr, ADD: tl.constexpr, SILU: tl.constexpr, W_AS_A: tl.constexpr, PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, ROW_BLOCK: tl.constexpr, PARTS_BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + N.to(tl.int64) * stride_wn  # SILU: the up half's rows, N below the gate's
    # The weights depend on no kernel: the first tile streams in while the kernel before ends.
    w = _load_k_tile(w_rows, k_start + rk, k_end, n_ok, EVEN_K)
    if SILU:
        w_up = _load_k_tile(up_rows, k_start + rk, k_end, n_ok, EVEN_K)
    wait_for_predecessor(USE_PDL)
    for r in range(0, M):
        scale = _row_scale_and_codes(x_ptr + r * stride_xm, nw_ptr, in_parts_ptr + r * N_PARTS, codes_ptr + r * K,
                                     K, k_start, k_end, eps, N_PARTS, NORM, FROM_PARTS, ROW_BLOCK, PARTS_BLOCK)  # fmt: skip
        tl.store(xs_ptr + r, scale)
    tl.debug_barrier()  # the codes and scales this program stored, visible to all its threads
    codes_rows = codes_ptr + rm[:, None] * K
    acc = _zeros(BLOCK_M, BLOCK_N, W_AS_A)
    x = _load_k_tile(codes_rows, k_start + rk, k_end, m_ok, EVEN_K)
    acc = _accumulate(acc, w, x, True, W_AS_A, False, True, False, PRECISION)
    if SILU:  # no splits (the launcher's rule); one loop streams both halves
        up = _accumulate(_zeros(BLOCK_M, BLOCK_N, W_AS_A), w_up, x, True, W_AS_A, False, True, False, PRECISION)
        for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
            x = _load_k_tile(codes_rows, k0 + rk, k_end, m_ok, EVEN_K)
            w = _load_k_tile(w_rows, k0 + rk, k_end, n_ok, EVEN_K)
            acc = _accumulate(acc, w, x, True, W_AS_A, False, True, False, PRECISION)
            w_up = _load_k_tile(up_rows, k0 + rk, k_end, n_ok, EVEN_K)
            up = _accumulate(up, w_up, x, True, W_AS_A, False, True, False, PRECISION)
    else:
        acc = _k_loop(acc, w_rows, codes_rows, rk, k_start + BLOCK_K, k_end, n_ok, m_ok, True, W_AS_A, False, True,
                      False, PRECISION, EVEN_K, BLOCK_K)  # fmt: skip
    x_scales = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[:, None]
    if W_AS_A:
        acc = tl.trans(acc)
    acc = acc * x_scales
    out_mask = m_ok[:, None] & n_ok[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    if SILU:
        if W_AS_A:
            up = tl.trans(up)
        _store_silu(acc, up * x_scales, scale_ptr, rn, n_ok, N, y, out_parts_ptr + rm * tl.num_programs(0) + pid_n,
                    m_ok, out_mask)  # fmt: skip
    elif PARTIAL:  # sums [SPLITS, M, N], contiguous; the last split to finish adds them in split order
        sums = sums_ptr + rm[:, None] * N + rn[None, :]
        tl.store(sums + pid_k * M * N, acc, mask=out_mask)
        if last_to_arrive(arrivals_ptr + pid_n, SPLITS):
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, SPLITS):
                acc += tl.load(sums + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            _store_out(acc, scale_ptr, rn, n_ok, y, out_mask, ADD)
    else:
        _store_out(acc, scale_ptr, rn, n_ok, y, out_mask, ADD)


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_AS_A: tl.constexpr):
    """A float32 accumulator of the DOT body: [BLOCK_N, BLOCK_M] with the weight as operand A."""
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc


@triton.jit
def _store_out(acc, scale_ptr, rn, n_ok, y, out_mask, ADD: tl.constexpr):
    """The product scaled per channel, cast to y's dtype, and (ADD) added to what y holds."""
    out = (acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]).to(y.dtype.element_ty)
    if ADD:
        out = (out + tl.load(y, mask=out_mask, other=0.0)).to(y.dtype.element_ty)
    tl.store(y, out, mask=out_mask)


@triton.jit
def _store_silu(gate, up, scale_ptr, rn, n_ok, N, y, amax_ptrs, m_ok, out_mask):
    """SiLU(gate) * up as silu_and_mul rounds it (the projections cast to y's dtype first, as the GEMV stores
    them), and the block's largest |product| a row."""
    dtype = y.dtype.element_ty
    gate = (gate * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]).to(dtype)
    up = (up * tl.load(scale_ptr + N + rn, mask=n_ok, other=0.0)[None, :]).to(dtype)
    g32 = gate.to(tl.float32)
    out = (g32 / (1.0 + tl.exp(-g32))).to(dtype) * up
    tl.store(y, out, mask=out_mask)
    amax = tl.max(tl.where(out_mask, tl.abs(out.to(tl.float32)), 0.0), axis=1)
    tl.store(amax_ptrs, amax, mask=m_ok)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, config: GemvConfig | None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0, in_parts: torch.Tensor | None = None,
            add: bool = False, silu: bool = False) -> torch.Tensor | None:  # fmt: skip
    """The kernel over x's rows into y; returns the partial maxima with silu, else None."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    _check(x, weight, scale, norm_weight, in_parts)
    cfg = config or pick_config(m, weight.shape[0], k, FP8_DTYPE, fp8_x=True)
    if silu and config is None:  # a program reads tiles of both halves: half the rows of each
        cfg = replace(cfg, block_n=max(16, cfg.block_n // 2), split_k=1)
    if in_parts is not None and config is None:  # split so that a program's range of x fits in registers
        while triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k > MAX_ROW:
            cfg = replace(cfg, split_k=cfg.split_k + 1)
    problem = cfg.problem(m, FP8_DTYPE, FP8_DTYPE)
    if problem is None and silu and cfg.split_k > 1:
        problem = "the SiLU epilogue takes no split along K"
    if problem is not None:
        raise ValueError(problem)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    if in_parts is not None and k_per_split > MAX_ROW:
        raise ValueError(f"config {cfg}: a split of {k_per_split} is wider than the {MAX_ROW} a program holds")
    splits = triton.cdiv(k, k_per_split)
    n_blocks = triton.cdiv(n, cfg.block_n)
    partial = splits > 1
    codes = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    x_scales = torch.empty(m, dtype=torch.float32, device=x.device)
    out_parts = torch.empty(m, n_blocks, dtype=torch.float32, device=x.device) if silu else None
    sums = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else y
    n_parts = in_parts.shape[1] if in_parts is not None else 1
    unread = x_scales  # stands for the pointers a mode does not read
    _fused_gemv_kernel[(n_blocks, splits)](
        x, unread if norm_weight is None else norm_weight, unread if in_parts is None else in_parts, codes,
        x_scales, weight, scale, y, unread if out_parts is None else out_parts, sums,
        arrival_counts(x.device, n_blocks) if partial else unread, m, n, k, k_per_split, splits, n_parts, eps,
        x.stride(0), weight.stride(0), y.stride(0),
        NORM=norm_weight is not None, FROM_PARTS=in_parts is not None, ADD=add, SILU=silu, W_AS_A=cfg.w_as_a,
        PARTIAL=partial, EVEN_K=k % cfg.block_k == 0, PRECISION=dot_precision(torch.float16),
        BLOCK_M=cfg.block_m(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ROW_BLOCK=next_power_of_2(k_per_split if in_parts is not None else k), PARTS_BLOCK=next_power_of_2(n_parts),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(),
    )  # fmt: skip
    return out_parts


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, norm_weight: torch.Tensor | None,
           in_parts: torch.Tensor | None) -> None:  # fmt: skip
    m, k = x.shape
    if not 1 <= m <= MAX_M or x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the fused GEMV takes 1 to {MAX_M} rows of float16 or bfloat16, got {m} of {x.dtype}")
    check_last_dim_contiguous("x", x)
    if in_parts is None and k > MAX_ROW:
        raise ValueError(f"the fused GEMV reads rows of up to {MAX_ROW} elements whole, got {k}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"the fused GEMV needs contiguous [N, {k}] FP8 codes, got {tuple(weight.shape)} {weight.dtype}")
    if scale.dtype != torch.float32 or scale.numel() != weight.shape[0] or not scale.is_contiguous():
        raise ValueError(f"the fused GEMV needs {weight.shape[0]} contiguous float32 channel scales")
    if norm_weight is not None and (norm_weight.shape != (k,) or not norm_weight.is_contiguous()):
        raise ValueError(f"the norm needs a contiguous [{k}] weight, got {tuple(norm_weight.shape)}")
    if in_parts is not None and (
        in_parts.dim() != 2 or in_parts.shape[0] != m or in_parts.dtype != torch.float32 or not in_parts.is_contiguous()
    ):  # fmt: skip
        raise ValueError(f"partial maxima must be contiguous float32 [M={m}, parts], got {tuple(in_parts.shape)}")


def norm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, scale: torch.Tensor,
              gated: bool = False, config: GemvConfig | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [M, K] 16-bit -> RMSNorm(x) * norm_weight, quantized per token, times weight [N, K] (FP8 codes with
    float32 channel scales [N]): [M, N] in norm_weight and x's promoted dtype. gated: weight is gate_up
    [2I, K]; returns (SiLU(gate) * up [M, I], partial maxima of the products' magnitudes [M, P]: the
    row's amax is the largest), the input of gemv_add(..., in_parts=)."""
    dtype = torch.promote_types(norm_weight.dtype, x.dtype)
    y = torch.empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0], dtype=dtype, device=x.device)
    parts = _launch(x, weight, scale, y, config, norm_weight, eps, silu=gated)
    return (y, parts) if gated else y


def gemv_add(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, residual: torch.Tensor,
             in_parts: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:  # fmt: skip
    """residual [M, N] <- residual + (x [M, K] quantized per token) @ weight^T scaled, in residual's dtype,
    in place; returns residual. The rows' amax: from x, or the largest of in_parts [M, P] (norm_gemv's
    gated output)."""
    if residual.shape != (x.shape[0], weight.shape[0]) or not residual.is_contiguous() or residual.dtype != x.dtype:
        raise ValueError(f"the residual must be contiguous [{x.shape[0]}, {weight.shape[0]}] of {x.dtype}")
    _launch(x, weight, scale, residual, config, in_parts=in_parts, add=True)
    return residual
