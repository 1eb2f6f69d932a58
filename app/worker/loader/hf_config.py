"""The model's Hugging Face config with --hf-overrides applied, and what is derived from it:
the compute dtype (--dtype), the context limit (--max-model-len) and the EOS token ids."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from app.worker.cpu_host import cpu_auto_dtype

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def load_hf_config(
    model_dir: Path, hf_overrides: Mapping[str, Any] | None = None, trust_remote_code: bool = False
) -> PretrainedConfig:
    """Read config.json, merge the overrides into it (nested dicts merge key by key) and build the
    config from the result, so transformers normalizes overridden fields (e.g. RoPE) as if the
    file had said so. A `quantization_config` is kept: app.worker.quantization decides whether it runs."""
    if hf_overrides is not None and not isinstance(hf_overrides, Mapping):
        raise TypeError(f"--hf-overrides must be a JSON object, got {type(hf_overrides).__name__}")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    if hf_overrides:
        raw, _ = type(config).get_config_dict(str(model_dir))
        config = type(config).from_dict(_deep_merge(raw, hf_overrides))
    return config


def checkpoint_dtype(config: Any) -> torch.dtype | None:
    """The dtype the checkpoint was saved in, from config `dtype` (or the older `torch_dtype`)."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return _DTYPES.get(value.removeprefix("torch."))
    return None


def resolve_dtype(dtype: str, config: Any, device: torch.device) -> torch.dtype:
    """--dtype: auto = bfloat16 on CUDA (float16 if the checkpoint is float16); on the CPU the checkpoint's
    half dtype where the CPU multiplies it natively, else float32 (app/worker/cpu_host.py)."""
    if dtype == "auto":
        if device.type == "cpu":
            chosen, why = cpu_auto_dtype(checkpoint_dtype(config))
            logger.info("dtype auto on the CPU: %s (%s)", str(chosen).removeprefix("torch."), why)
            return chosen
        return torch.float16 if checkpoint_dtype(config) == torch.float16 else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_max_model_len(max_model_len: int | None, config: Any) -> int:
    """Default: the config's max_position_embeddings; longer is refused (RoPE tables end there)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        raise ValueError("the model config has no max_position_embeddings")
    if max_model_len is None:
        return int(limit)
    if max_model_len < 1:
        raise ValueError(f"--max-model-len must be positive, got {max_model_len}")
    if max_model_len > limit:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return int(max_model_len)


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def eos_token_ids(config: Any, model_dir: Path) -> list[int]:
    """The union of config.eos_token_id and generation_config.json's, in that order."""
    ids = _as_list(getattr(config, "eos_token_id", None))
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        ids += _as_list(json.loads(gen_file.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))
