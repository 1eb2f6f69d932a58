"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), routed experts plus a
shared expert every token goes through, scaled by a sigmoid gate."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from app.worker.models.dense import DenseDims, DenseMLP, DenseOptions
from app.worker.models.moe import QwenMoeCausalLM


class Qwen2MoeForCausalLM(QwenMoeCausalLM):
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        return DenseOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

    def shared_expert(self, config: Any, dims: DenseDims, opts: DenseOptions, dtype: torch.dtype) -> nn.Module:
        size = config.shared_expert_intermediate_size
        if size % opts.tp.size:
            raise ValueError(f"--tensor-parallel-size {opts.tp.size} must divide the shared expert's {size} "
                             "intermediate rows of this model")  # fmt: skip
        return DenseMLP(replace(dims, intermediate=size), opts, dtype)
