"""Which FP8 scheme a model runs with: from --quantization and the checkpoint's `quantization_config`.

The checkpoint's config.json decides when it has a `quantization_config` (the flag may repeat it;
a different flag is an error). Without one, `--quantization fp8` (or `w8a8_fp8`, SGLang's spelling of
the same thing) quantizes the floating-point checkpoint while loading.

Checkpoint formats read (docs/quantization.md has the tensor names and shapes):
- `fp8`: weight_block_size [b0, b1] with `weight_scale_inv` tile scales (Hugging Face fine-grained
  FP8, e.g. Qwen3-8B-FP8; dynamic activations only), or no block size with `weight_scale`
  (per-tensor or per-channel) and, for activation_scheme static, `input_scale`.
- `w8a8_fp8`: `weight_scale` per-tensor or per-channel; activation_scheme dynamic (default) or
  static with `input_scale`.
- `compressed-tensors`: format float-quantized, one config group targeting Linear, 8-bit float
  symmetric weights (strategy tensor, channel or block) and activations (dynamic token / tensor /
  group, or static tensor with `input_scale`).

At run time every quantized linear holds FP8 weights with one scale per output channel (per-tensor
scales are expanded exactly; block scales are requantized per channel at load) and quantizes its
input per token (dynamic) or with the checkpoint's per-tensor `input_scale` (static).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED = ("fp8", "w8a8_fp8", "compressed-tensors")
# Formats whose kernels need FP4/MX hardware: this build targets the H200 (Hopper, SM90).
BLACKWELL_ONLY = {
    "nvfp4": "NVFP4 needs NVIDIA Blackwell GPUs (B200/GB200, SM100 or newer) for its FP4 tensor cores",
    "mxfp4": "MXFP4 needs NVIDIA Blackwell GPUs (B200/GB200, SM100 or newer) for its MX tensor cores",
}
DENSE_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip


class QuantizationError(ValueError):
    """The quantization asked for (flag or checkpoint) cannot be run by this build."""


@dataclass(frozen=True)
class Fp8Scheme:
    """How quantized linears load and run.

    serialized: the checkpoint holds FP8 weights (else float weights are quantized while loading).
    block: tile size of block scales in the checkpoint (None: per-tensor or per-channel scales,
    told apart by the shape of each scale tensor). scale_name: the checkpoint's weight-scale tensor.
    static_activations: inputs are quantized with the checkpoint's per-tensor `input_scale`
    (else dynamically, per token).
    """

    method: str
    serialized: bool
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_activations: bool = False

    def describe(self) -> str:
        if not self.serialized:
            weights = "quantized at load, per-channel"
        elif self.block is not None:
            weights = f"checkpoint FP8, {self.block[0]}x{self.block[1]} blocks requantized per-channel"
        else:
            weights = "checkpoint FP8, per-tensor or per-channel scales"
        acts = "static per-tensor" if self.static_activations else "dynamic per-token"
        return f"{self.method} (e4m3 weights: {weights}; activations: {acts})"


def resolve_quantization(flag: str | None, hf_config: Any) -> Fp8Scheme | None:
    """The scheme in effect, or None for an unquantized model; QuantizationError when it cannot run."""
    if flag in BLACKWELL_ONLY:
        raise QuantizationError(
            f"--quantization {flag} is not supported on this build: {BLACKWELL_ONLY[flag]}"
        )
    if flag is not None and flag not in SUPPORTED:
        raise QuantizationError(
            f"--quantization {flag!r} is not supported; choose from {', '.join(SUPPORTED)}"
        )
    raw = getattr(hf_config, "quantization_config", None)
    if not raw:
        return _quantize_at_load(flag)
    qc = raw if isinstance(raw, Mapping) else raw.to_dict()
    method = _checkpoint_method(qc)
    if flag is not None and flag != method:
        raise QuantizationError(
            f"--quantization {flag} does not match the checkpoint, which is quantized with {method} "
            "(config.json quantization_config.quant_method); drop the flag or set it to " + method
        )
    linears = [
        f"model.layers.{i}.{name}" for i in range(hf_config.num_hidden_layers) for name in DENSE_LINEARS
    ]
    if method == "compressed-tensors":
        return _compressed_tensors(qc, linears)
    return _fp8_family(method, qc, linears)


def _quantize_at_load(flag: str | None) -> Fp8Scheme | None:
    if flag is None:
        return None
    if flag == "compressed-tensors":
        raise QuantizationError(
            "--quantization compressed-tensors needs a checkpoint in that format (config.json "
            "quantization_config); this checkpoint is not quantized: use --quantization fp8 to quantize it "
            "while loading"
        )
    return Fp8Scheme(method=flag, serialized=False)


def _checkpoint_method(qc: Mapping[str, Any]) -> str:
    method = str(qc.get("quant_method", "")).lower()
    algo = str(qc.get("quant_algo", "")).lower()
    if method in BLACKWELL_ONLY or algo in BLACKWELL_ONLY:
        name = method if method in BLACKWELL_ONLY else algo
        raise QuantizationError(f"the checkpoint is quantized with {name}: {BLACKWELL_ONLY[name]}")
    if method not in SUPPORTED:
        raise QuantizationError(
            f"the checkpoint is quantized with {method or 'an unnamed method'} (config.json "
            f"quantization_config); this build reads {', '.join(SUPPORTED)}"
        )
    return method


def _excluded(pattern: str, module: str) -> bool:
    """Does an ignore-list entry name this module? Exact, a parent, a dotted suffix, or `re:` regex."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern)


def _check_no_exclusions(patterns: list[str], linears: list[str], key: str) -> None:
    """Embeddings and the LM head always stay in the model dtype; excluding a decoder linear (keeping
    it unquantized in an FP8 checkpoint) is not built."""
    for pattern in patterns:
        hit = next((m for m in linears if _excluded(pattern, m)), None)
        if hit is not None:
            raise QuantizationError(
                f"quantization_config.{key} entry {pattern!r} keeps {hit} unquantized; mixing quantized and "
                "unquantized decoder linears is not supported"
            )


def _fp8_family(method: str, qc: Mapping[str, Any], linears: list[str]) -> Fp8Scheme:
    """Hugging Face / vLLM `fp8` and SGLang `w8a8_fp8` checkpoints."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"FP8 format {fmt!r} is not supported (only e4m3)")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"activation_scheme {scheme!r} is not supported (dynamic or static)")
    if str(qc.get("scale_fmt", "float")) != "float":
        raise QuantizationError(f"scale_fmt {qc['scale_fmt']!r} is not supported (only float32 scales)")
    for key in ("modules_to_not_convert", "ignored_layers"):
        _check_no_exclusions(list(qc.get(key) or []), linears, key)
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Scheme(method, serialized=True, static_activations=scheme == "static")
    if method != "fp8":
        raise QuantizationError(f"{method} checkpoints with weight_block_size are not supported")
    if scheme != "dynamic":
        raise QuantizationError("block-scaled FP8 checkpoints need activation_scheme dynamic")
    return Fp8Scheme(method, serialized=True, block=_block(block), scale_name="weight_scale_inv")


def _block(value: Any) -> tuple[int, int]:
    if not (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise QuantizationError(f"weight block size {value!r} must be two positive integers")
    return int(value[0]), int(value[1])


def _float8(args: Mapping[str, Any] | None, what: str) -> Mapping[str, Any]:
    if not isinstance(args, Mapping):
        raise QuantizationError(f"compressed-tensors {what} must be quantized (8-bit float) in this build")
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise QuantizationError(
            f"compressed-tensors {what}: {args.get('num_bits')}-bit {args.get('type')} is not supported "
            "(only 8-bit float, FP8)"
        )
    if not args.get("symmetric", True):
        raise QuantizationError(f"compressed-tensors {what}: asymmetric quantization is not supported")
    return args


def _compressed_tensors(qc: Mapping[str, Any], linears: list[str]) -> Fp8Scheme:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported (only float-quantized)")
    if qc.get("kv_cache_scheme"):
        raise QuantizationError(
            "compressed-tensors kv_cache_scheme (KV scales in the checkpoint) is not supported; use "
            "--kv-cache-dtype fp8 with --quantization-param-path for an FP8 KV cache"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or "Linear" not in (groups[0].get("targets") or []):
        raise QuantizationError(
            "compressed-tensors checkpoints need exactly one config group targeting Linear"
        )
    _check_no_exclusions(list(qc.get("ignore") or []), linears, "ignore")
    if not any(_excluded(p, "lm_head") for p in qc.get("ignore") or []):
        raise QuantizationError(
            "compressed-tensors: a quantized lm_head is not supported (list it in ignore)"
        )
    weights = _float8(groups[0].get("weights"), "weights")
    acts = _float8(groups[0].get("input_activations"), "input_activations")
    if weights.get("dynamic"):
        raise QuantizationError("compressed-tensors: dynamic weight scales are not supported")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise QuantizationError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    static = not acts.get("dynamic", False)
    act_strategy = acts.get("strategy")
    if (static and act_strategy != "tensor") or act_strategy not in ("tensor", "token", "group"):
        kind = "static" if static else "dynamic"
        raise QuantizationError(
            f"compressed-tensors {kind} activation strategy {act_strategy!r} is not supported"
        )
    block = _block(weights.get("block_structure")) if strategy == "block" else None
    if block is not None and static:
        raise QuantizationError("compressed-tensors block-scaled weights need dynamic activations")
    return Fp8Scheme("compressed-tensors", serialized=True, block=block, static_activations=static)
