"""Paged prefill / extend attention: each sequence's new tokens attend its whole context (the cached
prefix plus the new tokens, causal among the new ones), all read from the paged cache.

Grid (batch, q_heads, query blocks): a program takes BLOCK_M new tokens of one sequence and one
query head, and streams the context in BLOCK_N pieces with an online softmax, stopping at the last
position its queries can see. New token i of a sequence with seq_len context tokens and q_len new
ones sits at position seq_len - q_len + i (the caller has already written the new K/V).

Layouts: q [T, Hq, D] flat over the batch (cu_seqlens_q [B+1] int32 on the device marks each
sequence's rows); caches [num_blocks, page, Hkv, D] contiguous; block_tables [B, W] int32;
seq_lens [B] int32.

An FP8 cache is read as the decode kernel reads it (decode_attention.py): tiles cast to q's dtype,
k_scale folded into the softmax scale, v_scale into the output; float32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_kv_scales, check_last_dim_contiguous, dot_precision, next_power_of_2

BLOCK_M = 64
BLOCK_N = 64


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    seq_lens_ptr,
    out_ptr,
    scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q_mask = m_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    q_pos = context + offs_m

    # The block's last query sees positions up to context + its index; blocks past q_len see nothing.
    end = tl.minimum(seq_len, context + (mb + 1) * BLOCK_M)
    end = tl.where(mb * BLOCK_M < q_len, end, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    for n0 in range(0, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        kv_off = slot[:, None] * row + kvh * HEAD_DIM + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Rows that have seen nothing yet keep m = -inf: shift by 0 there so exp() stays defined.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(qk - shift[:, None])
        alpha = tl.exp(m_i - shift)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, Hq, D] (new tokens of every sequence, flat) -> out [T, Hq, D] (q's dtype). k_scale /
    v_scale: the dequantization scales of an FP8 cache (1.0 otherwise)."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_tables", block_tables)
    check_kv_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * k_scale, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(next_power_of_2(head_dim), 16), PAGE=k_cache.shape[1], BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def paged_prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per sequence and head, dense float64 attention over the dequantized cache (value = stored x
    scale) with the lower-right causal mask."""
    check_kv_scales(k_cache, k_scale, v_scale)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        pos = torch.arange(length, device=q.device)
        slots = block_tables[b, pos // page].long() * page + pos % page
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1) * k_scale
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1) * v_scale
        scores = torch.einsum("thd,lhd->htl", q[lo:hi].double(), keys) * scale
        q_pos = torch.arange(length - (hi - lo), length, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out
