"""The base of the mixture-of-experts families: the dense decoder (attention, norms, embeddings) with a
sparse MoE block (app/worker/layers/moe.py) as the MLP of its sparse layers. Families say how their
config describes the experts (`moe_spec`), which layers are sparse, and how their checkpoints name the
block and the experts' projections."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from app.worker.layers.moe import ExpertNames, MoeSpec, SparseMoeBlock
from app.worker.models.dense import DenseCausalLM, DenseDims, DenseMLP, DenseOptions

_BLOCK = ".mlp."  # where our parameters keep the block in every layer


class MoeCausalLM(DenseCausalLM):
    expert_names: ClassVar[ExpertNames] = ExpertNames()
    block_prefix: ClassVar[str] = _BLOCK  # the checkpoint's name of the block (Mixtral: ".block_sparse_moe.")

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        raise NotImplementedError(f"{cls.__name__} must say how its config describes the experts")

    @classmethod
    def sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        return True

    def shared_expert(self, config: Any, dims: DenseDims, opts: DenseOptions, dtype: torch.dtype) -> nn.Module | None:
        """A dense expert every token goes through beside its routed ones (Qwen2-MoE); None here."""
        return None

    def with_mlp(self, config: Any, opts: DenseOptions, dtype: torch.dtype) -> DenseOptions:
        self.moe = spec = self.moe_spec(config)
        spec.check_tp(opts.tp.size)
        dims = DenseDims.from_config(config)

        def mlp(layer_idx: int) -> nn.Module:
            if not self.sparse_layer(config, layer_idx):
                return DenseMLP(dims, opts, dtype)
            shared = self.shared_expert(config, dims, opts, dtype)
            return SparseMoeBlock(dims.hidden, spec, dtype, opts.quant, opts.tp, shared)

        return replace(opts, mlp=mlp)

    # ---- checkpoint names: one tensor per expert and projection onto the stacked parameters

    def checkpoint_target(self, name: str) -> tuple[str, str | None]:
        name = name.replace(self.block_prefix, _BLOCK)
        found = self.expert_names.target(name)
        return found if found is not None else super().checkpoint_target(name)

    def checkpoint_names(self, param_name: str) -> list[tuple[str, str | None]]:
        found = self.expert_names.names(param_name, self.moe.num_experts)
        names = found if found is not None else super().checkpoint_names(param_name)
        return [(name.replace(_BLOCK, self.block_prefix), shard) for name, shard in names]


def sparse_every(config: Any, layer_idx: int) -> bool:
    """Qwen's rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class QwenMoeCausalLM(MoeCausalLM):
    """Qwen2-MoE's and Qwen3-MoE's experts: num_experts of moe_intermediate_size, top-k renormalised
    where norm_topk_prob says, sparse layers by sparse_every."""

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob))  # fmt: skip

    @classmethod
    def sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        return sparse_every(config, layer_idx)
