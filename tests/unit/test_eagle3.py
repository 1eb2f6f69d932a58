"""The EAGLE-3 head: a random head in the published layout loads, and its forward (an extend over the
target's captured states, then a draft step on its own feature, through its paged cache) matches a
plain-torch reference; the target's hidden-state capture matches transformers' hidden states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from app.worker.attention import build_attention_batch, make_attention_backend
from app.worker.kv_cache import KVCache
from app.worker.loader import CheckpointError, load_hf_config, load_weights
from app.worker.loader.eagle3 import load_eagle3_weights
from app.worker.models import model_class_for
from app.worker.models.dense import HiddenCapture
from app.worker.models.eagle3 import Eagle3Head, capture_indices, default_capture_layers
from tests.support.eagle3_factory import build_eagle3_head
from tests.support.model_factory import build_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    target = build_tiny_model("llama", root / "target", seed=3, num_hidden_layers=4)
    return target, build_eagle3_head(target, root / "head", draft_vocab=40, seed=5)


def load_target(target_dir: Path):  # noqa: ANN201
    config = load_hf_config(target_dir)
    model = model_class_for(config)(config, torch.float32, 512)
    load_weights(model, target_dir, "auto")
    return model.eval()


def load_head(head_dir: Path, target) -> Eagle3Head:  # noqa: ANN001
    head = Eagle3Head(load_hf_config(head_dir), torch.float32, 512, target.model.embed_tokens)
    load_eagle3_weights(head, head_dir, "auto")
    return head.eval()


# ---------------------------------------------------------------- the plain-torch reference


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [T, H, D] rotated (rotate-half layout) at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference(t: dict[str, torch.Tensor], embed: torch.Tensor, ids: torch.Tensor, feats: list[torch.Tensor],
              heads: int, kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence from position 0: row i reads token ids[i] and feats[i] (3h: through fc; h: as is).
    -> (target ids of the draft argmax, draft logits, pre-norm outputs), all rows."""
    hidden = torch.stack([f @ t["fc.weight"].T if f.shape[-1] != embed.shape[1] else f for f in feats])
    m = "midlayer."
    x = torch.cat([rms(embed[ids], t[m + "input_layernorm.weight"]), rms(hidden, t[m + "hidden_norm.weight"])], -1)
    n, d = len(ids), t[m + "self_attn.q_proj.weight"].shape[0] // heads
    pos = torch.arange(n)
    q = rope((x @ t[m + "self_attn.q_proj.weight"].T).view(n, heads, d), pos)
    k = rope((x @ t[m + "self_attn.k_proj.weight"].T).view(n, kv, d), pos)
    v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    h1 = att.transpose(0, 1).reshape(n, -1) @ t[m + "self_attn.o_proj.weight"].T + hidden
    y = rms(h1, t[m + "post_attention_layernorm.weight"])
    mlp = (F.silu(y @ t[m + "mlp.gate_proj.weight"].T) * (y @ t[m + "mlp.up_proj.weight"].T)) @ t[
        m + "mlp.down_proj.weight"].T  # fmt: skip
    prenorm = mlp + h1
    logits = rms(prenorm, t["norm.weight"]) @ t["lm_head.weight"].T
    draft = logits.argmax(-1)
    return draft + t["d2t"][draft], logits, prenorm


# ---------------------------------------------------------------- tests


def test_head_forward_matches_reference(dirs: tuple[Path, Path]) -> None:
    target_dir, head_dir = dirs
    target = load_target(target_dir)
    head = load_head(head_dir, target)
    tensors = load_file(str(head_dir / "model.safetensors"))
    embed = target.model.embed_tokens.weight.detach()
    dims = head.dims
    gen = torch.Generator().manual_seed(0)
    n = 9
    ids = torch.randint(0, dims.vocab_size, (n + 1,), generator=gen)
    feats = torch.randn(n, 3 * dims.hidden, generator=gen)

    cache = KVCache(head.kv_cache_spec(torch.float32), 4, BLOCK, torch.device("cpu"))
    backend = make_attention_backend(None, cache, head.attention_spec)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)  # blocks out of order: the paging is exercised
    with torch.no_grad():
        batch = build_attention_batch(table, [n], [n], BLOCK)
        normed, prenorm = head(ids[:n], batch.positions, feats, backend.plan(batch))  # the extend
        logits = head.compute_logits(normed)
        step = build_attention_batch(table, [1], [n + 1], BLOCK)  # a draft step on its own feature
        normed2, prenorm2 = head(ids[n:], step.positions, prenorm[-1:], backend.plan(step))
        logits2 = head.compute_logits(normed2)

    want_ids, want_logits, want_prenorm = reference(
        tensors, embed, ids, [*feats, prenorm[-1]], dims.num_heads, dims.num_kv_heads
    )
    torch.testing.assert_close(torch.cat([logits, logits2]), want_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([prenorm, prenorm2]), want_prenorm, rtol=1e-4, atol=1e-4)
    got_ids = head.to_target_ids(torch.cat([logits, logits2]).argmax(-1))
    assert got_ids.tolist() == want_ids.tolist()
    assert set(got_ids.tolist()) <= set((torch.arange(40) + tensors["d2t"]).tolist())  # the hot vocabulary
    assert head.d2t.abs().sum() > 0  # the map was read, not left at identity


def test_capture_matches_transformers_hidden_states(dirs: tuple[Path, Path]) -> None:
    target_dir, _ = dirs
    ours = load_target(target_dir)
    ref = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.tensor([5, 17, 3, 88, 41, 9, 60])
    cache = KVCache(ours.kv_cache_spec(torch.float32), 2, BLOCK, torch.device("cpu"))
    backend = make_attention_backend(None, cache, ours.attention_spec)
    batch = build_attention_batch(torch.tensor([[1, 0]], dtype=torch.int32), [7], [7], BLOCK)
    capture = HiddenCapture(layers=(0, 2, 3))
    with torch.no_grad():
        ours(ids, batch.positions, backend.plan(batch), capture)
        states = ref(ids[None], output_hidden_states=True).hidden_states  # [i]: the input of layer i
    for i in (0, 2, 3):
        torch.testing.assert_close(capture.states[i], states[i][0], rtol=1e-4, atol=1e-4)
    assert capture.concatenated().shape == (7, 3 * ours.dims.hidden)


def test_capture_layers_follow_sglang() -> None:
    assert default_capture_layers(32) == (2, 16, 29)  # Llama-3.1-8B
    assert capture_indices(None, 32) == (2, 16, 29)
    assert capture_indices([1, 15, 28], 32) == (2, 16, 29)  # the flag names outputs: +1
    with pytest.raises(ValueError, match="outside the target"):
        capture_indices([1, 2, 32], 32)
    with pytest.raises(ValueError, match="three layer ids"):
        capture_indices([1, 2], 32)
    with pytest.raises(ValueError, match="too few"):
        capture_indices(None, 2)


def test_head_checkpoint_errors(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, head_dir = dirs
    target = load_target(target_dir)
    tensors = load_file(str(head_dir / "model.safetensors"))
    from safetensors.torch import save_file

    broken = tmp_path / "no_d2t"
    broken.mkdir()
    (broken / "config.json").write_text((head_dir / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no d2t"):
        load_head(broken, target)
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_head(broken, target)
