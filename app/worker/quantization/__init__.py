"""FP8 weights (--quantization fp8 / w8a8_fp8 / compressed-tensors) and the FP8 KV cache
(--kv-cache-dtype fp8_e4m3). docs/quantization.md describes formats, numerics and error bounds."""

from app.worker.quantization.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize, quantize_rows
from app.worker.quantization.gemm import (
    EMULATED,
    SCALED_MM_ROWWISE,
    SCALED_MM_TENSORWISE,
    fp8_linear,
    gemm_backend,
)
from app.worker.quantization.kv import (
    KVCacheQuant,
    KVQuantError,
    fp8_kv_backend,
    resolve_kv_cache_quant,
    write_kv,
)
from app.worker.quantization.linear import Fp8LinearMethod, finish_loading, quantized_layers
from app.worker.quantization.scheme import Fp8Scheme, QuantizationError, resolve_quantization

__all__ = [
    "EMULATED",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALED_MM_ROWWISE",
    "SCALED_MM_TENSORWISE",
    "Fp8LinearMethod",
    "Fp8Scheme",
    "KVCacheQuant",
    "KVQuantError",
    "QuantizationError",
    "dequantize",
    "finish_loading",
    "fp8_kv_backend",
    "fp8_linear",
    "gemm_backend",
    "quantize",
    "quantize_rows",
    "quantized_layers",
    "resolve_kv_cache_quant",
    "resolve_quantization",
    "write_kv",
]
