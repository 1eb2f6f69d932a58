"""Qwen2 / Qwen2.5: biases on q, k and v (never on o or the MLP)."""

from __future__ import annotations

from typing import Any

from app.worker.models.dense import DenseCausalLM, DenseOptions


class Qwen2ForCausalLM(DenseCausalLM):
    architectures = ("Qwen2ForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        return DenseOptions(qkv_bias=True)
