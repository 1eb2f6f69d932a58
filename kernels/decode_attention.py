"""Paged decode attention (one new query token per sequence), split-K over the context.

Kernel 1, grid (batch, kv_heads, num_splits): a program takes one KV head with its whole group of
query heads (GQA: the K/V rows are read once for the group) and one contiguous piece of the context;
it writes a normalised partial output and its log-sum-exp. Kernel 2, grid (batch, q_heads), merges
the pieces; with one piece (large batches) kernel 1 writes the output itself and kernel 2 is not
launched. The split length is derived from each sequence's length on the device, so the grid depends
only on (batch, num_splits): the launch is CUDA-graph safe. Empty pieces (short sequences) write
lse = -inf and weigh nothing in the merge.

Layouts: q [B, Hq, D] (head and dim strides may be views); caches [num_blocks, page, Hkv, D]
contiguous; block_tables [B, W] int32; seq_lens [B] int32, each >= 1 (the context includes the new
token, whose K/V must already be in the cache).

An FP8 cache (float8_e4m3fn codes, value = code x scale) is read by casting its tiles to float16
(exact: every e4m3 value is a float16 value; the cast to bfloat16 streams at about half the rate on the
H200, see kernels/gemv.py) and folding the per-layer scales in, as the torch backend does: k_scale into
the softmax scale (q . (K k_scale) = (q . K) k_scale) and v_scale into the output (softmax(s) (V v_scale)
= (softmax(s) V) v_scale). A bfloat16 q goes to float16 scaled by 2^-8 (exact, a power of two, and into
float16's range), the 2^8 folded into the softmax scale too. Accumulation stays float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    FP8_DTYPE,
    check_kv_scales,
    check_last_dim_contiguous,
    dot_precision,
    next_power_of_2,
    pdl_options,
    wait_for_predecessor,
)

BLOCK_N = 64  # context tokens per tile
# An FP8 cache's tile where each program reads its whole context (one piece: large batches): the casts to
# float16 bound that kernel, not the bytes, and longer tiles amortise them (H200, 256 sequences of 1,500
# tokens, Llama-3.1-8B heads: 0.318 against 0.360 ms a layer; the bf16 cache is as fast at 64).
FP8_WHOLE_BLOCK_N = 128


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_ob,
    stride_oh,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_TO_F16: tl.constexpr,
    WHOLE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    # The sequence's length is the step's input, not the output of the kernel before (the rotary one,
    # which writes q and the new token's K/V): under PDL it is read while that kernel ends. The pages stay
    # in the loop, where the pipeliner requests them stages ahead with the K/V tiles: read before the wait
    # and carried from one iteration to the next, they were no longer pipelined (sm_90 TTGIR), and the
    # step was 3% slower at batch 64.
    seq_len = tl.load(seq_lens_ptr + b)
    wait_for_predecessor(USE_PDL)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if Q_TO_F16:  # an FP8 cache with bfloat16 q: float16 operands (see the module docstring)
        q = (q.to(tl.float32) * 0.00390625).to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    row: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE, mask=valid, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        kv_off = slot[:, None] * row + kvh * HEAD_DIM + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None] * v_scale
    if WHOLE:  # one piece: it is the output (what the merge would write, bit for bit)
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        return
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * (NUM_KV_HEADS * GROUP) + heads).to(tl.int64) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
    tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_predecessor(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = (b * NUM_HEADS + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, 0)
    mask = s_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0
    )
    out = tl.sum(parts * w[:, None], 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = BLOCK_N) -> int:
    """Enough pieces to give every SM about two programs, each piece at least block_n tokens."""
    wanted = math.ceil(2 * num_sms / max(batch * num_kv_heads, 1))
    return max(1, min(wanted, math.ceil(max_seq_len / block_n), 64))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends its sequence's cached context -> out [B, Hq, D] (q's dtype). k_scale /
    v_scale: the dequantization scales of an FP8 cache (1.0 otherwise). block_n, num_warps, num_stages:
    the split kernel's tile and launch options (BLOCK_N, or FP8_WHOLE_BLOCK_N for an FP8 cache in one
    piece, and Triton's defaults when None), for tuning benchmarks; num_splits should then come from
    choose_num_splits(..., block_n)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("block_tables", block_tables)
    check_kv_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    whole = num_splits == 1  # no partials and no merge: at large batches every SM is busy anyway
    part_shape = (0,) if whole else (batch, num_heads, num_splits)
    part_out = torch.empty(*part_shape, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    block_d = max(next_power_of_2(head_dim), 16)
    if block_n is None:
        block_n = FP8_WHOLE_BLOCK_N if whole and k_cache.dtype == FP8_DTYPE else BLOCK_N
    q_to_f16 = k_cache.dtype == FP8_DTYPE and q.dtype == torch.bfloat16
    if q_to_f16:
        scale = scale * 256.0  # q was scaled by 2^-8
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        scale * k_scale, v_scale, q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(next_power_of_2(group), 16), NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=k_cache.shape[1], BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype), Q_TO_F16=q_to_f16, WHOLE=whole, **launch, **pdl_options(),
    )  # fmt: skip
    if whole:
        return out
    _decode_merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=next_power_of_2(num_splits),
        **pdl_options(),
    )  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per sequence: gather the context through the block table, dequantize (value = stored x scale),
    softmax(q k^T * scale) v in float64."""
    check_kv_scales(k_cache, k_scale, v_scale)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        pos = torch.arange(length, device=q.device)
        slots = block_tables[b, pos // page].long() * page + pos % page
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1) * k_scale  # [L, Hq, D]
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1) * v_scale
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out
