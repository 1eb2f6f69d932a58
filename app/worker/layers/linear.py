"""Linear layers. Fused ones (QKV, gate_up) hold several checkpoint tensors stacked along the output
dimension; each parameter records where each shard's rows live so the loader can fill it piecewise.

A quantization method (`quant`, e.g. app.worker.quantization.Fp8LinearMethod) replaces the float
weight with its own parameters and forward; the bias stays in the model dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from app.worker.quantization.linear import Fp8LinearMethod

# Attribute set on fused parameters: {shard_id: (first_row, num_rows)}.
SHARD_ROWS = "shard_rows"
# Attributes a quantization method sets on its parameters: a callable(tensor, shard_id) that copies
# a checkpoint tensor in (the loader calls it instead of copying), and False on parameters derived
# while loading rather than read from the checkpoint.
WEIGHT_LOADER = "weight_loader"
FROM_CHECKPOINT = "from_checkpoint"


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        quant: Fp8LinearMethod | None = None,
        shard_rows: dict[str | int | None, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.quant = quant
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        else:
            quant.create_weights(self, in_features, shard_rows or {None: (0, out_features)})
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input computed as one matmul (e.g. q/k/v or gate/up)."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str | int, int],
        bias: bool,
        dtype: torch.dtype,
        quant: Fp8LinearMethod | None = None,
    ) -> None:
        rows, start = {}, 0
        for shard_id, size in shards.items():
            rows[shard_id] = (start, size)
            start += size
        super().__init__(in_features, start, bias, dtype, quant, rows)
        self.sizes = list(shards.values())
        for param in self.parameters():
            setattr(param, SHARD_ROWS, rows)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.sizes, dim=-1)


class QKVLinear(MergedLinear):
    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        quant: Fp8LinearMethod | None = None,
    ) -> None:
        shards = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden, shards, bias, dtype, quant)


class GateUpLinear(MergedLinear):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        quant: Fp8LinearMethod | None = None,
    ) -> None:
        super().__init__(hidden, {"gate": intermediate, "up": intermediate}, bias, dtype, quant)
