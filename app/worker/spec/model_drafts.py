"""Building the model draft --speculative-algorithm names (STANDALONE: a draft model; EAGLE3: a head),
and the attention backend its cache runs (--drafter-attention-backend, else the target's)."""

from __future__ import annotations

from typing import Any

import torch

from app.config.settings import Settings
from app.worker.attention import resolve_attention_backend
from app.worker.models.dense import DenseCausalLM
from app.worker.spec.drafter import ChainDrafter

MODEL_DRAFTS = ("STANDALONE", "EAGLE3")


def load_model_drafter(settings: Settings, target: DenseCausalLM, target_config: Any, device: torch.device,
                       max_model_len: int, max_slots: int) -> ChainDrafter:
    """The drafter, its weights loaded beside the target's in the target's dtype (before the KV pool is
    sized: its weights count as the target's do; the runner adds kv_bytes_per_token and attaches it)."""
    algorithm = settings.speculative_algorithm
    chunk = settings.chunked_prefill_size
    max_tokens = chunk if chunk is not None and chunk > 0 else settings.max_prefill_tokens
    if algorithm == "STANDALONE":
        from app.worker.spec.draft_model import DraftModelProposer

        return DraftModelProposer.load(settings, target_config, device, target.dtype, max_model_len, max_slots,
                                       max_tokens)
    if algorithm == "EAGLE3":
        from app.worker.spec.eagle3 import Eagle3Proposer

        return Eagle3Proposer.load(settings, target, device, target.dtype, max_model_len, max_slots, max_tokens)
    raise ValueError(f"--speculative-algorithm {algorithm} drafts without a model")


def drafter_backend(settings: Settings, target_backend: str, target_head_dim: int, drafter: ChainDrafter,
                    device: torch.device, dtype: torch.dtype) -> str:
    """--drafter-attention-backend resolved on this device for the draft's head size (an unusable one is
    refused naming the flag), else the target's backend; but triton for flashinfer when the head sizes
    differ (a start never builds flashinfer's JIT kernels, and the target's checked only its own)."""
    name = settings.drafter_attention_backend
    if name is None:
        if target_backend == "flashinfer" and drafter.attention_spec.head_dim != target_head_dim:
            return "triton"
        return target_backend
    try:
        return resolve_attention_backend(name, device, dtype, drafter.attention_spec.head_dim)
    except ValueError as exc:
        raise ValueError(f"--drafter-attention-backend: {exc}") from None
