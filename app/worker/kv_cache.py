"""The paged KV cache tensors and the arithmetic that sizes the pool.

Layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim]; token position p
of a sequence lives in slot block_ids[p // block_size] * block_size + p % block_size. Every block
id in [0, num_blocks) is usable: the scheduler owns the allocation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    """k_scales / v_scales (per layer) apply to an FP8 cache (spec.dtype float8_e4m3fn): a value x is
    stored as x / scale and read back as stored * scale (app.worker.quantization.kv). Unquantized
    caches keep 1.0."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.k_scales = _layer_scales(k_scales, spec)
        self.v_scales = _layer_scales(v_scales, spec)
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: masked-out slots still enter the attention matmuls, and 0 * NaN garbage
        # would poison the output.
        self.k = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.v = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.spec.bytes_per_token


def _layer_scales(scales: Sequence[float] | None, spec: KVCacheSpec) -> tuple[float, ...]:
    if scales is None:
        return (1.0,) * spec.num_layers
    if len(scales) != spec.num_layers:
        raise ValueError(f"{len(scales)} KV scales given for {spec.num_layers} layers")
    if spec.dtype != torch.float8_e4m3fn and any(s != 1.0 for s in scales):
        raise ValueError(f"KV scales other than 1.0 need an FP8 cache, not {spec.dtype}")
    return tuple(float(s) for s in scales)


def format_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 10 else f"{n / (1 << 20):.1f} MiB"


class KVPoolError(RuntimeError):
    """The KV pool cannot be sized as asked (not enough memory, or not one max-length request)."""


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len requests the pool holds at once."""
        return self.tokens / self.max_model_len


def finish_pool(
    tokens: int, block_size: int, max_model_len: int, bytes_per_token: int, budget: str
) -> PoolPlan:
    """Round a token budget down to whole blocks; refuse a pool that cannot hold one full request."""
    num_blocks = max(tokens, 0) // block_size
    needed_blocks = math.ceil(max_model_len / block_size)
    if num_blocks < needed_blocks:
        need = needed_blocks * block_size * bytes_per_token
        have = max(tokens, 0) * bytes_per_token
        raise KVPoolError(
            f"the KV pool ({budget}) holds {num_blocks * block_size} tokens, fewer than one request of "
            f"max_model_len={max_model_len}: that needs {format_bytes(need)} of KV cache and "
            f"{format_bytes(have)} is available; lower --max-model-len or give the KV cache more memory"
        )
    return PoolPlan(num_blocks, block_size, max_model_len)


def cpu_pool_tokens(
    bytes_per_token: int,
    max_num_seqs: int,
    max_model_len: int,
    max_total_tokens: int | None,
    available_bytes: int,
) -> tuple[int, str]:
    """CPU pool: --max-total-tokens if set (it must fit in available memory), else
    min(max_num_seqs * max_model_len, a quarter of the available memory). Returns (tokens, why)."""
    if max_total_tokens is not None:
        need = max_total_tokens * bytes_per_token
        if need > available_bytes:
            raise KVPoolError(
                f"--max-total-tokens {max_total_tokens} needs {format_bytes(need)} of KV cache but only "
                f"{format_bytes(available_bytes)} of memory is available"
            )
        return max_total_tokens, f"--max-total-tokens {max_total_tokens}"
    quarter = available_bytes // 4 // bytes_per_token
    wanted = max_num_seqs * max_model_len
    if wanted <= quarter:
        return wanted, f"max_num_seqs x max_model_len = {wanted} tokens"
    return quarter, f"25% of available memory ({format_bytes(available_bytes // 4)})"


def cuda_pool_bytes(
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    non_torch_bytes: int,
    reserve_bytes: int,
) -> int:
    """What is left for KV in the utilization budget after weights, the profiled activation peak,
    memory outside torch's allocator (CUDA context, other processes) and a reserve."""
    budget = int(total_bytes * utilization)
    return budget - weights_bytes - peak_activation_bytes - non_torch_bytes - reserve_bytes
