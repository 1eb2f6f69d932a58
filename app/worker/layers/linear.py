"""Linear layers. Fused ones (QKV, gate_up) hold several checkpoint tensors stacked along the output
dimension; each parameter records where each shard's rows live so the loader can fill it piecewise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Attribute set on fused parameters: {shard_id: (first_row, num_rows)}.
SHARD_ROWS = "shard_rows"


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input computed as one matmul (e.g. q/k/v or gate/up)."""

    def __init__(
        self, in_features: int, shards: dict[str | int, int], bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, sum(shards.values()), bias, dtype)
        rows, start = {}, 0
        for shard_id, size in shards.items():
            rows[shard_id] = (start, size)
            start += size
        self.sizes = list(shards.values())
        for param in self.parameters():
            setattr(param, SHARD_ROWS, rows)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.sizes, dim=-1)


class QKVLinear(MergedLinear):
    def __init__(
        self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, dtype: torch.dtype
    ) -> None:
        shards = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden, shards, bias, dtype)


class GateUpLinear(MergedLinear):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(hidden, {"gate": intermediate, "up": intermediate}, bias, dtype)
