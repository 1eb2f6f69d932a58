"""Stream-K decode GEMV (an experiment beside kernels/gemv.py, not yet used by the model): y [M, N] =
x [M, K] @ W [N, K]^T for a few rows, with the work cut evenly across a fixed number of programs.

kernels/gemv.py gives each program whole tiles: at one row its grid leaves SMs with one program beside SMs
with two (gate_up: 224 programs on 132 SMs) or idle (qkv: 96), and each program's ramp and tail sit on the
step's path. Here the (N block, K chunk) units are numbered N block by N block and each of PROGRAMS
programs takes an equal run of them, one loop with no restart between N blocks. An N block whose units
one program holds is stored by it; one shared by several is summed by the last of them to finish, in
program order (deterministic), from float32 partials (common.last_to_arrive, as gemv.py's split-K).

The DOT body only, as gemv.py runs it: 16-bit x and W, or W8A8 (x as FP8 codes with per-row scales,
W as FP8 codes with per-channel scales).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    FP8_DTYPE,
    arrival_counts,
    dot_precision,
    last_to_arrive,
    pdl_options,
    wait_for_predecessor,
)
from .gemv import MAX_M, accumulate_tile, check_operands, load_k_tile


@dataclass(frozen=True)
class StreamKConfig:
    block_n: int
    block_k: int
    programs: int  # e.g. the GPU's SM count, or twice it
    num_warps: int = 4
    num_stages: int = 4
    w_as_a: bool = True  # y^T = W x^T: the weight tile as operand A (needs block_n >= 64 on Hopper's MMA)


@triton.jit
def _owner(unit, PROGRAMS, TOTAL):
    """The program whose run of units holds unit: the last p with p * TOTAL // PROGRAMS <= unit."""
    return ((unit + 1) * PROGRAMS - 1) // TOTAL


@triton.jit
def _sharing(n_block, K_CHUNKS, PROGRAMS, TOTAL):
    """The first program holding units of the N block, and how many programs do (1: held whole)."""
    first_owner = _owner(n_block * K_CHUNKS, PROGRAMS, TOTAL)
    return first_owner, _owner(n_block * K_CHUNKS + K_CHUNKS - 1, PROGRAMS, TOTAL) - first_owner + 1


@triton.jit
def _stream_k_kernel(
    x_ptr, xs_ptr, w_ptr, scale_ptr, y_ptr, parts_ptr, arrivals_ptr,
    M, N, K, K_CHUNKS, TOTAL, PROGRAMS,
    stride_xm, stride_wn, stride_ym,
    MAX_SHARERS: tl.constexpr, HAS_SCALE: tl.constexpr, W_AS_A: tl.constexpr, FP8_OPERANDS: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    first = p * TOTAL // PROGRAMS
    last = (p + 1) * TOTAL // PROGRAMS
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_N)
    m_ok = rm < M
    x_rows = x_ptr + rm[:, None] * stride_xm
    wait_for_predecessor(USE_PDL)
    if FP8_OPERANDS:  # x's per-token scales: linear, so partial sums take them too
        x_scales = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    if W_AS_A:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for unit in range(first, last):
        n_block = unit // K_CHUNKS
        chunk = unit - n_block * K_CHUNKS
        rn = n_block * BLOCK_N + rb
        n_ok = rn < N
        kk = chunk * BLOCK_K + rk
        w = load_k_tile(w_ptr + rn[:, None].to(tl.int64) * stride_wn, kk, K, n_ok, EVEN_K)
        x = load_k_tile(x_rows, kk, K, m_ok, EVEN_K)
        acc = accumulate_tile(acc, w, x, True, W_AS_A, False, FP8_OPERANDS, False, PRECISION)
        if (chunk == K_CHUNKS - 1) | (unit == last - 1):  # the end of this program's part of the N block
            out = tl.trans(acc) if W_AS_A else acc
            if FP8_OPERANDS:
                out = out * x_scales[:, None]
            first_owner, sharers = _sharing(n_block, K_CHUNKS, PROGRAMS, TOTAL)
            if sharers == 1:
                _store_scaled(out, rm, rn, m_ok, n_ok, scale_ptr, y_ptr, stride_ym, HAS_SCALE)
            else:  # shared: partial sums, added after the loop (an atomic in it stops its pipelining)
                tl.store(_block_parts(parts_ptr, n_block, rm, rb, MAX_SHARERS, BLOCK_M, BLOCK_N)
                         + (p - first_owner) * BLOCK_M * BLOCK_N, out)  # fmt: skip
            acc = tl.zeros_like(acc)
    # Only the run's first and last N blocks can be shared.
    n_first = first // K_CHUNKS
    n_last = (last - 1) // K_CHUNKS
    _sum_if_last_sharer(n_first, rm, rb, m_ok, N, K_CHUNKS, TOTAL, PROGRAMS, scale_ptr, y_ptr, parts_ptr,
                        arrivals_ptr, stride_ym, MAX_SHARERS, HAS_SCALE, BLOCK_M, BLOCK_N)  # fmt: skip
    if n_last != n_first:
        _sum_if_last_sharer(n_last, rm, rb, m_ok, N, K_CHUNKS, TOTAL, PROGRAMS, scale_ptr, y_ptr, parts_ptr,
                            arrivals_ptr, stride_ym, MAX_SHARERS, HAS_SCALE, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _block_parts(parts_ptr, n_block, rm, rb, MAX_SHARERS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """The N block's first partial sums in parts [N blocks, MAX_SHARERS, BLOCK_M, BLOCK_N]."""
    return parts_ptr + (n_block * MAX_SHARERS * BLOCK_M + rm[:, None]) * BLOCK_N + rb[None, :]


@triton.jit
def _store_scaled(out, rm, rn, m_ok, n_ok, scale_ptr, y_ptr, stride_ym, HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _sum_if_last_sharer(n_block, rm, rb, m_ok, N, K_CHUNKS, TOTAL, PROGRAMS, scale_ptr, y_ptr, parts_ptr,
                        arrivals_ptr, stride_ym, MAX_SHARERS: tl.constexpr, HAS_SCALE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """If the N block is shared, count this program in; the last of its programs to finish adds their
    partial sums in program order, scales and stores y."""
    _, sharers = _sharing(n_block, K_CHUNKS, PROGRAMS, TOTAL)
    if sharers > 1:
        if last_to_arrive(arrivals_ptr + n_block, sharers):
            parts = _block_parts(parts_ptr, n_block, rm, rb, MAX_SHARERS, BLOCK_M, BLOCK_N)
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(MAX_SHARERS):
                total += tl.load(parts + s * BLOCK_M * BLOCK_N, mask=s < sharers, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            rn = n_block * BLOCK_N + rb
            _store_scaled(total, rm, rn, m_ok, rn < N, scale_ptr, y_ptr, stride_ym, HAS_SCALE)


@functools.lru_cache(maxsize=256)
def most_sharers(n_blocks: int, k_chunks: int, programs: int) -> int:
    """The most programs that share one N block's units."""
    total = n_blocks * k_chunks

    def owner(unit: int) -> int:
        return ((unit + 1) * programs - 1) // total

    return max(owner(n * k_chunks + k_chunks - 1) - owner(n * k_chunks) + 1 for n in range(n_blocks))


def gemv_stream_k(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: StreamKConfig,
    scale: torch.Tensor | None = None,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """gemv.gemv's product (the DOT body) over config.programs programs: x [M, K] 16-bit with a 16-bit
    weight [N, K], or FP8 codes with per-row scales x_scale and FP8 weight codes with scales [N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    check_operands(x, weight, scale, m, k, n, x_scale, out_dtype)
    fp8_x = x.dtype == FP8_DTYPE
    if (weight.dtype == FP8_DTYPE) != fp8_x or config.programs < 1:
        raise ValueError(f"gemv_stream_k runs 16-bit x with 16-bit weights or FP8 with FP8 on >= 1 programs, "
                         f"got x {x.dtype}, weight {weight.dtype}, {config.programs} programs")  # fmt: skip
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    n_blocks, k_chunks = triton.cdiv(n, config.block_n), triton.cdiv(k, config.block_k)
    programs = min(config.programs, n_blocks * k_chunks)
    sharers = most_sharers(n_blocks, k_chunks, programs)
    parts = y
    if sharers > 1:
        parts = torch.empty(n_blocks * sharers * MAX_M * config.block_n, dtype=torch.float32, device=x.device)
    _stream_k_kernel[(programs,)](
        x, y if x_scale is None else x_scale.reshape(-1).float().contiguous(), weight,
        y if scale is None else scale.reshape(-1).float().contiguous(), y, parts,
        arrival_counts(x.device, n_blocks), m, n, k, k_chunks, n_blocks * k_chunks, programs,
        x.stride(0), weight.stride(0), y.stride(0), MAX_SHARERS=sharers,
        HAS_SCALE=scale is not None, W_AS_A=config.w_as_a, FP8_OPERANDS=fp8_x, EVEN_K=k % config.block_k == 0,
        PRECISION=dot_precision(torch.float16 if fp8_x else x.dtype), BLOCK_M=16, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(),
    )  # fmt: skip
    return y
