"""Qwen3 (dense): per-head RMSNorm on q and k before RoPE; biases from attention_bias."""

from __future__ import annotations

from typing import Any

from app.worker.models.dense import DenseCausalLM, DenseOptions


class Qwen3ForCausalLM(DenseCausalLM):
    architectures = ("Qwen3ForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DenseOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
