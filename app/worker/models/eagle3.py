"""The EAGLE-3 draft head in its published layout (`LlamaForCausalLMEagle3`, e.g. the heads of the EAGLE
authors and SpecForge).

The head drafts from the target's features: `fc` maps the concatenated hidden states of three target
layers (3 x target hidden) onto its hidden size; one Llama decoder layer (`midlayer`) whose attention
reads [norm(embedding of the token); norm(hidden)] (2 x hidden) over the head's own one-layer paged
KV cache; the final norm; and an LM head over the draft vocabulary (`draft_vocab_size`, 32000 for the
Llama-3.1-8B head), whose ids map to the target's by `d2t` (target id = draft id + d2t[draft id]).
Later draft steps feed the head its own pre-norm output instead of the target's features (hidden wide:
no `fc`). The token embedding is the target's (SGLang and vLLM share it as well; a checkpoint's copy,
if any, is ignored), so the head holds no embedding of its own.

Position i of the head's cache holds token i + 1 with the target's feature of position i: the head
runs one token ahead of the target's positions, at the same RoPE positions.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from app.worker.attention import AttentionMetadata, AttentionSpec
from app.worker.kv_cache import KVCacheSpec
from app.worker.layers import (
    Linear,
    LMHead,
    QKVLinear,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    VocabEmbedding,
    rope_spec_from_config,
)
from app.worker.layers.linear import RowParallelLinear
from app.worker.models.dense import STACKED_PARAMS, DenseAttention, DenseDims, DenseMLP, DenseOptions

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
# Checkpoint tensors that are not parameters: the vocabulary maps (d2t is read, t2d is its inverse) and
# the embedding, which is the target's.
VOCAB_MAP_TENSORS = ("d2t", "t2d")
EMBEDDING_TENSOR = "embed_tokens.weight"


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose INPUT the head reads (the residual stream entering them): SGLang's and
    vLLM's choice for Llama, (2, L // 2, L - 3). `--eagle3-layers-to-capture` names layer ids whose
    OUTPUT is read, as SGLang's flag does: id i is input index i + 1."""
    return (2, num_layers // 2, num_layers - 3)


def capture_indices(layer_ids: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """Input indices (0..num_layers; num_layers is the last layer's output before the final norm) from
    --eagle3-layers-to-capture, or the default; a clear error for ids outside the target."""
    if layer_ids is None:
        indices = default_capture_layers(num_layers)
        if min(indices) < 0 or max(indices) > num_layers:
            raise ValueError(
                f"the target has {num_layers} layers, too few for EAGLE-3's default capture layers "
                f"{indices}; set --eagle3-layers-to-capture to three layer ids in [0, {num_layers - 1}]"
            )
        return indices
    if len(layer_ids) != 3:
        raise ValueError(f"--eagle3-layers-to-capture needs three layer ids (the head's fc reads three), got {layer_ids}")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--eagle3-layers-to-capture: layer ids {bad} are outside the target's [0, {num_layers - 1}]")
    return tuple(i + 1 for i in layer_ids)


class Eagle3Attention(DenseAttention):
    """Llama attention whose q/k/v read 2 x hidden (the token's and the feature's halves)."""

    def __init__(self, dims: DenseDims, opts: DenseOptions, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.layer_idx = 0  # the head's own cache has one layer
        self.dims = dims
        self.qkv_proj = QKVLinear(
            2 * dims.hidden, dims.num_heads, dims.num_kv_heads, dims.head_dim, opts.qkv_bias, dtype
        )
        self.o_proj = RowParallelLinear(dims.num_heads * dims.head_dim, dims.hidden, opts.o_bias, dtype)
        self.qk_norm = False


class Eagle3Layer(nn.Module):
    def __init__(self, dims: DenseDims, opts: DenseOptions, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden, dims.eps, dtype)  # on the token's embedding
        self.hidden_norm = RMSNorm(dims.hidden, dims.eps, dtype)  # on the feature
        self.self_attn = Eagle3Attention(dims, opts, dtype)
        self.post_attention_layernorm = RMSNorm(dims.hidden, dims.eps, dtype)
        self.mlp = DenseMLP(dims, opts, dtype)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Rope, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (MLP output, residual stream before it); the feature is the residual stream's start."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn_out = self.self_attn(x, rope, attn)
        # a copy: the fused add updates the residual in place, and the caller may still read `hidden`
        normed, residual = self.post_attention_layernorm.add_forward(attn_out, hidden.clone())
        return self.mlp(normed), residual


class Eagle3Head(nn.Module):
    """The head; `embedding` is the target's token embedding (shared, not a parameter here)."""

    architectures: ClassVar[tuple[str, ...]] = EAGLE3_ARCHITECTURES

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int, embedding: VocabEmbedding) -> None:
        super().__init__()
        archs = list(getattr(config, "architectures", None) or [])
        if archs[:1] != list(EAGLE3_ARCHITECTURES):
            raise ValueError(f"an EAGLE-3 head's config names architectures {EAGLE3_ARCHITECTURES}, not {archs}")
        layers = int(getattr(config, "num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"EAGLE-3 heads with {layers} decoder layers are not supported (only 1)")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"the EAGLE-3 head's hidden_act {act!r} is not supported (only silu)")
        self.dims = dims = DenseDims.from_config(config)
        self.dtype = dtype
        self.vocab_size = dims.vocab_size
        self.target_hidden = int(getattr(config, "target_hidden_size", None) or dims.hidden)
        if embedding.weight.shape[1] != dims.hidden or embedding.vocab_size != dims.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head (hidden {dims.hidden}, vocab {dims.vocab_size}) does not fit the target "
                f"(hidden {embedding.weight.shape[1]}, vocab {embedding.vocab_size})"
            )
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or dims.vocab_size)
        bias = bool(getattr(config, "attention_bias", False))
        opts = DenseOptions(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
        self.fc = Linear(3 * self.target_hidden, dims.hidden, bool(getattr(config, "bias", False)), dtype)
        self.midlayer = Eagle3Layer(dims, opts, dtype)
        self.norm = RMSNorm(dims.hidden, dims.eps, dtype)
        self.lm_head = LMHead(self.draft_vocab_size, dims.hidden, dtype, None)
        # draft id -> target id offsets; identity until a checkpoint's d2t is loaded
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(rope_spec_from_config(config, dims.head_dim), max_positions)
        self._embedding = (embedding,)  # a tuple: not a submodule, its weight stays the target's

    @property
    def embedding(self) -> VocabEmbedding:
        return self._embedding[0]

    @property
    def attention_spec(self) -> AttentionSpec:
        return self.dims.attention_spec(self.dtype)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return self.dims.kv_cache_spec(dtype, num_layers=1)  # its one decoder layer

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T]; hidden [T, 3 x target hidden] (the target's captured states) or
        [T, hidden] (the head's own pre-norm output of the step before) -> (normed [T, hidden] for the
        logits, pre-norm [T, hidden]: the next draft step's feature)."""
        embeds = self.embedding(input_ids)
        if hidden.shape[-1] == 3 * self.target_hidden:
            hidden = self.fc(hidden)
        rope = Rope(self.rotary, positions, embeds.dtype)
        out, residual = self.midlayer(embeds, hidden, rope, attn)
        return self.norm.add_forward(out, residual)

    def compute_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """[B, hidden] -> logits over the draft vocabulary [B, draft_vocab_size]."""
        return self.lm_head(hidden_rows)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ---- checkpoint name mapping, used by the loader (as DenseCausalLM's)

    def checkpoint_target(self, name: str) -> tuple[str, str | None]:
        for fused, part, shard in STACKED_PARAMS:
            if part in name:
                return name.replace(part, fused), shard
        return name, None

    def checkpoint_names(self, param_name: str) -> list[tuple[str, str | None]]:
        parts = [(param_name.replace(f, p), s) for f, p, s in STACKED_PARAMS if f in param_name]
        return parts or [(param_name, None)]

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")
