"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import torch


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands stay exact (IEEE); half types use the tensor cores' native path."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(x.stride())}")
