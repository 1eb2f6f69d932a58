"""Linear layers. Fused ones (QKV, gate_up) hold several checkpoint tensors stacked along the output
dimension; each parameter records where each shard's rows live so the loader can fill it piecewise.

Tensor parallelism (app/worker/parallel.py): the fused QKV and gate_up layers are column-parallel (each
rank holds its heads' or its slice of the intermediate rows), o_proj and down_proj row-parallel (each
rank holds the matching input columns; the partial products are all-reduced, the bias added once, by
the leader). Parameters record which slice of each checkpoint tensor the rank reads (TP_SLICES), so the
loader reads only that.

A quantization method (`quant`, e.g. app.worker.quantization.Fp8LinearMethod) replaces the float
weight with its own parameters and forward; the bias stays in the model dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from app.worker.layers.fused import kernel_module
from app.worker.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from app.worker.quantization.fp8 import Fp8Rows

# Rows up to which a decode-sized matmul may run kernels/gemv.py (its MAX_M, which a test checks).
GEMV_MAX_M = 16
# Rows up to which a CPU linear with an fp16 copy of its weight (app/worker/layers/cpu_weights.py)
# multiplies by that copy, through fbgemm, instead of the oneDNN-packed weight: fbgemm streams the
# weight faster at one to four rows and slower from about six.
FP16_MAX_ROWS = 4
# Attribute set on fused parameters: {shard_id: (first_row, num_rows)}.
SHARD_ROWS = "shard_rows"
# Attributes a quantization method sets on its parameters: a callable(tensor, shard_id) that copies
# a checkpoint tensor in (the loader calls it instead of copying), and False on parameters derived
# while loading rather than read from the checkpoint.
WEIGHT_LOADER = "weight_loader"
FROM_CHECKPOINT = "from_checkpoint"
# Attribute set on parameters that stack checkpoint tensors other than by rows (the MoE experts'
# [E, rows, cols]): a callable(shard_id) returning the view that checkpoint tensor fills.
SHARD_VIEW = "shard_view"
# Attribute set on tensor-parallel parameters: {shard_id: TPSlice}, the part of each checkpoint tensor
# this rank holds.
TP_SLICES = "tp_slices"


@dataclass(frozen=True)
class TPSlice:
    """Elements start .. start+length of dimension `dim` of a checkpoint tensor. The rank's parameter may
    hold more (zero padding after them: the last vocab shard)."""

    dim: int
    start: int
    length: int
    full: int  # the checkpoint tensor's size along dim

    def splits(self, shape: tuple[int, ...] | list[int]) -> bool:
        """False for a tensor every rank holds whole: a size-1 dimension (a per-tensor scale). A tensor
        of the wrong size along dim is refused here (its slice could look right)."""
        if len(shape) <= self.dim or shape[self.dim] == 1:
            return False
        if shape[self.dim] != self.full:
            raise ValueError(f"has shape {tuple(shape)}, the model expects {self.full} along dimension {self.dim}")
        return True

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.length) if self.splits(tensor.shape) else tensor


def tp_slice(param: nn.Parameter, shard: str | int | None) -> TPSlice | None:
    """The part of the checkpoint tensor (shard) this rank's parameter holds; None: all of it."""
    return getattr(param, TP_SLICES, {}).get(shard)


def mark_tp_slices(param: nn.Parameter, slices: dict[str | int | None, TPSlice]) -> None:
    setattr(param, TP_SLICES, slices)


class LinearMethod(Protocol):
    """What a linear asks of its quantization method (app.worker.quantization.Fp8LinearMethod). Declared
    here so that the layers do not import the quantization package, which imports them."""

    def create_weights(
        self, layer: nn.Module, in_features: int, shard_rows: dict[str | int | None, tuple[int, int]]
    ) -> None: ...

    def takes_quantized_rows(self) -> bool: ...

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor: ...


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        quant: LinearMethod | None = None,
        shard_rows: dict[str | int | None, tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.quant = quant
        self.fp16: torch.ScriptObject | None = None  # fbgemm's fp16 copy of the weight, CPU only (FP16_MAX_ROWS)
        if quant is None:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        else:
            quant.create_weights(self, in_features, shard_rows or {None: (0, out_features)})
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.project(x, self.bias)

    def takes_quantized_rows(self) -> bool:
        """Whether this layer quantizes its input per token itself (FP8 weights, dynamic
        activation scales): the kernel that makes the input may then hand it over quantized."""
        return self.quant is not None and self.quant.takes_quantized_rows()

    def project(self, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is not None:
            return self.quant.apply(self, x, bias)
        if x.is_cuda and x.dim() == 2 and x.shape[0] <= GEMV_MAX_M:
            gemv = kernel_module("gemv")  # loaded on CUDA only: a CPU worker never imports Triton
            config = gemv.measured_config(x.shape[0], *self.weight.shape, self.weight.dtype)
            if config is not None:  # decode-sized, and kernels/gemv.py beat cuBLAS on this shape
                y = gemv.gemv(x, self.weight, None, config)
                return y if bias is None else y + bias
        if self.fp16 is not None and x.dim() == 2 and x.shape[0] <= FP16_MAX_ROWS:
            return fp16_linear(x, self.fp16, bias)
        return linear(x, self.weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or oneDNN's linear where the weight is prepacked for it (app/worker/layers/cpu_weights.py)."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def fp16_linear(x: torch.Tensor, packed: torch.ScriptObject, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) by fbgemm's fp16 copy of W (`cpu_weights.fp16_copy`): float32 input, float32
    accumulation and bias, rounded once to x's dtype, as oneDNN's half-precision linear rounds."""
    out = torch.ops.quantized.linear_dynamic_fp16(x.float(), packed)
    if bias is not None:
        out += bias
    return out.to(x.dtype)


class RowParallelLinear(Linear):
    """A linear whose input features are split over the TP ranks (o_proj, down_proj): partial products
    are summed by an all-reduce; the leader alone adds the bias so that it counts once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        quant: LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        local = in_features // tp.size
        super().__init__(local, out_features, bias, dtype, quant)
        self.tp = tp
        if tp.size > 1:  # per-output-channel scales and the bias are whole on every rank
            mark_tp_slices(self.weight, {None: TPSlice(1, tp.rank * local, local, in_features)})

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.tp.all_reduce(self.project(x, self.bias if self.tp.leader else None))


class MergedLinear(Linear):
    """Several projections of the same input computed as one matmul (e.g. q/k/v or gate/up). With tensor
    parallelism it is column-parallel: `shards` are this rank's sizes and `tp_parts` where each shard's
    rows start in the checkpoint tensor and how many it has."""

    def __init__(
        self,
        in_features: int,
        shards: dict[str | int, int],
        bias: bool,
        dtype: torch.dtype,
        quant: LinearMethod | None = None,
        tp_parts: dict[str | int, tuple[int, int]] | None = None,
    ) -> None:
        rows, start = {}, 0
        for shard_id, size in shards.items():
            rows[shard_id] = (start, size)
            start += size
        super().__init__(in_features, start, bias, dtype, quant, rows)
        self.sizes = list(shards.values())
        slices = {shard: TPSlice(0, first, shards[shard], full)
                  for shard, (first, full) in (tp_parts or {}).items()}
        for name, param in self.named_parameters():
            setattr(param, SHARD_ROWS, rows)
            if slices and name != "input_scale":  # weights, bias and per-channel scales follow the rows
                mark_tp_slices(param, slices)

    def forward_split(self, x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, ...]:
        return self.forward(x).split(self.sizes, dim=-1)


def local_kv_heads(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, KV heads) this rank holds: its share, or one replicated head when there are fewer
    KV heads than ranks (ranks tp/num_kv_heads apart share a head)."""
    if num_kv_heads >= tp.size:
        local = num_kv_heads // tp.size
        return tp.rank * local, local
    return tp.rank * num_kv_heads // tp.size, 1


class QKVLinear(MergedLinear):
    """num_heads / num_kv_heads are the model's; this rank holds num_heads / tp query heads and its KV heads."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        dtype: torch.dtype,
        quant: LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        heads = num_heads // tp.size
        first_kv, kv_heads = local_kv_heads(num_kv_heads, tp)
        shards = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        kv_rows = num_kv_heads * head_dim
        parts = {"q": (tp.rank * heads * head_dim, num_heads * head_dim), "k": (first_kv * head_dim, kv_rows),
                 "v": (first_kv * head_dim, kv_rows)}
        super().__init__(hidden, shards, bias, dtype, quant, parts if tp.size > 1 else None)


class GateUpLinear(MergedLinear):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        dtype: torch.dtype,
        quant: LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        local = intermediate // tp.size
        parts = {"gate": (tp.rank * local, intermediate), "up": (tp.rank * local, intermediate)}
        super().__init__(hidden, {"gate": local, "up": local}, bias, dtype, quant, parts if tp.size > 1 else None)
