"""FP8 KV cache: --kv-cache-dtype, its per-layer scales (--quantization-param-path) and the write path.

A cached K (or V) value x of layer l is stored as round_e4m3(clamp(x / k_scale[l], -448, 448)) and
read back as stored * k_scale[l] (v_scale[l] for V). Scales default to 1.0; a JSON file gives
calibrated ones (schema in docs/quantization.md):

    {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.03, "1": 0.05, ...}}}}
        rank "0" -> layer -> one scale for both K and V (vLLM's layout); or
    {"kv_cache": {"dtype": "float8_e4m3fn", "k_scale": {"0": 0.03, ...}, "v_scale": {"0": 0.02, ...}}}

Every layer must be listed; an optional top-level "model_type" string is informational.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.worker.quantization.fp8 import FP8_DTYPE, quantize

logger = logging.getLogger(__name__)

FP8_KV_NAMES = ("fp8", "fp8_e4m3")  # fp8 is an alias of fp8_e4m3
BLACKWELL_KV = {"mxfp8": "an MXFP8 KV cache needs NVIDIA Blackwell GPUs (SM100 or newer)"}
_TOP_KEYS = {"kv_cache", "model_type"}
_KV_KEYS = {"dtype", "scaling_factor", "k_scale", "v_scale"}
_RANK = "0"  # one worker rank in this build


class KVQuantError(ValueError):
    """The KV cache settings or the scales file cannot be used."""


@dataclass(frozen=True)
class KVCacheQuant:
    """The KV cache's storage dtype (None: the model dtype) and its per-layer scales."""

    dtype: torch.dtype | None
    k_scales: tuple[float, ...]
    v_scales: tuple[float, ...]
    scales_from: str  # where the scales came from, for the logs

    @property
    def quantized(self) -> bool:
        return self.dtype is not None

    def storage_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None else model_dtype

    def describe(self) -> str:
        if self.dtype is None:
            return "auto (model dtype)"
        return f"fp8_e4m3 (scales: {self.scales_from})"


def resolve_kv_cache_quant(
    kv_cache_dtype: str, quant_method: str, param_path: str | None, num_layers: int
) -> KVCacheQuant:
    """--kv-cache-dtype, --kv-cache-quant-method and --quantization-param-path -> KVCacheQuant."""
    if quant_method != "none":
        raise KVQuantError(
            f"--kv-cache-quant-method {quant_method} is not supported: the FP8 KV cache uses per-layer "
            "scales (--quantization-param-path); per-token-head scales are not built"
        )
    if kv_cache_dtype in BLACKWELL_KV:
        raise KVQuantError(
            f"--kv-cache-dtype {kv_cache_dtype} is not supported: {BLACKWELL_KV[kv_cache_dtype]}"
        )
    if kv_cache_dtype == "auto":
        if param_path is not None:
            raise KVQuantError(
                f"--quantization-param-path {param_path} holds FP8 KV cache scales; "
                "it needs --kv-cache-dtype fp8_e4m3"
            )
        ones = (1.0,) * num_layers
        return KVCacheQuant(None, ones, ones, "none")
    if kv_cache_dtype not in FP8_KV_NAMES:
        raise KVQuantError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; choose auto, fp8 or fp8_e4m3"
        )
    if param_path is None:
        ones = (1.0,) * num_layers
        return KVCacheQuant(FP8_DTYPE, ones, ones, "default 1.0")
    k_scales, v_scales = load_kv_scales(Path(param_path), num_layers)
    return KVCacheQuant(FP8_DTYPE, k_scales, v_scales, f"--quantization-param-path {param_path}")


def load_kv_scales(path: Path, num_layers: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(k scales, v scales) per layer from a scales file; KVQuantError naming the file otherwise."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise KVQuantError(f"cannot read KV cache scales from {path}: {exc}") from exc
    try:
        return _parse_scales(doc, num_layers)
    except KVQuantError as exc:
        raise KVQuantError(f"{path}: {exc}") from exc


def _parse_scales(doc: Any, num_layers: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if not isinstance(doc, dict) or not isinstance(doc.get("kv_cache"), dict):
        raise KVQuantError('expected a JSON object with a "kv_cache" object')
    _no_unknown(doc, _TOP_KEYS, "top-level")
    kv = doc["kv_cache"]
    _no_unknown(kv, _KV_KEYS, "kv_cache")
    if kv.get("dtype") != "float8_e4m3fn":
        raise KVQuantError(f'kv_cache.dtype must be "float8_e4m3fn", got {kv.get("dtype")!r}')
    if "scaling_factor" in kv:
        if "k_scale" in kv or "v_scale" in kv:
            raise KVQuantError("give kv_cache.scaling_factor or kv_cache.k_scale/v_scale, not both")
        ranks = kv["scaling_factor"]
        if not isinstance(ranks, dict) or _RANK not in ranks or len(ranks) != 1:
            raise KVQuantError(
                f'kv_cache.scaling_factor must map rank "{_RANK}" (one rank in this build) to layers'
            )
        both = _layer_scales(ranks[_RANK], num_layers, f"kv_cache.scaling_factor.{_RANK}")
        return both, both
    if "k_scale" not in kv or "v_scale" not in kv:
        raise KVQuantError("kv_cache needs scaling_factor, or both k_scale and v_scale")
    return (
        _layer_scales(kv["k_scale"], num_layers, "kv_cache.k_scale"),
        _layer_scales(kv["v_scale"], num_layers, "kv_cache.v_scale"),
    )


def _no_unknown(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise KVQuantError(f"unknown {where} keys {unknown}; allowed: {sorted(allowed)}")


def _layer_scales(layers: Any, num_layers: int, where: str) -> tuple[float, ...]:
    expected = {str(i) for i in range(num_layers)}
    if not isinstance(layers, dict) or set(layers) != expected:
        got = sorted(layers, key=str) if isinstance(layers, dict) else type(layers).__name__
        raise KVQuantError(f"{where} must map every layer index 0..{num_layers - 1} to a scale, got {got}")
    scales = []
    for i in range(num_layers):
        value = layers[str(i)]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise KVQuantError(f"{where}.{i} must be a positive finite number, got {value!r}")
        scales.append(float(value))
    return tuple(scales)


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """cache [slots, Hkv, D]: rows `slots` = x, quantized with `scale` for an FP8 cache. Bytes go
    through a uint8 view: index_copy_ has no FP8 kernel on every device."""
    if not is_fp8_cache(cache):
        cache.index_copy_(0, slots, x.to(cache.dtype))
        return
    codes = quantize(x, scale)
    cache.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))


def fp8_kv_backend(resolved: str, backend_cls: type) -> str:
    """The attention backend for an FP8 cache when none was asked for: the default one if it reads FP8
    KV (class attribute supports_fp8_kv), else the torch backend, which does."""
    if getattr(backend_cls, "supports_fp8_kv", False):
        return resolved
    logger.warning(
        "the %s attention backend does not read an FP8 KV cache yet: using the torch backend "
        "(no CUDA graphs); docs/quantization.md lists what the backend needs",
        resolved,
    )
    return "torch"
