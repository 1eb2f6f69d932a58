"""reshape_and_cache: write a step's new K and V rows into their paged-cache slots in one launch;
rotate_and_write_kv also applies the rotary embedding to q and k first (rotary.py's arithmetic) in the
same launch, which saves a kernel per layer on every step.

k, v [T, Hkv, D] (rows may be strided views of the fused QKV output; heads and dims contiguous);
k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous; slot_mapping [T] int64 slot ids
(block * block_size + offset). One program per token copies its K row and V row.

An FP8 cache (torch.float8_e4m3fn) stores round_e4m3(clamp(x / scale, -448, 448)) with the layer's
k_scale / v_scale: the codes torch's `(x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)` gives.
The rounding is fp8_quant's (to nearest even, done before the cast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPE, check_kv_scales, check_rows, next_power_of_2, pdl_options, wait_for_predecessor
from .fp8_quant import FP8_MAX, _quantize_e4m3
from .rotary import check_rotary_args, rotate_halves


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    k_scale,
    v_scale,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    if FP8:
        k = _quantize_e4m3(k, k_scale)
        v = _quantize_e4m3(v, v_scale)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_q,
    stride_k,
    stride_v,
    stride_table,
    num_q_heads,
    k_scale,
    v_scale,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    ROW: tl.constexpr,
    FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, h): token t's query head h, or for h >= num_q_heads its KV head h - num_q_heads
    (rotate k, then write k and v into the token's cache slot). One head a program: at decode sizes
    one program per token left the step's few tokens on as many SMs (H200, batch 4: 3.3 us a layer,
    2.1 us by head)."""
    wait_for_predecessor(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    cos = tl.load(cos_ptr + pos * stride_table + offs, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + offs, mask=mask, other=0.0)
    if h < num_q_heads:
        x = q_ptr + t * stride_q + h * (2 * HALF) + offs
    else:
        x = k_ptr + t * stride_k + (h - num_q_heads) * (2 * HALF) + offs
    o1, o2 = rotate_halves(tl.load(x, mask=mask), tl.load(x + HALF, mask=mask), cos, sin)
    tl.store(x, o1, mask=mask)
    tl.store(x + HALF, o2, mask=mask)
    if h >= num_q_heads:
        head = (h - num_q_heads) * (2 * HALF)
        dst = tl.load(slot_ptr + t).to(tl.int64) * ROW + head + offs
        v = v_ptr + t * stride_v + head + offs
        # New names, float32 (exact) on both FP8 branches: a runtime branch may not retype o1 / o2.
        k1, k2 = o1.to(tl.float32), o2.to(tl.float32)
        v1, v2 = tl.load(v, mask=mask).to(tl.float32), tl.load(v + HALF, mask=mask).to(tl.float32)
        if FP8:
            k1, k2 = _quantize_e4m3(k1, k_scale), _quantize_e4m3(k2, k_scale)
            v1, v2 = _quantize_e4m3(v1, v_scale), _quantize_e4m3(v2, v_scale)
        tl.store(k_cache_ptr + dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    check_kv_scales(k_cache, k_scale, v_scale)
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the K and V caches differ in dtype: {k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache tensors must be contiguous")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """k_cache/v_cache viewed as [slots, Hkv, D]: row slot_mapping[t] = k[t] / v[t] (FP8: quantized
    with k_scale / v_scale, see the module docstring)."""
    num_tokens = k.shape[0]
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    check_rows("k", k)
    check_rows("v", v)
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), float(k_scale), float(v_scale),
        ROW=row, BLOCK=next_power_of_2(row), FP8=k_cache.dtype == FP8_DTYPE,
    )  # fmt: skip


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
) -> None:
    """rotary_inplace(q, k, cos, sin, positions) then write_kv(k, v, ...) in one launch, with the same
    results: q and k are rotated in place and the rotated k goes to the cache."""
    _check_caches(k_cache, v_cache, k_scale, v_scale)
    check_rotary_args(q, k, cos, sin)
    check_rows("v", v)
    num_tokens, half = q.shape[0], q.shape[2] // 2
    if num_tokens == 0:
        return
    _rotate_write_kv_kernel[(num_tokens, q.shape[1] + k.shape[1])](
        q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping, q.stride(0), k.stride(0), v.stride(0),
        cos.stride(0), q.shape[1], float(k_scale), float(v_scale),
        HALF=half, BLOCK_HALF=next_power_of_2(half), ROW=v.shape[1] * v.shape[2], FP8=k_cache.dtype == FP8_DTYPE,
        **pdl_options(),
    )  # fmt: skip


def _store_reference(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    rows = cache.view(-1, x.shape[1], x.shape[2])
    if cache.dtype != FP8_DTYPE:
        rows.index_copy_(0, slots, x.to(cache.dtype))
        return
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    rows.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))  # index_copy_ has no FP8 kernel


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    check_kv_scales(k_cache, k_scale, v_scale)
    _store_reference(k_cache, slot_mapping, k, k_scale)
    _store_reference(v_cache, slot_mapping, v, v_scale)
