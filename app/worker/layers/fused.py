"""Where the fused Triton kernels replace the torch code: on CUDA tensors only. The torch code stays
the CPU path and the reference the kernels are tested against (tests/kernels).

The kernel modules load on first use: their definitions read TRITON_INTERPRET, which CPU tests set
only for the kernels' own test package.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda


@cache
def kernel_module(name: str) -> ModuleType:
    return importlib.import_module(f"tokenspeed_kernels.{name}")
