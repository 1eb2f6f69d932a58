"""A random EAGLE-3 head written in the published layout (config.json + model.safetensors with `fc`,
`midlayer.*`, `norm`, `lm_head` over a draft vocabulary, and the `d2t` / `t2d` maps) for a target model
directory built by tests.support.model_factory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.model_factory import read_config


def build_eagle3_head(target_dir: Path, out_dir: Path, draft_vocab: int = 40, seed: int = 0,
                      scale: float = 0.5) -> Path:
    """The head's hidden and heads follow the target's (as the published heads do); `scale` is the
    weights' spread (large, so that the random head's drafts vary)."""
    target = read_config(target_dir)
    hidden, heads, kv = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = target.get("head_dim") or hidden // heads
    inter, vocab = target["intermediate_size"], target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "num_hidden_layers": 1,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "torch_dtype": "float32",
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale / shape[-1] ** 0.5).contiguous()

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden, generator=gen)

    hot = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values  # draft id -> target id
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": norm(),
        "lm_head.weight": w(draft_vocab, hidden) * 4,
        "d2t": (hot - torch.arange(draft_vocab)).to(torch.int64),
        "t2d": t2d,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"))
    return out
