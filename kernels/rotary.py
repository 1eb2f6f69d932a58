"""Rotary position embedding (rotate-half / NeoX layout) applied in place to q and k, optionally with
the new tokens' K/V written to the paged cache in the same launch (what the attention backends run:
one kernel a layer instead of two).

Same arithmetic as transformers' q * cos + rotate_half(q) * sin with the float32 cos/sin tables
cast to the activation dtype first, each product and sum rounded to that dtype as torch does.
q, k and v may be strided views of the fused QKV output (heads and dims contiguous within a row).
rotate_and_write_kv can put the rotated q into a buffer of its own (q_out) instead of in place: a
kernel that needs q contiguous (flashinfer's xqa decode) then gets it without a copy.
The cache write is kv_write.write_kv's (store_cache_rows): an FP8 cache (torch.float8_e4m3fn) stores the rotated K and V
quantized with the layer's k_scale / v_scale.
Models that normalise each head of q and k before the rotation (Qwen3's q_norm / k_norm) pass the two
norms' weights (qk_norm): the same launch then applies rmsnorm.py's arithmetic per head first (two
launches a layer fewer); the sum of squares runs over the two halves, so a value can differ from
rms_norm's by an ulp where the order of that sum matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, check_kv_caches, check_rows, next_power_of_2, pdl_options, wait_for_predecessor
from .kv_write import store_cache_rows


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in x's dtype, from float32 cos / sin."""
    dtype = x1.dtype
    # Every product and sum in float32, rounded to the activation dtype after each op as torch does;
    # explicit casts keep the compiler from contracting a product and a sum into one FMA.
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (a1 * c).to(dtype).to(tl.float32) - (a2 * s).to(dtype).to(tl.float32)
    o2 = (a2 * c).to(dtype).to(tl.float32) + (a1 * s).to(dtype).to(tl.float32)
    return o1.to(dtype), o2.to(dtype)


@dataclass(frozen=True)
class QKNorm:
    """Per-head RMSNorms of q and k (weights [head_dim] in the activations' dtype) applied before RoPE."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

    def check(self, head_dim: int) -> None:
        for name, w in (("q", self.q_weight), ("k", self.k_weight)):
            if tuple(w.shape) != (head_dim,) or w.stride(-1) != 1:
                raise ValueError(f"the {name} norm's weight must be a contiguous [{head_dim}] vector, "
                                 f"got {tuple(w.shape)}")  # fmt: skip


# Heads a program rotates: one at decode sizes (a batch's few tokens spread over as many SMs: H200,
# batch 4, with the write, 3.3 us a layer by token, 2.1 us by head); several beyond, where one-head
# programs are too small to keep up (1024-token prefill: 50 us a layer at one head a program).
ONE_HEAD_MAX_TOKENS = 16
HEADS_PER_PROGRAM = 8


@triton.jit
def _rotary_kernel(
    q_ptr,
    q_out_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q,
    stride_q_out,
    stride_k,
    stride_v,
    stride_table,
    num_q_heads,
    num_heads,
    k_scale,
    v_scale,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROW: tl.constexpr,
    WRITE_KV: tl.constexpr,
    FP8: tl.constexpr,
    QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, j): token t's heads j * BLOCK_H + [0, BLOCK_H) of q's heads followed by k's (a head
    h >= num_q_heads is KV head h - num_q_heads: rotate k; with WRITE_KV, then write k and v into the
    token's cache slot). Rotated q heads go to q_out (q itself for in place). With QK_NORM each head is
    first normalised with its norm's weight (q_norm_ptr or k_norm_ptr, [2 * HALF])."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # The token's position, its cos / sin and its cache slot are the step's inputs, not the output of the
    # kernel before (the QKV projection): under PDL they are read while that kernel ends (a position, then
    # the tables at it: two round trips to memory off the path after the wait).
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    d_mask = offs < HALF
    cos = tl.load(cos_ptr + pos * stride_table + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_table + offs, mask=d_mask, other=0.0)[None, :]
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    is_q = heads < num_q_heads
    if QK_NORM:  # the norms' weights: no kernel's output either
        norm_w1 = tl.where(is_q[:, None], tl.load(q_norm_ptr + offs, mask=d_mask)[None, :],
                           tl.load(k_norm_ptr + offs, mask=d_mask)[None, :])  # fmt: skip
        norm_w2 = tl.where(is_q[:, None], tl.load(q_norm_ptr + HALF + offs, mask=d_mask)[None, :],
                           tl.load(k_norm_ptr + HALF + offs, mask=d_mask)[None, :])  # fmt: skip
    wait_for_predecessor(USE_PDL)
    kv_head = heads - num_q_heads
    k_row = k_ptr + t * stride_k + kv_head * (2 * HALF)
    row = tl.where(is_q, q_ptr + t * stride_q + heads * (2 * HALF), k_row)
    out_row = tl.where(is_q, q_out_ptr + t * stride_q_out + heads * (2 * HALF), k_row)
    x = row[:, None] + offs[None, :]
    y = out_row[:, None] + offs[None, :]
    mask = (heads < num_heads)[:, None] & d_mask[None, :]
    x1, x2 = tl.load(x, mask=mask, other=0.0), tl.load(x + HALF, mask=mask, other=0.0)
    if QK_NORM:
        x1, x2 = _rms_norm_halves(x1, x2, norm_w1, norm_w2, eps, 2 * HALF)
    o1, o2 = rotate_halves(x1, x2, cos, sin)
    tl.store(y, o1, mask=mask)
    tl.store(y + HALF, o2, mask=mask)
    # A program of query heads only has nothing to write: it skips the cache arithmetic (an FP8 cache's
    # division and cast per value) instead of running it masked (half the FP8 launch's time at 8 heads).
    if WRITE_KV and (tl.program_id(1) + 1) * BLOCK_H > num_q_heads:
        kv_mask = mask & ~is_q[:, None]
        head = tl.where(is_q, 0, kv_head)[:, None] * (2 * HALF) + offs[None, :]
        dst = slot * ROW + head
        v = v_ptr + t * stride_v + head
        store_cache_rows(k_cache_ptr + dst, o1, k_scale, kv_mask, FP8)
        store_cache_rows(k_cache_ptr + dst + HALF, o2, k_scale, kv_mask, FP8)
        store_cache_rows(v_cache_ptr + dst, tl.load(v, mask=kv_mask), v_scale, kv_mask, FP8)
        store_cache_rows(v_cache_ptr + dst + HALF, tl.load(v + HALF, mask=kv_mask), v_scale, kv_mask, FP8)


@triton.jit
def _rms_norm_halves(x1, x2, w1, w2, eps, width):
    """Rows [heads, HALF] of both halves normalised as rmsnorm.py does: float32 statistics, the row cast
    back to x's dtype, then times the weight in the promoted dtype (rounded to x's for the rotation)."""
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / width + eps)[:, None]
    y1 = w1 * (a1 * rstd).to(x1.dtype)
    y2 = w2 * (a2 * rstd).to(x2.dtype)
    return y1.to(x1.dtype), y2.to(x2.dtype)


def _check_tables(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must be row-major tables of one layout")


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
            k_scale: float, v_scale: float, q_out: torch.Tensor | None = None,
            qk_norm: QKNorm | None = None) -> None:  # fmt: skip
    """caches: (k_cache, v_cache, slot_mapping) to write into, or None to rotate only; q_out: where the
    rotated q goes (None: in place); qk_norm: the per-head norms applied before the rotation."""
    check_rows("q", q)
    if q_out is None:
        q_out = q
    elif q_out.shape != q.shape or q_out.dtype != q.dtype:
        raise ValueError(f"q_out must be a {tuple(q.shape)} {q.dtype} tensor, got {tuple(q_out.shape)} {q_out.dtype}")
    check_rows("q_out", q_out)
    check_rows("k", k)
    check_rows("v", v)
    _check_tables(cos, sin)
    if qk_norm is not None:
        qk_norm.check(q.shape[2])
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return
    k_cache, v_cache, slots = caches or (k, v, positions)  # unread when WRITE_KV is off
    num_heads = q.shape[1] + k.shape[1]
    block_h = 1 if num_tokens <= ONE_HEAD_MAX_TOKENS else HEADS_PER_PROGRAM
    q_norm, k_norm, eps = (qk_norm.q_weight, qk_norm.k_weight, qk_norm.eps) if qk_norm else (cos, cos, 0.0)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q, q_out, k, v, cos, sin, positions, q_norm, k_norm, k_cache, v_cache, slots, q.stride(0),
        q_out.stride(0), k.stride(0), v.stride(0), cos.stride(0), q.shape[1], num_heads, float(k_scale),
        float(v_scale), float(eps), HALF=half, BLOCK_HALF=next_power_of_2(half), BLOCK_H=block_h,
        ROW=v.shape[1] * v.shape[2], WRITE_KV=caches is not None, FP8=k_cache.dtype == FP8_DTYPE,
        QK_NORM=qk_norm is not None, **pdl_options(),
    )  # fmt: skip


def rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> None:
    """q [T, Hq, D], k [T, Hkv, D] rotated in place (each head normalised first with qk_norm); cos/sin
    [max_pos, D/2] float32 tables."""
    _launch(q, k, k, cos, sin, positions, None, 1.0, 1.0, qk_norm=qk_norm)


def rotate_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    q_out: torch.Tensor | None = None,
    qk_norm: QKNorm | None = None,
) -> None:
    """rotary_inplace(q, k, cos, sin, positions, qk_norm) then kv_write.write_kv(k, v, ...) in one launch,
    with the same results: q and k are rotated in place and the rotated k goes to the cache. With q_out the
    rotated q goes there instead and q is left as it was."""
    check_kv_caches(k_cache, v_cache, k_scale, v_scale)
    _launch(q, k, v, cos, sin, positions, (k_cache, v_cache, slot_mapping), k_scale, v_scale, q_out, qk_norm)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
    s = sin.index_select(0, positions).unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rotate(q), rotate(k)
