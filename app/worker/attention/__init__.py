"""Attention backends behind one interface; `--attention-backend` picks one.

torch: the portable reference (CPU and CUDA). triton: paged-KV Triton kernels (CUDA; the CPU only
under TRITON_INTERPRET=1, for tests). flashinfer: flashinfer's paged wrappers (CUDA, fp16/bf16, the
optional flashinfer-python package). Unset picks flashinfer on CUDA when it is importable and the
model dtype suits it, else triton on CUDA, and torch on the CPU. The GPU backends are imported lazily.
All three read an FP8 (e4m3) KV cache with per-layer scales (class attribute supports_fp8_kv).
"""

from __future__ import annotations

import torch

from app.worker.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    AttentionSpec,
    build_attention_batch,
)
from app.worker.attention.torch_backend import TorchAttentionBackend
from app.worker.kv_cache import KVCache

BACKEND_NAMES = ("flashinfer", "torch", "triton")
DEFAULT_BACKEND = "torch"  # on the CPU; see resolve_attention_backend for CUDA


def _usable_here(device: torch.device) -> list[str]:
    from app.worker.attention.triton_backend import triton_usable

    names = ["torch"]
    if triton_usable(device):
        names.append("triton")
    if device.type == "cuda":
        names.append("flashinfer")
    return sorted(names)


def resolve_attention_backend(
    name: str | None, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> str:
    """The backend name `name` resolves to on this device, KV cache dtype and head size (None: the
    default)."""
    if name is None:
        if device.type != "cuda":
            return DEFAULT_BACKEND
        from app.worker.attention.flashinfer_backend import (
            SUPPORTED_DTYPES,
            SUPPORTED_HEAD_DIMS,
            flashinfer_available,
        )
        from app.worker.attention.triton_backend import TRITON_DTYPES

        if dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS and flashinfer_available():
            return "flashinfer"
        return "triton" if dtype in TRITON_DTYPES else "torch"
    usable = _usable_here(device)
    if name not in usable:
        raise ValueError(
            f"attention backend {name!r} is not available on {device.type}; supported: {', '.join(usable)}"
        )
    return name


def backend_class(name: str) -> type[AttentionBackend]:
    """The class of a resolved backend name (the GPU ones imported on demand)."""
    if name == "triton":
        from app.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend
    if name == "flashinfer":
        from app.worker.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend
    return TorchAttentionBackend


def make_attention_backend(name: str | None, kv_cache: KVCache, spec: AttentionSpec) -> AttentionBackend:
    """The backend called `name` (None: the default for the cache's device and dtype) over this KV cache."""
    key = resolve_attention_backend(name, kv_cache.k[0].device, kv_cache.spec.dtype, spec.head_dim)
    return backend_class(key)(kv_cache, spec)


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionMetadata",
    "AttentionSpec",
    "TorchAttentionBackend",
    "backend_class",
    "build_attention_batch",
    "make_attention_backend",
    "resolve_attention_backend",
]
