"""The MoE families (Qwen3-MoE, Mixtral, Qwen2-MoE) on the CPU against transformers on the same tiny random
fp32 checkpoints: prefill logits, greedy generation through the model runner, every expert exercised,
routing ties, the checkpoint layouts (sharded files, one tensor per expert, tensors missing), dummy and FP8
weights, and the tensor-parallel split of the experts (each rank's slices of every expert)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from app.worker.layers.moe import FusedExperts
from app.worker.loader import load_hf_config, load_weights
from app.worker.loader.weights import CheckpointError
from app.worker.model_runner import ModelRunner
from app.worker.models import model_class_for
from app.worker.parallel import TensorParallel
from app.worker.quantization import FP8_DTYPE
from app.worker.quantization.fp8 import REL_ERROR, SUBNORMAL_ERROR, dequantize, expand_block_scales
from tests.support.model_factory import build_tiny_model, write_fp8_checkpoint
from tests.unit.test_model_runner import (
    CPU,
    Request,
    ScriptedScheduler,
    hf_greedy,
    make_settings,
    prompts_for,
)
from tests.unit.test_models import load_ours, prefill_logits

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
LAYERS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(arch, root / arch, seed=7, num_hidden_layers=LAYERS) for arch in ARCHS}


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 17, 30)]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers_and_every_expert_is_used(arch: str, models: dict[str, Path]) -> None:
    ours = load_ours(models[arch])
    reference = AutoModelForCausalLM.from_pretrained(models[arch], dtype=torch.float32).eval()
    prompts = _prompts(reference.config.vocab_size)
    chosen: set[tuple[int, int]] = set()
    for i, layer in enumerate(ours.model.layers):
        experts = layer.mlp.experts
        forward = experts.forward

        def record(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, i: int = i,
                   forward=forward) -> torch.Tensor:  # noqa: ANN001
            chosen.update((i, e) for e in ids.unique().tolist())
            return forward(x, weights, ids)

        experts.forward = record
    for prompt, logits in zip(prompts, prefill_logits(ours, prompts), strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert chosen == {(i, e) for i in range(LAYERS) for e in range(4)}  # every expert of every layer ran


def test_dense_layers_between_sparse_ones(tmp_path: Path) -> None:
    """Qwen's mlp_only_layers and decoder_sparse_step: layer 0 dense (its MLP of intermediate_size),
    layer 1 dense by the step, layer 2 sparse."""
    model_dir = build_tiny_model("qwen3_moe", tmp_path, seed=5, mlp_only_layers=[0], decoder_sparse_step=3)
    ours = load_ours(model_dir)
    assert [type(layer.mlp).__name__ for layer in ours.model.layers] == ["DenseMLP", "DenseMLP", "SparseMoeBlock"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = _prompts(reference.config.vocab_size)[1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, [prompt])[0], expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_matches_transformers_generate(arch: str, models: dict[str, Path]) -> None:
    runner = ModelRunner(make_settings(models[arch]), CPU)
    runner.warmup()
    prompts = prompts_for(runner.vocab_size, [5, 23, 12], seed=1)  # 23 tokens: two prefill chunks
    sched = ScriptedScheduler(runner)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=16, join_step=2 * i))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_greedy(models[arch], prompt, 16), f"r{i}"


def test_routing_ties_between_identical_experts_change_nothing(models: dict[str, Path], tmp_path: Path) -> None:
    """Experts 1 and 2 made identical (weights and router rows): every token that wants one ties between
    them. Either pick computes the same, so the logits still equal transformers'."""
    src = models["qwen3_moe"]
    out = tmp_path / "tied"
    out.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (out / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name in list(tensors):
        if ".experts.2." in name:
            tensors[name] = tensors[name.replace(".experts.2.", ".experts.1.")].clone()
        if name.endswith("mlp.gate.weight"):
            tensors[name][2] = tensors[name][1]
    save_file(tensors, str(out / "model.safetensors"))
    ours = load_ours(out)
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = _prompts(reference.config.vocab_size)[2]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, [prompt])[0], expected, atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_like_one_file(models: dict[str, Path], tmp_path: Path) -> None:
    sharded = build_tiny_model("mixtral", tmp_path, seed=7, num_hidden_layers=LAYERS, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    one, many = load_ours(models["mixtral"]), load_ours(sharded)
    for (name, a), b in zip(one.state_dict().items(), many.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_missing_expert_tensor_is_named(models: dict[str, Path], tmp_path: Path) -> None:
    src = models["qwen3_moe"]
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: model\.layers\.1\.mlp\.experts\.3\.up"):
        load_ours(tmp_path)


def test_each_tp_rank_holds_its_slice_of_every_expert(models: dict[str, Path]) -> None:
    model_dir = models["qwen3_moe"]
    config = load_hf_config(model_dir)
    full = load_file(str(model_dir / "model.safetensors"))
    inter = config.moe_intermediate_size
    for rank in range(2):
        model = model_class_for(config)(config, torch.float32, 64, tp=TensorParallel(rank, 2))
        load_weights(model, model_dir, "auto")
        experts = model.model.layers[1].mlp.experts
        assert isinstance(experts, FusedExperts)
        rows = slice(rank * inter // 2, (rank + 1) * inter // 2)
        for e in range(4):
            prefix = f"model.layers.1.mlp.experts.{e}."
            want13 = torch.cat([full[prefix + "gate_proj.weight"][rows], full[prefix + "up_proj.weight"][rows]])
            assert torch.equal(experts.w13_weight[e], want13)
            assert torch.equal(experts.w2_weight[e], full[prefix + "down_proj.weight"][:, rows])


def test_fp8_experts_quantized_at_load_hold_each_expert_per_channel(models: dict[str, Path]) -> None:
    """Every expert's gate, up and down dequantize to the checkpoint's within one e4m3 rounding, so the
    codes and scales landed in their places; the model runs (its logits near the float model's: random
    tiny models amplify rounding, and FP8 attention quantizes activations too)."""
    model_dir = models["qwen3_moe"]
    float_runner = ModelRunner(make_settings(model_dir), CPU)
    fp8_runner = ModelRunner(make_settings(model_dir, quantization="fp8"), CPU)
    full = load_file(str(model_dir / "model.safetensors"))
    experts = fp8_runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE and experts.w13_scale.shape == (4, 96)
    w13 = experts.w13_weight.float() * experts.w13_scale[..., None]
    w2 = experts.w2_weight.float() * experts.w2_scale[..., None]
    for e in range(4):
        prefix = f"model.layers.1.mlp.experts.{e}."
        for got, name in ((w13[e, :48], "gate_proj"), (w13[e, 48:], "up_proj"), (w2[e], "down_proj")):
            want = full[prefix + name + ".weight"]
            bound = REL_ERROR * want.abs() + SUBNORMAL_ERROR * want.abs().amax(1, keepdim=True)
            assert ((got - want).abs() <= bound).all(), prefix + name
    prompt = prompts_for(float_runner.vocab_size, [20], seed=2)
    want, got = (prefill_logits(r.model, prompt)[0] for r in (float_runner, fp8_runner))
    assert float((got - want).norm() / want.norm()) < 0.5


def test_block_scaled_fp8_checkpoint_experts_are_requantized_per_channel(models: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """Qwen3-30B-A3B-FP8's layout (128x128 tile scales, `weight_scale_inv`, one tensor per expert): each
    expert ends per channel within one more e4m3 rounding of the checkpoint's block-scaled values."""
    ckpt = write_fp8_checkpoint(models["qwen3_moe"], tmp_path, "fp8-block")
    runner = ModelRunner(make_settings(ckpt), CPU)
    full = load_file(str(ckpt / "model.safetensors"))
    experts = runner.model.model.layers[0].mlp.experts
    assert not hasattr(experts, "w13_tile_scale")  # dropped once requantized
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}."
        got13 = experts.w13_weight[e].float() * experts.w13_scale[e, :, None]
        for got, name in ((got13[:48], "gate_proj"), (got13[48:], "up_proj"),
                          (experts.w2_weight[e].float() * experts.w2_scale[e, :, None], "down_proj")):  # fmt: skip
            codes = full[prefix + name + ".weight"]
            want = dequantize(codes, expand_block_scales(full[prefix + name + ".weight_scale_inv"], *codes.shape,
                                                         (128, 128)))  # fmt: skip
            bound = REL_ERROR * want.abs() + SUBNORMAL_ERROR * want.abs().amax(1, keepdim=True)
            assert ((got - want).abs() <= bound).all(), prefix + name
    logits = prefill_logits(runner.model, prompts_for(runner.vocab_size, [9]))[0]
    assert torch.isfinite(logits).all()


def test_fp8_expert_checkpoints_with_channel_scales_are_refused(models: dict[str, Path], tmp_path: Path) -> None:
    ckpt = write_fp8_checkpoint(models["qwen3_moe"], tmp_path, "fp8-channel")
    with pytest.raises(ValueError, match="FP8 expert checkpoints with per-tensor or per-channel scales are not"):
        ModelRunner(make_settings(ckpt), CPU)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_weights(models: dict[str, Path], quantization: str | None) -> None:
    runner = ModelRunner(make_settings(models["qwen3_moe"], load_format="dummy", quantization=quantization), CPU)
    experts = runner.model.model.layers[0].mlp.experts
    values = experts.w13_weight.float() * (experts.w13_scale[..., None] if quantization else 1)
    assert 0 < float(values.abs().max()) <= 1e-3 * 1.01
    logits = prefill_logits(runner.model, prompts_for(runner.vocab_size, [6]))[0]
    assert torch.isfinite(logits).all()


def test_tp2_greedy_outputs_match_one_process(models: dict[str, Path]) -> None:
    """Two gloo ranks in real processes (the worker's follow loop on rank 1) against one process."""
    from tests.unit.test_tensor_parallel import run_group

    model_dir = models["qwen3_moe"]
    single = ModelRunner(make_settings(model_dir), CPU)
    single.warmup()
    prompts = prompts_for(single.vocab_size, [5, 23], seed=4)
    sched = ScriptedScheduler(single)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=10, join_step=2 * i))
    expected = sched.run()
    results = run_group(model_dir, 2, prompts, check_shards=False)
    for rank, (wrong, outputs) in results.items():
        assert wrong == [], f"rank {rank}: {wrong} {outputs if wrong == ['error'] else ''}"
    assert results[0][1] == expected


def test_weight_updates_fill_experts(models: dict[str, Path]) -> None:
    """update_weights_from_tensor (RL) names experts as checkpoints do; a misshapen one is refused."""
    from app.worker.loader.updates import UpdateError, update_from_tensors

    model = load_ours(models["qwen3_moe"])
    new_up = torch.full((48, 64), 0.25)
    new_down = torch.full((64, 48), -0.5)
    update_from_tensors(model, [("model.layers.1.mlp.experts.2.up_proj.weight", new_up),
                                ("model.layers.1.mlp.experts.3.down_proj.weight", new_down)])  # fmt: skip
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.w13_weight[2, 48:], new_up) and torch.equal(experts.w2_weight[3], new_down)
    with pytest.raises(UpdateError, match=r"experts\.0\.gate_proj\.weight has shape \[3, 64\]"):
        update_from_tensors(model, [("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 64))])
