"""reshape_and_cache: write a step's new K and V rows into their paged-cache slots in one launch (the
attention backends write through rotary.rotate_and_write_kv, which also rotates q and k first).

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

from .common import FP8_DTYPE, check_kv_caches, check_kv_scales, check_rows, next_power_of_2
from .fp8_quant import FP8_MAX, _quantize_e4m3


@triton.jit
def store_cache_rows(ptr, x, scale, mask, FP8: tl.constexpr):
    """x into cache entries at ptr: FP8, the e4m3 codes of x / scale; else x in the cache's dtype."""
    if FP8:
        x = _quantize_e4m3(x, scale)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


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
    store_cache_rows(k_cache_ptr + slot * ROW + offs, k, k_scale, mask, FP8)
    store_cache_rows(v_cache_ptr + slot * ROW + offs, v, v_scale, mask, FP8)


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
    check_kv_caches(k_cache, v_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    check_rows("k", k)
    check_rows("v", v)
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), float(k_scale), float(v_scale),
        ROW=row, BLOCK=next_power_of_2(row), FP8=k_cache.dtype == FP8_DTYPE,
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
