"""Mixtral (8x7B, 8x22B): Llama's attention, every layer sparse, experts w1 (gate), w3 (up) and w2 (down)
in a block the checkpoints call block_sparse_moe; the top-k weights are always renormalised."""

from __future__ import annotations

from typing import Any

from app.worker.layers.moe import ExpertNames, MoeSpec
from app.worker.models.dense import DenseOptions
from app.worker.models.moe import MoeCausalLM


class MixtralForCausalLM(MoeCausalLM):
    """Its sliding window (unset in the released configs) is refused by the dense base unless
    max_model_len fits in it."""

    architectures = ("MixtralForCausalLM",)
    expert_names = ExpertNames(gate="w1", up="w3", down="w2")
    block_prefix = ".block_sparse_moe."

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        return DenseOptions()

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)
