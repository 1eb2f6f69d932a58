"""Model families against transformers: prefill logits, RoPE variants, the registry."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.kv_cache import KVCache
from app.worker.layers import Rope, RotaryEmbedding
from app.worker.layers.rotary import RopeSpec, inverse_frequencies, rope_spec_from_config
from app.worker.loader import load_hf_config, load_weights
from app.worker.models import SUPPORTED_ARCHITECTURES, UnsupportedModelError, model_class_for
from app.worker.models.dense import DenseCausalLM
from tests.support.model_factory import build_tiny_model

BLOCK = 4


def load_ours(model_dir: Path, max_positions: int = 512) -> DenseCausalLM:
    config = load_hf_config(model_dir)
    model = model_class_for(config)(config, torch.float32, max_positions)
    load_weights(model, model_dir, "auto")
    return model.eval()


def prefill_logits(model: DenseCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All-position logits of each prompt, the prompts run together as one flat varlen batch."""
    lengths = [len(p) for p in prompts]
    blocks = [math.ceil(n / BLOCK) for n in lengths]
    cache = KVCache(model.kv_cache_spec(torch.float32), sum(blocks), BLOCK, torch.device("cpu"))
    backend = make_attention_backend(None, cache, model.attention_spec)
    width, first, rows = max(blocks), 0, []
    for count in reversed(blocks):  # blocks handed out back to front
        rows.insert(0, list(range(first, first + count)) + [0] * (width - count))
        first += count
    batch = build_attention_batch(torch.tensor(rows, dtype=torch.int32), lengths, lengths, BLOCK)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, batch.positions, backend.plan(batch)))
    return list(logits.split(lengths))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_prefill_logits_match_transformers(arch: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(arch, tmp_path, seed=1)
    ours = load_ours(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = reference.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 17, 30)]
    for prompt, logits in zip(prompts, prefill_logits(ours, prompts), strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_tied_embeddings_share_one_parameter(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    ours = load_ours(model_dir)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(1, 12))
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, [prompt])[0], expected, atol=1e-4, rtol=0)


def test_llama_biases_follow_the_config(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, attention_bias=True, mlp_bias=True)
    ours = load_ours(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    attn = ours.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    prompt = [5, 9, 2, 7, 7, 1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, [prompt])[0], expected, atol=1e-4, rtol=0)


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
}


@pytest.mark.parametrize("name", sorted(ROPE_CASES))
def test_rope_frequencies_match_transformers(name: str) -> None:
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
        rope_parameters=dict(ROPE_CASES[name]),
    )  # fmt: skip
    spec = rope_spec_from_config(config, 16)
    assert spec.rope_type == name
    ours, our_scale = inverse_frequencies(spec)
    init = ROPE_INIT_FUNCTIONS.get(name) or LlamaRotaryEmbedding.compute_default_rope_parameters
    expected, scale = init(config, device=torch.device("cpu"))
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)
    assert our_scale == pytest.approx(scale)


def test_rope_spellings_parse_alike() -> None:
    legacy = SimpleNamespace(
        rope_theta=250000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=64,
    )
    spec = rope_spec_from_config(legacy, 8)
    assert (spec.theta, spec.rope_type, spec.params) == (250000.0, "linear", {"factor": 2.0})
    bare = rope_spec_from_config(SimpleNamespace(rope_theta=1e6, max_position_embeddings=64), 8)
    assert (bare.theta, bare.rope_type) == (1e6, "default")
    modern = SimpleNamespace(
        rope_parameters={"rope_type": "default", "rope_theta": 3.0}, max_position_embeddings=8
    )
    assert rope_spec_from_config(modern, 8).theta == 3.0


def test_unsupported_rope_is_refused_by_name() -> None:
    config = SimpleNamespace(
        rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}, max_position_embeddings=8
    )
    with pytest.raises(ValueError, match="longrope.*supported: default, linear, llama3, yarn"):
        rope_spec_from_config(config, 8)
    with pytest.raises(ValueError, match="partial"):
        rope_spec_from_config(
            SimpleNamespace(rope_theta=1.0, partial_rotary_factor=0.5, max_position_embeddings=8), 8
        )


def test_rotary_table_applies_attention_scaling() -> None:
    spec = RopeSpec(
        head_dim=8, theta=10000.0, rope_type="yarn", params={"factor": 4.0}, max_position_embeddings=64
    )
    rope = RotaryEmbedding(spec, 16)
    _, scale = inverse_frequencies(spec)
    assert scale > 1.0
    torch.testing.assert_close(rope.cos[0], torch.full((4,), scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """The CPU's rotation (one roll against [-sin, sin]) rounds as transformers' rotate_half form does."""
    spec = RopeSpec(head_dim=64, theta=10000.0, max_position_embeddings=512)
    rotary = RotaryEmbedding(spec, 512)
    positions = torch.tensor([0, 3, 130, 511])
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 9, 64, generator=gen).to(dtype)
    k = torch.randn(4, 3, 64, generator=gen).to(dtype)
    rope = Rope(rotary, positions, dtype)
    got_q, got_k = rope.apply(q, k)
    half_cos = rotary.cos.index_select(0, positions).to(dtype)
    half_sin = rotary.sin.index_select(0, positions).to(dtype)
    cos, sin = torch.cat((half_cos, half_cos), -1), torch.cat((half_sin, half_sin), -1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_unknown_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        model_class_for(SimpleNamespace(architectures=["GPT2LMHeadModel"]))
    assert "GPT2LMHeadModel" in str(err.value)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(err.value) and arch in SUPPORTED_ARCHITECTURES
    with pytest.raises(UnsupportedModelError, match="no architectures"):
        model_class_for(SimpleNamespace(architectures=None))


def test_sliding_window_is_refused_beyond_the_window(tmp_path: Path) -> None:
    model_dir = build_tiny_model("mistral", tmp_path, sliding_window=64)
    config = load_hf_config(model_dir)
    with pytest.raises(ValueError, match="sliding-window"):
        model_class_for(config)(config, torch.float32, 128)
    model_class_for(config)(config, torch.float32, 64)  # within the window: plain attention is exact


def test_other_activations_are_refused(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, hidden_act="gelu")
    config = load_hf_config(model_dir)
    with pytest.raises(ValueError, match="gelu"):
        model_class_for(config)(config, torch.float32, 64)
