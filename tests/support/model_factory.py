"""Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints, and the MoE families (Qwen3-MoE, Mixtral,
Qwen2-MoE: experts one tensor each), written the way Hugging Face writes them.

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
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.utils import logging as hf_logging

from tests.support.tokenizer_factory import build_tokenizer

_CONFIGS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "mistral": MistralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "qwen2_moe": Qwen2MoeConfig,
}
# The MoE families' experts: few and small, several chosen a token so that every expert is exercised.
_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 64, "norm_topk_prob": False},
}

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
        **_MOE.get(arch, {}),
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


# ---------------------------------------------------------------- FP8 checkpoints

# Formats write_fp8_checkpoint can write: (config.json quantization_config, weight scales, static inputs).
FP8_FORMATS = (
    "fp8-channel",  # quant_method fp8, per-channel weight_scale [N], dynamic activations (vLLM layout)
    "fp8-tensor-static",  # quant_method fp8, per-tensor weight_scale, static per-tensor input_scale (AutoFP8)
    "fp8-block",  # quant_method fp8, weight_block_size [128, 128], weight_scale_inv tiles (Hugging Face)
    "w8a8-channel",  # quant_method w8a8_fp8, weight_scale [N, 1], dynamic activations (SGLang)
    "w8a8-tensor-static",  # quant_method w8a8_fp8, per-tensor weight_scale, static input_scale
    "ct-channel-dynamic",  # compressed-tensors: channel weights, dynamic per-token activations
    "ct-tensor-static",  # compressed-tensors: tensor weights, static tensor activations
    "ct-block",  # compressed-tensors: 128x128 block weights, dynamic per-group activations
)
_FP8 = torch.float8_e4m3fn
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.double() / scale.double()).clamp(-448, 448).float().to(_FP8)


def _quantize_weight(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) with scale per tensor [] , per channel [N, 1], or per 128x128 tile."""
    if granularity == "tensor":
        scale = w.abs().max().float() / 448
        return _fp8_codes(w, scale), scale
    if granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).float() / 448
        return _fp8_codes(w, scale), scale
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128, dtype=w.dtype)
    padded[:rows, :cols] = w
    tiles = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = tiles.abs().amax(dim=(1, 3)).float().clamp(min=1e-12) / 448  # [R, C]
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return _fp8_codes(w, full), scale


def linear_input_amax(model_dir: str | Path, prompts: list[list[int]]) -> dict[str, float]:
    """Calibration for static activation scales: the largest |input| of every decoder linear over the
    prompts, from the transformers model (module name -> amax)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    amax: dict[str, float] = {}

    def hook(name: str):
        def record(_module: Any, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in _LINEARS
    ]
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    for handle in handles:
        handle.remove()
    return amax


def fp8_quantization_config(fmt: str) -> dict[str, Any]:
    if fmt.startswith("fp8") or fmt.startswith("w8a8"):
        config: dict[str, Any] = {
            "quant_method": "fp8" if fmt.startswith("fp8") else "w8a8_fp8",
            "activation_scheme": "static" if fmt.endswith("static") else "dynamic",
        }
        if fmt == "fp8-block":
            config.update(fmt="e4m3", weight_block_size=[128, 128])
        return config
    strategy = fmt.split("-")[1]
    static = fmt.endswith("static")
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "observer": "minmax"}
    weights = {**args, "strategy": strategy, "dynamic": False,
               "block_structure": [128, 128] if strategy == "block" else None}  # fmt: skip
    act_strategy = "tensor" if static else ("group" if strategy == "block" else "token")
    inputs = {**args, "strategy": act_strategy, "dynamic": not static,
              "group_size": 128 if act_strategy == "group" else None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def write_fp8_checkpoint(
    src_dir: str | Path, out_dir: str | Path, fmt: str, input_amax: dict[str, float] | None = None
) -> Path:
    """Quantize a float checkpoint (one model.safetensors, as build_tiny_model writes) into FP8 format
    `fmt` (FP8_FORMATS): decoder linears become float8_e4m3fn codes plus scales named as that format
    names them; everything else is copied. Static formats need input_amax (linear_input_amax)."""
    from safetensors.torch import load_file, save_file

    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose from {FP8_FORMATS}")
    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    granularity = {"channel": "channel", "tensor": "tensor", "block": "block"}[
        next(g for g in ("channel", "tensor", "block") if g in fmt)
    ]
    static = fmt.endswith("static")
    if static and input_amax is None:
        raise ValueError(f"{fmt} has static activation scales: pass input_amax")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in _LINEARS):
            tensors[name] = tensor
            continue
        codes, scale = _quantize_weight(tensor, granularity)
        tensors[name] = codes
        if fmt == "fp8-block":
            tensors[f"{module}.weight_scale_inv"] = scale
        elif fmt == "fp8-channel":
            tensors[f"{module}.weight_scale"] = scale.reshape(-1)
        else:
            tensors[f"{module}.weight_scale"] = scale.reshape(1) if granularity == "tensor" else scale
        if static:
            tensors[f"{module}.input_scale"] = torch.tensor([input_amax[module] / 448], dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config = read_config(out)
    config["quantization_config"] = fp8_quantization_config(fmt)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
