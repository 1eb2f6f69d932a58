"""Rotary position embedding (the rotate-half / NeoX layout Hugging Face Llama and Qwen use).

The config may spell RoPE three ways: transformers 5's `rope_parameters` dict (holding rope_theta),
the older `rope_scaling` dict next to a top-level `rope_theta`, or just `rope_theta`. All are parsed
into one RopeSpec. Scaling types: default, linear, llama3, yarn; others are refused by name.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from app.worker.layers.fused import kernel_module, use_fused
from app.worker.layers.norm import RMSNorm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    head_dim: int
    theta: float
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)  # the scaling parameters as the config gives them
    max_position_embeddings: int = 0


def rope_spec_from_config(config: Any, head_dim: int) -> RopeSpec:
    """Parse the RoPE settings of a Hugging Face config object (any of its spellings)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported by this build")
    theta = params.pop("rope_theta", None) or getattr(config, "rope_theta", None) or _DEFAULT_THETA
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = (
        params.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0
    )
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeSpec(head_dim, float(theta), rope_type, params, int(config.max_position_embeddings))


def inverse_frequencies(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    dim = spec.head_dim
    base_inv = 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    if spec.rope_type == "default":
        return base_inv, 1.0
    if spec.rope_type == "linear":
        return base_inv / float(spec.params["factor"]), 1.0
    if spec.rope_type == "llama3":
        return _llama3(base_inv, spec.params, spec.max_position_embeddings), 1.0
    return _yarn(spec)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any], max_pos: int) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings") or max_pos)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""
    p, dim, base = spec.params, spec.head_dim, spec.theta
    orig = int(p.get("original_max_position_embeddings") or spec.max_position_embeddings)
    factor = p.get("factor") or spec.max_position_embeddings / orig
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolate = 1 - torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention)


class RotaryEmbedding(nn.Module):
    """The cos/sin table of every position below max_positions, built once."""

    def __init__(self, spec: RopeSpec, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(spec)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        # float32 tables built on the CPU (like transformers), cast to the activation dtype at use;
        # they follow the model when it is moved to its device.
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[cos, cos] and [-sin, sin], [T, 1, D], for these positions, once per step and shared by every
        layer (the operands of `_rotate`)."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class Rope:
    """One step's rotary inputs, shared by every layer. On CUDA a fused kernel rotates q and k in
    place straight from the float32 tables; elsewhere the step's cos/sin rows are gathered once.
    A layer that normalises each head of q and k first (Qwen3) takes with_qk_norm's copy: the kernel
    applies the norms in the same launch."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary = rotary
        self.positions = positions
        self.cos_sin = None if use_fused(positions) else rotary.cos_sin(positions, dtype)
        self.qk_norms: tuple[RMSNorm, RMSNorm] | None = None

    def with_qk_norm(self, q_norm: RMSNorm, k_norm: RMSNorm) -> Rope:
        """This step's rope for a layer whose q and k heads go through these norms before the rotation."""
        if q_norm.eps != k_norm.eps:
            raise ValueError("the q and k norms must share one epsilon")
        rope = copy.copy(self)
        rope.qk_norms = (q_norm, k_norm)
        return rope

    def kernel_qk_norm(self) -> Any:
        """The norms as the fused kernel takes them (kernels/rotary.py QKNorm), None without."""
        if self.qk_norms is None:
            return None
        q_norm, k_norm = self.qk_norms
        return kernel_module("rotary").QKNorm(q_norm.weight, k_norm.weight, q_norm.eps)

    @property
    def fused(self) -> bool:
        """Whether the Triton kernels rotate (reading the float32 tables and the positions themselves)."""
        return self.cos_sin is None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused:
            kernel_module("rotary").rotary_inplace(
                q, k, self.rotary.cos, self.rotary.sin, self.positions, self.kernel_qk_norm()
            )
            return q, k
        if self.qk_norms is not None:
            q, k = self.qk_norms[0](q), self.qk_norms[1](k)
        return apply_rotary(q, k, *self.cos_sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated by their positions' [cos, cos] and [-sin, sin] (`cos_sin`)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # transformers' x * cos + rotate_half(x) * sin, rounding for rounding (x2 * -sin is -(x2 * sin)):
    # rotate_half(x) * sin is [x2, x1] * [-sin, sin], and the roll is one op where rotate_half is
    # three: on the CPU a decode step pays for each small op's dispatch.
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin
