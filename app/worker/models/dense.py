"""The dense decoder-only transformer that Llama, Mistral, Qwen2 and Qwen3 share.

Families differ only in a few switches (DenseOptions): biases on the projections and per-head
q/k RMSNorm. Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up
are fused (qkv_proj, gate_up_proj); `checkpoint_target` maps checkpoint names onto them.

Forward works on a flat batch of T tokens from any number of sequences (varlen): the attention
metadata says which tokens belong to which sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from app.worker.attention import AttentionMetadata, AttentionSpec
from app.worker.kv_cache import KVCacheSpec
from app.worker.layers import (
    GateUpLinear,
    LMHead,
    QKVLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    rope_spec_from_config,
)
from app.worker.layers.linear import RowParallelLinear, local_kv_heads
from app.worker.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from app.worker.quantization import Fp8LinearMethod
    from app.worker.quantization.fp8 import Fp8Rows


@dataclass(frozen=True)
class DenseOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    quant: Fp8LinearMethod | None = None  # FP8 decoder linears (embeddings and LM head stay unquantized)
    tp: TensorParallel = SINGLE  # this rank's tensor-parallel group: heads, MLP rows and vocab are split
    # Layer index -> that layer's MLP, where it is not DenseMLP (the MoE families: app/worker/models/moe.py).
    mlp: Callable[[int], nn.Module] | None = None


@dataclass(frozen=True)
class DenseDims:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    vocab_size: int
    eps: float

    @classmethod
    def from_config(cls, config: Any) -> DenseDims:
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size,
            eps=config.rms_norm_eps,
        )

    def check_tp(self, size: int) -> None:
        """Tensor parallelism splits the query heads and the MLP rows evenly; KV heads are split too, or
        replicated when fewer than the ranks."""
        problems = []
        if self.num_heads % size:
            problems.append(f"the {self.num_heads} attention heads")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            problems.append(f"the {self.num_kv_heads} KV heads (or be a multiple of them)")
        if self.intermediate % size:
            problems.append(f"the MLP's {self.intermediate} intermediate rows")
        if problems:
            raise ValueError(f"--tensor-parallel-size {size} must divide {' and '.join(problems)} of this model")

    def attention_spec(self, q_dtype: torch.dtype) -> AttentionSpec:
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, q_dtype=q_dtype)

    def kv_cache_spec(self, dtype: torch.dtype, num_layers: int | None = None) -> KVCacheSpec:
        """The paged cache of num_layers attention layers (default: all of them)."""
        layers = self.num_layers if num_layers is None else num_layers
        return KVCacheSpec(layers, self.num_kv_heads, self.head_dim, dtype)

    def local(self, tp: TensorParallel) -> DenseDims:
        """The dimensions one TP rank holds."""
        return replace(
            self,
            num_heads=self.num_heads // tp.size,
            num_kv_heads=local_kv_heads(self.num_kv_heads, tp)[1],
            intermediate=self.intermediate // tp.size,
        )


class DenseAttention(nn.Module):
    def __init__(self, dims: DenseDims, opts: DenseOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.dims = dims.local(opts.tp)
        self.qkv_proj = QKVLinear(
            dims.hidden, dims.num_heads, dims.num_kv_heads, dims.head_dim, opts.qkv_bias, dtype, opts.quant, opts.tp
        )
        self.o_proj = RowParallelLinear(
            dims.num_heads * dims.head_dim, dims.hidden, opts.o_bias, dtype, opts.quant, opts.tp
        )
        if opts.qk_norm:
            self.q_norm = RMSNorm(dims.head_dim, dims.eps, dtype)
            self.k_norm = RMSNorm(dims.head_dim, dims.eps, dtype)
        self.qk_norm = opts.qk_norm

    def forward(self, hidden: torch.Tensor | Fp8Rows, rope: Rope, attn: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        q, k, v = self.qkv_proj.forward_split(hidden)
        q = q.view(-1, d.num_heads, d.head_dim)
        k = k.view(-1, d.num_kv_heads, d.head_dim)
        v = v.view(-1, d.num_kv_heads, d.head_dim)
        if self.qk_norm:  # in the rotary launch on CUDA
            rope = rope.with_qk_norm(self.q_norm, self.k_norm)
        out = attn.backend.forward(self.layer_idx, q, k, v, attn, rope)
        return self.o_proj(out.reshape(-1, d.num_heads * d.head_dim))


class DenseMLP(nn.Module):
    def __init__(self, dims: DenseDims, opts: DenseOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(dims.hidden, dims.intermediate, opts.mlp_bias, dtype, opts.quant, opts.tp)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(dims.intermediate, dims.hidden, opts.mlp_bias, dtype, opts.quant, opts.tp)

    def takes_quantized_rows(self) -> bool:
        return self.gate_up_proj.takes_quantized_rows()

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # FP8: SiLU's output comes quantized
        return self.down_proj(self.act(gate_up, self.down_proj.takes_quantized_rows()))


class DenseDecoderLayer(nn.Module):
    def __init__(self, dims: DenseDims, opts: DenseOptions, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden, dims.eps, dtype)
        self.self_attn = DenseAttention(dims, opts, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(dims.hidden, dims.eps, dtype)
        self.mlp = opts.mlp(layer_idx) if opts.mlp is not None else DenseMLP(dims, opts, dtype)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: Rope, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous sublayer's output; residual: the residual stream before it (None at the
        first layer, whose input is the embedding). Returns this layer's MLP output and the stream
        before it. The adds are transformers' (in the activation dtype), each fused into the norm
        that follows it."""
        quantize = self.self_attn.qkv_proj.takes_quantized_rows()  # FP8: the norm's output comes quantized
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden, quantize)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual, quantize)
        attn_out = self.self_attn(normed, rope, attn)
        quantize = self.mlp.takes_quantized_rows()
        normed, residual = self.post_attention_layernorm.add_forward(attn_out, residual, quantize)
        return self.mlp(normed), residual


class DenseModel(nn.Module):
    def __init__(
        self, dims: DenseDims, opts: DenseOptions, rotary: RotaryEmbedding, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(dims.vocab_size, dims.hidden, dtype, opts.tp)
        self.layers = nn.ModuleList(DenseDecoderLayer(dims, opts, i, dtype) for i in range(dims.num_layers))
        self.norm = RMSNorm(dims.hidden, dims.eps, dtype)
        self.rotary = rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        capture: HiddenCapture | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = Rope(self.rotary, positions, hidden.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture.layers:
                capture.take(i, hidden, residual)
            hidden, residual = layer(hidden, residual, rope, attn)
        if capture is not None and len(self.layers) in capture.layers:
            capture.take(len(self.layers), hidden, residual)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)[0]


@dataclass
class HiddenCapture:
    """Asks a forward for the residual stream entering the given layers (index L: the last layer's output
    before the final norm), as EAGLE-3 heads read it; `states` maps each index to its [T, hidden]. The
    plain forward passes None and pays one comparison a layer."""

    layers: tuple[int, ...]
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self, index: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        # A sum, not a view: the fused norm of the next layer updates `residual` in place.
        self.states[index] = hidden if residual is None else hidden + residual

    def concatenated(self) -> torch.Tensor:
        """[T, len(layers) x hidden], the layers' states side by side (EAGLE-3's fc input)."""
        return torch.cat([self.states[i] for i in self.layers], dim=-1)


# (fused parameter infix, checkpoint infix, shard id)
STACKED_PARAMS: tuple[tuple[str, str, str], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)


class DenseCausalLM(nn.Module):
    """Base of every dense family; subclasses choose the DenseOptions from the config."""

    architectures: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def options(cls, config: Any) -> DenseOptions:
        raise NotImplementedError(f"{cls.__name__} must choose its DenseOptions")

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        max_positions: int,
        quant: Fp8LinearMethod | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        _check_supported(config, max_positions)
        self.dims = dims = DenseDims.from_config(config)
        dims.check_tp(tp.size)
        self.dtype = dtype
        rotary = RotaryEmbedding(rope_spec_from_config(config, dims.head_dim), max_positions)
        opts = self.with_mlp(config, replace(self.options(config), quant=quant, tp=tp), dtype)
        self.model = DenseModel(dims, opts, rotary, dtype)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(dims.vocab_size, dims.hidden, dtype, self.model.embed_tokens if tied else None, tp)
        self.local_dims = dims.local(tp)

    def with_mlp(self, config: Any, opts: DenseOptions, dtype: torch.dtype) -> DenseOptions:
        """The options with the MLP each layer gets (dense here; the MoE families override it)."""
        return opts

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.local_dims.attention_spec(self.dtype)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return self.local_dims.kv_cache_spec(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        capture: HiddenCapture | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; `capture` also collects the
        residual stream entering the layers it names (EAGLE-3)."""
        return self.model(input_ids, positions, attn, capture)

    def compute_logits(self, hidden_rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[B, hidden] (only the rows that sample) -> logits [B, vocab] in the model dtype (into out)."""
        return self.lm_head(hidden_rows, out)

    # ---- checkpoint name mapping, used by the loader

    def checkpoint_target(self, name: str) -> tuple[str, str | None]:
        """Checkpoint tensor name -> (parameter name, shard id or None for a whole parameter)."""
        for fused, part, shard in STACKED_PARAMS:
            if part in name:
                return name.replace(part, fused), shard
        return name, None

    def checkpoint_names(self, param_name: str) -> list[tuple[str, str | None]]:
        """The checkpoint tensors (name, shard id) that together fill one parameter."""
        parts = [
            (param_name.replace(fused, part), shard)
            for fused, part, shard in STACKED_PARAMS
            if fused in param_name
        ]
        return parts or [(param_name, None)]

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Tensors some checkpoints carry that this model derives instead."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return self.lm_head.tied and name == "lm_head.weight"


def _check_supported(config: Any, max_positions: int) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = window is not None and (not layer_types or "sliding_attention" in layer_types)
    if sliding and max_positions > window:
        raise ValueError(
            f"sliding-window attention (window {window}) is not supported; with --max-model-len <= {window} "
            f"full attention is identical, got max_model_len {max_positions}"
        )
