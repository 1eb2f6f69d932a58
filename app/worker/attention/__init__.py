"""Attention backends behind one interface; `--attention-backend` picks one (unset: torch)."""

from __future__ import annotations

from app.worker.attention.base import (
    AttentionBackend,
    AttentionBatch,
    AttentionMetadata,
    AttentionSpec,
    build_attention_batch,
)
from app.worker.attention.torch_backend import TorchAttentionBackend
from app.worker.kv_cache import KVCache

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}
DEFAULT_BACKEND = "torch"


def make_attention_backend(name: str | None, kv_cache: KVCache, spec: AttentionSpec) -> AttentionBackend:
    """The backend called `name` (None: the default) over this KV cache."""
    key = DEFAULT_BACKEND if name is None else name
    if key not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available; supported: {', '.join(sorted(BACKENDS))}"
        )
    return BACKENDS[key](kv_cache, spec)


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "AttentionBatch",
    "AttentionMetadata",
    "AttentionSpec",
    "TorchAttentionBackend",
    "build_attention_batch",
    "make_attention_backend",
]
