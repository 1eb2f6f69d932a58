"""Rotary position embedding (rotate-half / NeoX layout) applied in place to q and k.

Same arithmetic as transformers' q * cos + rotate_half(q) * sin with the float32 cos/sin tables
cast to the activation dtype first, each product and sum rounded to that dtype as torch does.
One program per token rotates all its query and key heads; q and k may be strided views of the
fused QKV output (heads and dims contiguous within a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_rows, next_power_of_2


@triton.jit
def _rotate_rows(ptr, stride_t, t, cos, sin, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < n_heads) & (offs_c[None, :] < HALF)
    base = ptr + t * stride_t + offs_h[:, None] * (2 * HALF) + offs_c[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    o1, o2 = rotate_halves(x1, x2, cos[None, :], sin[None, :])
    tl.store(base, o1, mask=mask)
    tl.store(base + HALF, o2, mask=mask)


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


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_q,
    stride_k,
    stride_table,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_table + offs_c, mask=offs_c < HALF, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + offs_c, mask=offs_c < HALF, other=0.0)
    _rotate_rows(q_ptr, stride_q, t, cos, sin, num_q_heads, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_rows(k_ptr, stride_k, t, cos, sin, num_k_heads, HALF, BLOCK_KH, BLOCK_HALF)


def check_rotary_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_rows("q", q)
    check_rows("k", k)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("cos and sin must be row-major tables of one layout")


def rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """q [T, Hq, D], k [T, Hkv, D] rotated in place; cos/sin [max_pos, D/2] float32 tables."""
    check_rotary_args(q, k, cos, sin)
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        q, k, cos, sin, positions, q.stride(0), k.stride(0), cos.stride(0), q.shape[1], k.shape[1],
        HALF=half, BLOCK_QH=next_power_of_2(q.shape[1]), BLOCK_KH=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
    )  # fmt: skip


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos.index_select(0, positions).unsqueeze(1).to(q.dtype)
    s = sin.index_select(0, positions).unsqueeze(1).to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rotate(q), rotate(k)
