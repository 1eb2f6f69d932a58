"""Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints, written the way Hugging Face writes them.

The weights are drawn with a large initializer range and untied embeddings: with the usual 0.02 a
tiny random model's greedy output collapses into one repeated token, which would make parity tests
meaningless.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.utils import logging as hf_logging

from tests.support.tokenizer_factory import build_tokenizer

_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "initializer_range": 0.5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    seed: int = 0,
    *,
    max_shard_size: int | str | None = None,
    weights_format: str = "safetensors",
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` model (config, float32 weights, tokenizer, generation config).

    overrides: config fields (e.g. num_hidden_layers=2, rope_parameters={...}).
    max_shard_size: save sharded safetensors with an index (e.g. "40KB").
    weights_format: "safetensors" (save_pretrained) or "pt" (a pytorch_model.bin state dict).
    """
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(_CONFIGS)}")
    if weights_format not in ("safetensors", "pt"):
        raise ValueError(f"weights_format must be 'safetensors' or 'pt', not {weights_format!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    fields = {
        **_BASE,
        "vocab_size": len(tokenizer),
        "eos_token_id": eos_id,
        "bos_token_id": None,
        "pad_token_id": tokenizer.pad_token_id,
        **overrides,
    }
    config = _CONFIGS[arch](**fields)
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
    if weights_format == "safetensors":
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, **kwargs)
    else:
        if max_shard_size is not None:
            raise ValueError("max_shard_size applies to safetensors only")
        config.architectures = [type(model).__name__]
        config.save_pretrained(out)
        model.generation_config.save_pretrained(out)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        torch.save(state, out / "pytorch_model.bin")
    return out


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())
