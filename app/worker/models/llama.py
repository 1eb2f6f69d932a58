"""Llama (1/2/3.x) and Mistral: optional biases from attention_bias / mlp_bias."""

from __future__ import annotations

from typing import Any

from app.worker.models.dense import DenseCausalLM, DenseOptions


class LlamaForCausalLM(DenseCausalLM):
    architectures = ("LlamaForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DenseOptions(
            qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layout; its sliding window is refused by the dense base unless max_model_len fits in it."""

    architectures = ("MistralForCausalLM",)
