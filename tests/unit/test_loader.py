"""Weight formats, checkpoint/model mismatches, config overrides, dtype and length resolution."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from app.worker.loader import (
    DUMMY_SEED,
    CheckpointError,
    checkpoint_files,
    eos_token_ids,
    load_hf_config,
    load_weights,
    resolve_dtype,
    resolve_max_model_len,
    resolve_model_path,
)
from app.worker.models import model_class_for
from app.worker.models.dense import DenseCausalLM
from tests.support.model_factory import build_tiny_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def fresh_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> DenseCausalLM:
    config = load_hf_config(model_dir)
    return model_class_for(config)(config, dtype, 64)


def reference_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def assert_matches_reference(model: DenseCausalLM, ref: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor sits where the fused layout says."""
    params = dict(model.named_parameters())
    for name, tensor in ref.items():
        if model.ignores_checkpoint_tensor(name):
            continue
        param_name, shard = model.checkpoint_target(name)
        target = params[param_name].detach()
        if shard is not None:
            first, rows = params[param_name].shard_rows[shard]
            target = target[first : first + rows]
        torch.testing.assert_close(target.float(), tensor.float(), atol=0, rtol=0)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"), num_hidden_layers=2)


def test_single_safetensors_file(qwen2_dir: Path) -> None:
    assert checkpoint_files(qwen2_dir, "auto") == ("safetensors", [qwen2_dir / "model.safetensors"])
    model = fresh_model(qwen2_dir)
    assert load_weights(model, qwen2_dir, "safetensors") == "safetensors"
    assert_matches_reference(model, reference_weights(qwen2_dir))


def test_sharded_safetensors_with_index(tmp_path: Path) -> None:
    model_dir = build_tiny_model("qwen3", tmp_path, num_hidden_layers=2, max_shard_size="40KB")
    fmt, files = checkpoint_files(model_dir, "auto")
    assert fmt == "safetensors" and len(files) > 2
    assert (model_dir / "model.safetensors.index.json").is_file()
    model = fresh_model(model_dir)
    load_weights(model, model_dir, "auto")
    assert_matches_reference(model, reference_weights(model_dir))


def test_pt_weights_and_auto_fallback(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, num_hidden_layers=2, weights_format="pt")
    assert checkpoint_files(model_dir, "auto") == ("pt", [model_dir / "pytorch_model.bin"])
    model = fresh_model(model_dir, torch.bfloat16)
    assert load_weights(model, model_dir, "pt") == "pt"
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = torch.load(model_dir / "pytorch_model.bin", weights_only=True)
    assert_matches_reference(model, {k: v.to(torch.bfloat16) for k, v in ref.items()})
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        checkpoint_files(model_dir, "safetensors")


def test_dummy_weights_read_no_files_and_are_seeded(tmp_path: Path, qwen2_dir: Path) -> None:
    (tmp_path / "config.json").write_text((qwen2_dir / "config.json").read_text())  # no weights at all
    first, second = fresh_model(tmp_path), fresh_model(tmp_path)
    assert load_weights(first, tmp_path, "dummy") == "dummy"
    load_weights(second, tmp_path, "dummy")
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        assert torch.equal(a, b), name
        assert a.abs().max() <= 1e-3 and a.std() > 0, name
    gen = torch.Generator().manual_seed(DUMMY_SEED)
    expected = torch.empty_like(next(first.parameters())).uniform_(-1e-3, 1e-3, generator=gen)
    assert torch.equal(next(first.parameters()), expected)


def _rewrite_checkpoint(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, num_hidden_layers=2)
    _rewrite_checkpoint(model_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_weights(fresh_model(model_dir), model_dir, "auto")


def test_unexpected_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, num_hidden_layers=2)
    _rewrite_checkpoint(model_dir, lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.9\.mlp\.up_proj\.weight"):
        load_weights(fresh_model(model_dir), model_dir, "auto")
    _rewrite_checkpoint(model_dir, lambda t: t.pop("model.layers.9.mlp.up_proj.weight"))
    _rewrite_checkpoint(model_dir, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(3,\)"):
        load_weights(fresh_model(model_dir), model_dir, "auto")


def test_shard_listed_in_index_but_absent(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, num_hidden_layers=2, max_shard_size="40KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[0]
    (model_dir / victim).unlink()
    with pytest.raises(CheckpointError, match=victim):
        checkpoint_files(model_dir, "auto")


def test_unsupported_load_format() -> None:
    with pytest.raises(ValueError, match="npcache.*auto, safetensors, pt, dummy"):
        checkpoint_files(Path("."), "npcache")


def test_hf_overrides_apply_as_if_in_config_json(qwen2_dir: Path) -> None:
    overrides = {
        "max_position_embeddings": 128,
        "rope_parameters": {"rope_theta": 5000.0},
        "eos_token_id": [2, 7],
    }
    config = load_hf_config(qwen2_dir, overrides)
    assert config.max_position_embeddings == 128
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}  # merged, not replaced
    assert eos_token_ids(config, qwen2_dir) == [2, 7]
    assert load_hf_config(qwen2_dir).max_position_embeddings == 512
    with pytest.raises(TypeError, match="JSON object"):
        load_hf_config(qwen2_dir, "not a dict")  # type: ignore[arg-type]


def test_eos_ids_union_config_and_generation_config(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path, num_hidden_layers=2)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert eos_token_ids(load_hf_config(model_dir), model_dir) == [2, 1]


class _Cfg:
    def __init__(self, dtype: object = None, max_position_embeddings: int = 512) -> None:
        self.dtype = dtype
        self.max_position_embeddings = max_position_embeddings


@pytest.mark.parametrize(
    ("flag", "ckpt", "device", "expected"),
    [
        ("auto", "bfloat16", CPU, torch.float32),
        ("auto", "float16", CPU, torch.float32),
        ("auto", "float32", CUDA, torch.bfloat16),
        ("auto", "bfloat16", CUDA, torch.bfloat16),
        ("auto", "float16", CUDA, torch.float16),
        ("auto", torch.float16, CUDA, torch.float16),
        ("half", None, CPU, torch.float16),
        ("float16", None, CUDA, torch.float16),
        ("bfloat16", None, CPU, torch.bfloat16),
        ("float", None, CUDA, torch.float32),
        ("float32", None, CPU, torch.float32),
    ],
)
def test_dtype_resolution(flag: str, ckpt: object, device: torch.device, expected: torch.dtype, monkeypatch) -> None:
    from app.worker import cpu_host

    monkeypatch.setattr(cpu_host, "native_half", lambda dtype: False)  # an AVX2 host: auto is float32
    assert resolve_dtype(flag, _Cfg(ckpt), device) == expected


def test_cpu_auto_keeps_a_native_half_dtype(monkeypatch) -> None:
    from app.worker import cpu_host

    monkeypatch.setattr(cpu_host, "native_half", lambda dtype: dtype == torch.bfloat16)
    assert resolve_dtype("auto", _Cfg("bfloat16"), CPU) == torch.bfloat16
    assert resolve_dtype("auto", _Cfg("float16"), CPU) == torch.float32
    assert resolve_dtype("auto", _Cfg("float32"), CPU) == torch.float32


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float8"):
        resolve_dtype("float8", _Cfg(), CPU)


def test_max_model_len() -> None:
    assert resolve_max_model_len(None, _Cfg()) == 512
    assert resolve_max_model_len(100, _Cfg()) == 100
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        resolve_max_model_len(513, _Cfg())


def test_local_model_path(qwen2_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(qwen2_dir)) == qwen2_dir
    with pytest.raises(ValueError, match="--revision"):
        resolve_model_path(str(qwen2_dir), revision="main")
    with pytest.raises(ValueError, match="is a file"):
        resolve_model_path(str(qwen2_dir / "config.json"))
