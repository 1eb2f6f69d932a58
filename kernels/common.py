"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn  # the FP8 KV cache's storage type (Triton's float8e4nv)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands stay exact (IEEE); half types use the tensor cores' native path."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(x.stride())}")


def check_kv_scales(cache: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """Scales dequantize an FP8 cache; any other cache reads its values as they are."""
    if cache.dtype != FP8_DTYPE and (k_scale != 1.0 or v_scale != 1.0):
        raise ValueError(f"KV scales other than 1.0 need an FP8 cache, not {cache.dtype}")
    if not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"KV scales must be positive, got {k_scale} and {v_scale}")


def check_rows(name: str, x: torch.Tensor) -> None:
    """x [T, heads, dim]: rows may be strided views (of a fused QKV output), heads and dims contiguous."""
    if x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
        raise ValueError(f"{name} rows must hold contiguous [heads, dim], got strides {tuple(x.stride())}")
