"""The sparse mixture-of-experts block the MoE families share (Qwen3-MoE, Mixtral, Qwen2-MoE).

A router (a linear to E logits, replicated on every rank) picks each token's top-k experts (softmax and
top-k in one kernel, renormalised where the config says); the experts are SiLU-gated MLPs held stacked:
`w13_weight` [E, 2I, H] (each expert's gate rows, then its up rows) and `w2_weight` [E, H, I], the layout
kernels/moe.py multiplies. On CUDA the Triton kernels run (--moe-backend triton, the default); on the
CPU the torch reference does, which is also what they are tested against.

Checkpoints store one tensor per expert and projection (`experts.{e}.gate_proj.weight`, or Mixtral's
`experts.{e}.w1.weight`); `ExpertNames` maps those onto the stacked parameters with a shard id
"gate.{e}", "up.{e}" or "down.{e}" that the parameters' weight loader places.

Tensor parallelism splits every expert's intermediate dimension (--moe-tp-size equal to the TP size):
each rank holds its slice of the gate and up rows and the matching columns of down, and the block's
output is all-reduced once. FP8 (a quantization method) holds the experts as e4m3 codes with
per-output-channel scales: 16-bit checkpoints are quantized as they load, block-scaled FP8 checkpoints
(Qwen3-30B-A3B-FP8's 128x128 tiles) requantized per channel once loaded (finish_loading).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.layers.linear import (
    FROM_CHECKPOINT,
    SHARD_VIEW,
    WEIGHT_LOADER,
    Linear,
    TPSlice,
    mark_tp_slices,
)
from app.worker.parallel import SINGLE, TensorParallel
from app.worker.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows, requantize_blocks_to_rows
from app.worker.quantization.linear import DUMMY_RANGE

if TYPE_CHECKING:
    from app.worker.quantization.linear import Fp8LinearMethod


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum

    def check_tp(self, size: int) -> None:
        if self.intermediate % size:
            raise ValueError(f"--tensor-parallel-size {size} must divide the experts' {self.intermediate} "
                             "intermediate rows of this model")  # fmt: skip


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names one expert's projections: gate, up and down."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^(.*\.experts)\.(\d+)\.({self.gate}|{self.up}|{self.down})\.(weight|weight_scale_inv)$")

    def target(self, name: str) -> tuple[str, str] | None:
        """A checkpoint expert tensor -> (stacked parameter, shard id); None for any other tensor. Block
        scales (`weight_scale_inv`) go to the tile-scale parameters of a block-scaled FP8 checkpoint."""
        found = self.pattern().match(name)
        if found is None:
            return None
        prefix, expert, proj, kind = found.groups()
        suffix = "_weight" if kind == "weight" else "_tile_scale"
        if proj == self.down:
            return f"{prefix}.w2{suffix}", f"down.{expert}"
        return f"{prefix}.w13{suffix}", f"{'gate' if proj == self.gate else 'up'}.{expert}"

    def names(self, param_name: str, num_experts: int) -> list[tuple[str, str]] | None:
        """The checkpoint tensors that fill one stacked parameter (None: not an expert parameter)."""
        for stacked, projs in (("w13", (("gate", self.gate), ("up", self.up))), ("w2", (("down", self.down),))):
            for suffix, kind in (("_weight", "weight"), ("_tile_scale", "weight_scale_inv")):
                if param_name.endswith(f".experts.{stacked}{suffix}"):
                    prefix = param_name.removesuffix(f".{stacked}{suffix}")
                    return [(f"{prefix}.{e}.{proj}.{kind}", f"{part}.{e}") for e in range(num_experts)
                            for part, proj in projs]  # fmt: skip
        return None


class FusedExperts(nn.Module):
    """E SiLU-gated MLPs; forward(x, routing weights, expert ids) -> the weighted sum of each token's top-k
    experts (this rank's partial sums under tensor parallelism: the caller all-reduces)."""

    def __init__(self, hidden: int, spec: MoeSpec, dtype: torch.dtype, quant: Fp8LinearMethod | None = None,
                 tp: TensorParallel = SINGLE) -> None:  # fmt: skip
        super().__init__()
        self.spec = spec
        self.local = local = spec.intermediate // tp.size
        self.fp8 = quant is not None
        self.block = _checkpoint_block(quant, tp)
        weight_dtype = FP8_DTYPE if self.fp8 else dtype
        e = spec.num_experts
        self.w13_weight = _param(torch.empty(e, 2 * local, hidden, dtype=weight_dtype), partial(self._load, "w13"))
        self.w2_weight = _param(torch.empty(e, hidden, local, dtype=weight_dtype), partial(self._load, "w2"))
        if self.fp8:  # per-output-channel scales, derived as the weights load; until then the scale that
            # makes dummy codes (drawn over e4m3's range) the loader's dummy magnitude
            dummy = DUMMY_RANGE / FP8_MAX
            self.w13_scale = _param(torch.full((e, 2 * local), dummy), None, from_checkpoint=False)
            self.w2_scale = _param(torch.full((e, hidden), dummy), None, from_checkpoint=False)
        if self.block is not None:  # the checkpoint's tile scales, held until finish_loading requantizes
            b0, b1 = self.block
            self.tiles = -(-local // b0)  # tile rows of gate (then of up) in w13_tile_scale
            self.w13_tile_scale = _param(torch.empty(e, 2 * self.tiles, -(-hidden // b1)), partial(self._load, "t13"))
            self.w2_tile_scale = _param(torch.empty(e, -(-hidden // b0), -(-local // b1)), partial(self._load, "t2"))
        for name in ("w13", "w2"):  # weight updates fill 16-bit experts through the same views
            setattr(getattr(self, f"{name}_weight"), SHARD_VIEW, partial(self._view, name))
        if tp.size > 1:  # the rank's rows of gate and up, its columns of down
            rows = TPSlice(0, tp.rank * local, local, spec.intermediate)
            cols = TPSlice(1, tp.rank * local, local, spec.intermediate)
            mark_tp_slices(self.w13_weight, {f"{kind}.{x}": rows for kind in ("gate", "up") for x in range(e)})
            mark_tp_slices(self.w2_weight, {f"down.{x}": cols for x in range(e)})

    def _load(self, which: str, tensor: torch.Tensor, shard: str | None) -> None:
        """Copy one expert's checkpoint tensor into its place: 16-bit as it is, or quantized per output
        channel (FP8 at load), or a block-scaled checkpoint's codes and tile scales as they are."""
        target = self._view(which, shard)
        e, up = int(str(shard).split(".")[1]), str(shard).startswith("up.")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
        codes = which in ("w13", "w2") and self.block is not None
        if codes != (tensor.dtype == FP8_DTYPE):
            raise ValueError(f"is {tensor.dtype}, the model expects {'FP8 codes' if codes else 'a float tensor'}")
        with torch.no_grad():
            if codes or not self.fp8 or which in ("t13", "t2"):
                target.copy_(tensor)
                return
            q, scales = quantize_rows(tensor.to(device=target.device, dtype=torch.float32))
            target.copy_(q)
            scale = self.w13_scale.data[e, up * self.local : (up + 1) * self.local] if which == "w13" else \
                self.w2_scale.data[e]  # fmt: skip
            scale.copy_(scales.view(-1))

    def _view(self, which: str, shard: str | None) -> torch.Tensor:
        """Where one expert's checkpoint tensor goes: shard "gate.{e}", "up.{e}" or "down.{e}"."""
        kind, expert = str(shard).split(".")
        e, up = int(expert), kind == "up"
        if which == "w13":
            return self.w13_weight.data[e, up * self.local : (up + 1) * self.local]
        if which == "t13":
            return self.w13_tile_scale.data[e, up * self.tiles : (up + 1) * self.tiles]
        return (self.w2_weight if which == "w2" else self.w2_tile_scale).data[e]

    def finish_loading(self, dummy: bool = False) -> None:
        """A block-scaled checkpoint's codes requantized per output channel (the kernels' layout: one more
        e4m3 rounding, as for the dense linears, docs/quantization.md); the tile scales are dropped.
        Dummy tiles give the dummy magnitude."""
        if self.block is None:
            return
        with torch.no_grad():
            if dummy:
                self.w13_tile_scale.fill_(DUMMY_RANGE / FP8_MAX)
                self.w2_tile_scale.fill_(DUMMY_RANGE / FP8_MAX)
            local, tiles = self.local, self.tiles
            for e in range(self.spec.num_experts):
                for half in (0, 1):
                    rows, tile_rows = slice(half * local, (half + 1) * local), slice(half * tiles, (half + 1) * tiles)
                    q, scales = requantize_blocks_to_rows(self.w13_weight[e, rows], self.w13_tile_scale[e, tile_rows],
                                                          self.block)  # fmt: skip
                    self.w13_weight[e, rows], self.w13_scale[e, rows] = q, scales.view(-1)
                q, scales = requantize_blocks_to_rows(self.w2_weight[e], self.w2_tile_scale[e], self.block)
                self.w2_weight[e], self.w2_scale[e] = q, scales.view(-1)
        del self.w13_tile_scale, self.w2_tile_scale
        self.block = None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] and each token's routing (weights [T, k], expert ids [T, k]) -> [T, H]."""
        moe = kernel_module("moe")
        scales = (self.w13_scale, self.w2_scale) if self.fp8 else (None, None)
        run = moe.fused_moe if use_fused(x) else moe.fused_moe_reference
        return run(x, self.w13_weight, self.w2_weight, weights, ids, *scales)


def _checkpoint_block(quant: Fp8LinearMethod | None, tp: TensorParallel) -> tuple[int, int] | None:
    """The tile of a block-scaled FP8 checkpoint's experts; None for 16-bit checkpoints. FP8 expert
    checkpoints with other scales are refused here."""
    if quant is None or not quant.scheme.serialized:
        return None
    if quant.scheme.block is None:
        raise ValueError("FP8 expert checkpoints with per-tensor or per-channel scales are not supported: the "
                         "block-scaled layout (weight_block_size) is, and 16-bit checkpoints quantized while "
                         "loading (--quantization fp8)")  # fmt: skip
    if tp.size > 1:
        raise ValueError("block-scaled FP8 expert checkpoints with --tensor-parallel-size > 1 are not supported")
    return quant.scheme.block


def _param(data: torch.Tensor, loader: object, from_checkpoint: bool = True) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    if loader is not None:
        setattr(param, WEIGHT_LOADER, loader)
    if not from_checkpoint:
        setattr(param, FROM_CHECKPOINT, False)
    return param


class SparseMoeBlock(nn.Module):
    """Router and experts, plus (Qwen2-MoE) a shared expert every token goes through, scaled by a sigmoid
    gate. The routed output is all-reduced over the TP ranks here; the shared expert's row-parallel down
    projection reduces its own. The router and the shared expert's gate stay unquantized (checkpoints
    keep them in 16 bits; the router's logits pick the experts)."""

    def __init__(self, hidden: int, spec: MoeSpec, dtype: torch.dtype, quant: Fp8LinearMethod | None = None,
                 tp: TensorParallel = SINGLE, shared_expert: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__()
        self.gate = Linear(hidden, spec.num_experts, False, dtype)
        self.experts = FusedExperts(hidden, spec, dtype, quant, tp)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden, 1, False, dtype)
        self.tp = tp

    def takes_quantized_rows(self) -> bool:
        return False  # the router reads the normed rows in the model dtype

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and weights. On CUDA the router's linear and its softmax and top-k
        run in one launch for a decode step's few tokens (kernels/moe.py route_linear_topk), else the
        linear then the softmax-and-top-k kernel; on the CPU the torch reference."""
        moe, s = kernel_module("moe"), self.experts.spec
        if not use_fused(x):
            return moe.route_topk_reference(self.gate(x), s.top_k, s.renormalize)
        if x.shape[0] <= moe.ROUTER_FUSED_MAX_TOKENS and self.gate.quant is None and self.gate.weight.dtype == x.dtype:
            return moe.route_linear_topk(x, self.gate.weight, s.top_k, s.renormalize)
        return moe.route_topk(self.gate(x), s.top_k, s.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.experts(x, *self.route(x)))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
