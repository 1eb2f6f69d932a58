"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm), experts of
moe_intermediate_size, top-k weights renormalised where norm_topk_prob says."""

from __future__ import annotations

from typing import Any

from app.worker.models.dense import DenseOptions
from app.worker.models.moe import QwenMoeCausalLM


class Qwen3MoeForCausalLM(QwenMoeCausalLM):
    architectures = ("Qwen3MoeForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DenseOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
