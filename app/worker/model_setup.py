"""The served model, resolved from the settings and built: where its files are, its Hugging Face config,
the compute dtype, FP8 weight and KV-cache schemes, the context length; then the model itself with its
weights loaded on the device."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.config.settings import Settings
from app.worker.layers.cpu_weights import use_cpu_weight_layout
from app.worker.loader import (
    eos_token_ids,
    load_hf_config,
    load_weights,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from app.worker.models import DenseCausalLM, model_class_for
from app.worker.parallel import TensorParallel
from app.worker.quantization import Fp8LinearMethod, Fp8Scheme, resolve_kv_cache_quant, resolve_quantization
from app.worker.quantization.kv import KVCacheQuant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSetup:
    model_dir: Path  # a root weight updates from disk may read below
    config: Any  # the Hugging Face config, overrides applied
    dtype: torch.dtype  # compute dtype
    quant_scheme: Fp8Scheme | None  # FP8 weights, or None
    kv_quant: KVCacheQuant
    kv_dtype: torch.dtype  # the KV cache's storage dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


def resolve_model(settings: Settings, device: torch.device, tp: TensorParallel) -> ModelSetup:
    """What the settings say about the model, checked against its config (nothing is loaded yet)."""
    model_dir = resolve_model_path(
        settings.model,
        settings.load_format,
        settings.revision,
        settings.download_dir,
        settings.trust_remote_code,
    )
    config = load_hf_config(model_dir, settings.hf_overrides, settings.trust_remote_code)
    dtype = resolve_dtype(settings.dtype, config, device)
    quant_scheme = resolve_quantization(settings.quantization, config)
    if tp.size > 1 and quant_scheme is not None and quant_scheme.block is not None:
        raise ValueError(
            "block-scaled FP8 checkpoints with --tensor-parallel-size > 1 are not supported yet (each rank "
            "would need its own slice of the 128x128 scale tiles); per-tensor and per-channel FP8 "
            "checkpoints and --quantization fp8 on a bf16 checkpoint work with tensor parallelism"
        )
    kv_quant = resolve_kv_cache_quant(
        settings.kv_cache_dtype,
        settings.kv_cache_quant_method,
        settings.quantization_param_path,
        int(config.num_hidden_layers),
    )
    return ModelSetup(
        model_dir=model_dir,
        config=config,
        dtype=dtype,
        quant_scheme=quant_scheme,
        kv_quant=kv_quant,
        kv_dtype=kv_quant.storage_dtype(dtype),
        max_model_len=resolve_max_model_len(settings.max_model_len, config),
        vocab_size=int(config.vocab_size),
        eos_token_ids=eos_token_ids(config, model_dir),
    )


def build_model(setup: ModelSetup, device: torch.device, tp: TensorParallel, load_format: str,
                progress: Callable[..., Any]) -> tuple[DenseCausalLM, int]:
    """The model on `device` with its weights loaded, and the bytes its parameters take."""
    cls = model_class_for(setup.config)
    with torch.device(device):
        quant = Fp8LinearMethod(setup.quant_scheme) if setup.quant_scheme is not None else None
        model = cls(setup.config, setup.dtype, setup.max_model_len, quant=quant, tp=tp)
    model.to(device)  # the RoPE tables are built on the CPU
    fmt = load_weights(model, setup.model_dir, load_format, progress)
    if device.type == "cpu":
        use_cpu_weight_layout(model)
    model.eval()
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info(
        "loaded %s (%s weights, %s, %.3f GB) on %s; quantization: %s; KV cache: %s",
        cls.__name__,
        fmt,
        str(setup.dtype).removeprefix("torch."),
        weights_bytes / 1e9,
        device,
        setup.quant_scheme.describe() if setup.quant_scheme is not None else "none",
        setup.kv_quant.describe(),
    )
    return model, weights_bytes
