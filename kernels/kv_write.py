"""reshape_and_cache: write a step's new K and V rows into their paged-cache slots in one launch.

k, v [T, Hkv, D] (rows may be strided views of the fused QKV output; heads and dims contiguous);
k_cache, v_cache [num_blocks, block_size, Hkv, D] contiguous; slot_mapping [T] int64 slot ids
(block * block_size + offset). One program per token copies its K row and V row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_k,
    stride_v,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, x: torch.Tensor) -> None:
    heads, dim = x.shape[1], x.shape[2]
    if x.stride(2) != 1 or (heads > 1 and x.stride(1) != dim):
        raise ValueError(f"{name} rows must hold contiguous [heads, dim], got strides {tuple(x.stride())}")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k_cache/v_cache viewed as [slots, Hkv, D]: row slot_mapping[t] = k[t] / v[t]."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _check_rows("k", k)
    _check_rows("v", v)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache tensors must be contiguous")
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), ROW=row, BLOCK=next_power_of_2(row)
    )


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    heads, dim = k.shape[1], k.shape[2]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
