"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm), experts of
moe_intermediate_size, top-k weights renormalised where norm_topk_prob says."""

from __future__ import annotations

from typing import Any

from app.worker.layers.moe import MoeSpec
from app.worker.models.dense import DenseOptions
from app.worker.models.moe import MoeCausalLM, sparse_every


class Qwen3MoeForCausalLM(MoeCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DenseOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)

    @classmethod
    def moe_spec(cls, config: Any) -> MoeSpec:
        return MoeSpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       bool(config.norm_topk_prob))  # fmt: skip

    @classmethod
    def sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        return sparse_every(config, layer_idx)
