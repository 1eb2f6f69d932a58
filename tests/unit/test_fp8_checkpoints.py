"""FP8 weights through ModelRunner on the CPU: quantization while loading and checkpoints written here in
each format (fp8 per-channel / per-tensor static / 128x128 block, w8a8_fp8, compressed-tensors static,
dynamic and block).

What is checked, per format:
- the run-time weights are what the checkpoint means: the same codes and scales for per-channel and
  per-tensor scales (expanded per row, exactly), and within one more e4m3 rounding of the block-scaled
  values for block checkpoints (which are requantized per channel at load);
- the quantized forward is exact: its logits equal (1e-4) those of a float model that holds the
  dequantized run-time weights and rounds each linear's input to FP8 as the runtime does;
- against the unquantized model the logits stay within the documented tolerance (docs/quantization.md):
  relative L2 error <= LOGITS_REL_TOL and argmax agreement >= ARGMAX_AGREEMENT. Random tiny models
  amplify any perturbation (near-tied logits), so these are loose; the exactness check above is
  what pins the numerics down. The tiny models here use initializer_range 0.1 (0.5 is chaotic enough
  that even a 2% weight perturbation moves logits by ~40%).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from app.worker.layers import Linear
from app.worker.loader import CheckpointError
from app.worker.model_runner import ModelRunner
from app.worker.quantization import FP8_DTYPE, QuantizationError, quantized_layers
from app.worker.quantization.fp8 import REL_ERROR, SUBNORMAL_ERROR, Fp8Rows
from tests.support.model_factory import (
    FP8_FORMATS,
    build_tiny_model,
    linear_input_amax,
    read_config,
    write_fp8_checkpoint,
)
from tests.support.numerics import relative_error
from tests.unit.test_model_runner import CPU, Request, ScriptedScheduler, make_settings, prompts_for
from tests.unit.test_models import prefill_logits

LOGITS_REL_TOL = 0.25
ARGMAX_AGREEMENT = 0.6
# Dimensions that are multiples of 128, so 128x128 tiles are whole (the default tiny dims make partial ones).
BLOCK_DIMS = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "intermediate_size": 384, "num_hidden_layers": 2}  # fmt: skip
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return {
        "llama": build_tiny_model("llama", root / "llama", seed=5, initializer_range=0.1),
        "qwen2": build_tiny_model("qwen2", root / "qwen2", seed=5, initializer_range=0.1),  # q/k/v biases
        "qwen3-128": build_tiny_model("qwen3", root / "qwen3", seed=5, initializer_range=0.1, **BLOCK_DIMS),
    }


def prompts(model_dir: Path) -> list[list[int]]:
    return prompts_for(read_config(model_dir)["vocab_size"], [9, 17, 30, 41], seed=1)


def runner_for(model_dir: Path, **overrides: Any) -> ModelRunner:
    return ModelRunner(make_settings(model_dir, max_total_tokens=1024, max_num_seqs=4, **overrides), CPU)


def checkpoint_weight(
    tensors: dict[str, torch.Tensor], module: str, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values the checkpoint means, per-element scale) for one linear of a written checkpoint."""
    codes = tensors[f"{module}.weight"]
    scale = tensors[f"{module}.weight_scale_inv" if fmt == "fp8-block" else f"{module}.weight_scale"].double()
    rows, cols = codes.shape
    if "block" in fmt:
        scale = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    elif scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(rows, cols)
    else:
        scale = scale.reshape(rows, 1).expand(rows, cols)
    return codes.double() * scale, scale


def runtime_weight(layer: nn.Module) -> torch.Tensor:
    return layer.weight.double() * layer.weight_scale.double().unsqueeze(1)


def shard_modules(name: str) -> list[str]:
    """The checkpoint modules a run-time linear is made of, in row order."""
    prefix, _, fused = name.rpartition(".")
    return [f"{prefix}.{part}" for part in FUSED.get(fused, (fused,))]


def check_runtime_matches_checkpoint(runner: ModelRunner, ckpt: Path, fmt: str) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    for name, layer in quantized_layers(runner.model):
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.weight.shape[0],)
        parts = [checkpoint_weight(tensors, module, fmt) for module in shard_modules(name)]
        expected = torch.cat([values for values, _ in parts])
        got = runtime_weight(layer)
        if "block" in fmt:  # one more rounding, on the row's grid
            bound = torch.maximum(
                REL_ERROR * expected.abs(), SUBNORMAL_ERROR * layer.weight_scale.double()[:, None]
            )
            assert bool(((got - expected).abs() <= bound * (1 + 1e-6)).all()), name
        else:
            assert torch.equal(got, expected), name
        if fmt.endswith("static"):
            shard_scales = [float(tensors[f"{module}.input_scale"]) for module in shard_modules(name)]
            assert float(layer.input_scale) == max(shard_scales)



def check_close_to_unquantized(runner: ModelRunner, float_runner: ModelRunner, model_dir: Path) -> None:
    want = torch.cat(prefill_logits(float_runner.model, prompts(model_dir)))
    got = torch.cat(prefill_logits(runner.model, prompts(model_dir)))
    assert relative_error(got, want) <= LOGITS_REL_TOL
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= ARGMAX_AGREEMENT


@pytest.fixture(scope="module")
def float_runners(models: dict[str, Path]) -> dict[str, ModelRunner]:
    return {name: runner_for(path) for name, path in models.items()}


# ---------------------------------------------------------------- quantization while loading


def test_quantize_at_load_stores_fp8_with_per_channel_scales(
    models: dict[str, Path], float_runners: dict[str, ModelRunner]
) -> None:
    model_dir = models["qwen2"]
    runner = runner_for(model_dir, quantization="fp8")
    floats = dict(float_runners["qwen2"].model.named_parameters())
    layers = list(quantized_layers(runner.model))
    assert len(layers) == 4 * 3  # qkv, o, gate_up, down per layer
    for name, layer in layers:
        weight = floats[f"{name}.weight"].double()
        scale = weight.abs().amax(dim=1).float() / 448
        assert torch.equal(layer.weight_scale, scale), name
        assert torch.equal(
            layer.weight.float(), (weight / scale.double()[:, None]).float().to(FP8_DTYPE).float()
        )
        assert layer.bias is None or layer.bias.dtype == torch.float32  # biases stay in the model dtype
    assert runner.model.lm_head.weight.dtype == torch.float32  # embeddings and LM head are not quantized
    info = runner.ready_message().info
    assert info.quantization.startswith("fp8 (e4m3 weights: quantized at load")
    check_close_to_unquantized(runner, float_runners["qwen2"], model_dir)


def test_fp8_weights_take_half_the_bytes_of_bf16(models: dict[str, Path]) -> None:
    model_dir = models["qwen3-128"]
    bf16 = runner_for(model_dir, dtype="bfloat16")
    fp8 = runner_for(model_dir, dtype="bfloat16", quantization="fp8")
    linear_values = sum(layer.weight.numel() for _, layer in quantized_layers(fp8.model))
    scales = sum(layer.weight_scale.numel() for _, layer in quantized_layers(fp8.model))
    assert bf16.weights_bytes - fp8.weights_bytes == linear_values * (2 - 1) - scales * 4
    for runner in (bf16, fp8):
        assert runner.ready_message().info.weights_gb == round(runner.weights_bytes / 1e9, 3)


# ---------------------------------------------------------------- checkpoints in each format


@pytest.fixture(scope="module")
def input_amax(models: dict[str, Path]) -> dict[str, dict[str, float]]:
    return {name: linear_input_amax(path, prompts(path)[:2]) for name, path in models.items()}


CASES = [(fmt, "llama") for fmt in FP8_FORMATS] + [
    ("fp8-block", "qwen3-128"), ("ct-block", "qwen3-128"),
    ("ct-tensor-static", "qwen2"), ("fp8-channel", "qwen2"),
]  # fmt: skip


@pytest.mark.parametrize(("fmt", "model"), CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_fp8_checkpoint_loads_and_stays_close(
    fmt: str,
    model: str,
    models: dict[str, Path],
    float_runners: dict[str, ModelRunner],
    input_amax: dict[str, dict[str, float]],
    tmp_path: Path,
) -> None:
    ckpt = write_fp8_checkpoint(models[model], tmp_path / fmt, fmt, input_amax[model])
    runner = runner_for(ckpt)  # the checkpoint's config.json says what it is
    method = read_config(ckpt)["quantization_config"]["quant_method"]
    assert runner.ready_message().info.quantization.startswith(f"{method} (e4m3 weights: checkpoint FP8")
    check_runtime_matches_checkpoint(runner, ckpt, fmt)
    check_close_to_unquantized(runner, float_runners[model], models[model])


def test_the_flag_may_repeat_the_checkpoint_and_must_not_contradict_it(
    models: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = write_fp8_checkpoint(models["llama"], tmp_path / "w8a8", "w8a8-channel")
    assert runner_for(ckpt, quantization="w8a8_fp8").quant_scheme.serialized
    with pytest.raises(QuantizationError, match="--quantization fp8 does not match the checkpoint"):
        runner_for(ckpt, quantization="fp8")


def test_a_fused_static_input_scale_is_the_largest_of_its_shards(
    models: dict[str, Path], input_amax: dict[str, dict[str, float]], tmp_path: Path
) -> None:
    ckpt = write_fp8_checkpoint(models["llama"], tmp_path / "s", "w8a8-tensor-static", input_amax["llama"])

    def widen_k(t: dict[str, torch.Tensor]) -> None:  # k_proj loads first (names are sorted), v_proj last
        t["model.layers.0.self_attn.k_proj.input_scale"] *= 3

    _rewrite(ckpt, widen_k)
    tensors = load_file(ckpt / "model.safetensors")
    layer = dict(quantized_layers(runner_for(ckpt).model))["model.layers.0.self_attn.qkv_proj"]
    assert float(layer.input_scale) == float(tensors["model.layers.0.self_attn.k_proj.input_scale"])


# ---------------------------------------------------------------- the forward, exactly


def _round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale


def dequantized_reference(runner: ModelRunner, reference: nn.Module) -> nn.Module:
    """`reference` (the float model) with the runner's dequantized weights, rounding each linear's input
    to FP8 as the runtime does (per token, or with the static input scale). The rounding wraps the
    instance's forward, which fused layers call directly (forward_split), so no hook is skipped."""
    modules = dict(reference.named_modules())
    for name, layer in quantized_layers(runner.model):
        target = modules[name]
        target.weight.data.copy_(runtime_weight(layer).float())
        static = getattr(layer, "input_scale", None)

        def rounded_forward(x: torch.Tensor, forward=target.forward, static=static) -> torch.Tensor:
            scale = static if static is not None else x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
            return forward(_round_trip(x, scale))

        target.forward = rounded_forward
    return reference


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "fp8-tensor-static"])
def test_quantized_forward_equals_the_dequantized_reference(
    fmt: str, models: dict[str, Path], input_amax: dict[str, dict[str, float]], tmp_path: Path
) -> None:
    model_dir = models["llama"]
    runner = runner_for(write_fp8_checkpoint(model_dir, tmp_path / fmt, fmt, input_amax["llama"]))
    reference = dequantized_reference(runner, runner_for(model_dir).model)
    got = torch.cat(prefill_logits(runner.model, prompts(model_dir)))
    want = torch.cat(prefill_logits(reference, prompts(model_dir)))
    assert relative_error(got, want) < 1e-4


def test_greedy_steps_agree_with_one_prefill(models: dict[str, Path], tmp_path: Path) -> None:
    """The step path (chunked prefill, batched decodes) on an FP8 block checkpoint picks the tokens a
    single prefill of prompt + output ranks first: FP8 activations are quantized per token, so a token's
    numbers do not depend on the batch it runs in."""
    runner = runner_for(write_fp8_checkpoint(models["qwen3-128"], tmp_path / "b", "fp8-block"))
    runner.warmup()
    sched = ScriptedScheduler(runner)
    prompts = prompts_for(runner.vocab_size, [5, 23], seed=3)
    for i, prompt in enumerate(prompts):
        sched.add(Request(f"r{i}", prompt, max_new=12, join_step=i))
    outputs = sched.run()
    for i, prompt in enumerate(prompts):
        logits = prefill_logits(runner.model, [prompt + outputs[f"r{i}"]])[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == outputs[f"r{i}"]


# ---------------------------------------------------------------- transformers reads the same weights


def test_block_checkpoint_agrees_with_transformers_dequantization(
    models: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    ckpt = write_fp8_checkpoint(models["qwen3-128"], tmp_path / "b", "fp8-block")
    hf = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    hf_weights = {name: p.double() for name, p in hf.named_parameters()}
    runner = runner_for(ckpt)
    for name, layer in quantized_layers(runner.model):
        expected = torch.cat([hf_weights[f"{module}.weight"] for module in shard_modules(name)])
        assert not torch.equal(expected, expected.to(FP8_DTYPE).double())  # really dequantized
        # One more e4m3 rounding, plus transformers' bf16 dequantization on the CPU (2^-8 relative).
        row_floor = SUBNORMAL_ERROR * layer.weight_scale.double()[:, None]
        bound = torch.maximum((REL_ERROR + 2.0**-8) * expected.abs(), row_floor) + 2.0**-8 * expected.abs()
        assert bool(((runtime_weight(layer) - expected).abs() <= bound).all()), name


# ---------------------------------------------------------------- errors and dummy weights


def _rewrite(ckpt: Path, change: Any) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    change(tensors)
    save_file(tensors, ckpt / "model.safetensors")


def test_broken_checkpoints_are_refused_with_the_tensor_named(
    models: dict[str, Path], tmp_path: Path
) -> None:
    def drop_scale(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.up_proj.weight_scale"]

    def float_weight(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].float()

    def zero_scale(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.self_attn.o_proj.weight_scale"].zero_()

    def bad_scale_shape(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(3)

    cases = {
        "missing from the checkpoint: model.layers.1.mlp.up_proj.weight_scale": drop_scale,
        "self_attn.k_proj.weight has dtype torch.float32; a fp8 checkpoint stores": float_weight,
        "layer model.layers.2.self_attn.o_proj: weight_scale has values that are not positive": zero_scale,
        r"down_proj.weight_scale has shape \(3,\); a weight scale is per-tensor": bad_scale_shape,
    }
    for i, (message, change) in enumerate(cases.items()):
        ckpt = write_fp8_checkpoint(models["llama"], tmp_path / str(i), "fp8-channel")
        _rewrite(ckpt, change)
        with pytest.raises(ValueError, match=message):
            runner_for(ckpt)


def test_fp8_tensors_without_a_quantization_config_are_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    ckpt = write_fp8_checkpoint(models["llama"], tmp_path / "c", "fp8-channel")
    config = read_config(ckpt)
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight is FP8 but the model holds it in torch.float32"):
        runner_for(ckpt)
    with pytest.raises(
        CheckpointError, match="is FP8, but the checkpoint's config.json has no quantization_config"
    ):
        runner_for(ckpt, quantization="fp8")


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-tensor-static"])
def test_dummy_weights_for_fp8_models(
    fmt: str, models: dict[str, Path], input_amax: dict[str, Any], tmp_path: Path
) -> None:
    """--load-format dummy with an FP8 config (benchmarks on real configs): FP8 weights, usable scales."""
    ckpt = write_fp8_checkpoint(models["qwen3-128"], tmp_path / fmt, fmt, input_amax["qwen3-128"])
    runner = runner_for(ckpt, load_format="dummy")
    for _, layer in quantized_layers(runner.model):
        assert layer.weight.dtype == FP8_DTYPE and not hasattr(layer, "weight_scale_inv")
        assert bool((layer.weight_scale > 0).all()) and float(runtime_weight(layer).abs().max()) <= 1e-3 * (
            1 + 1e-6
        )
    runner.warmup()


SMOLLM_DIR = os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR")


@pytest.mark.slow  # SmolLM2-135M
@pytest.mark.skipif(
    not SMOLLM_DIR or not Path(SMOLLM_DIR).is_dir(),
    reason="TOKENSPEED_DEFAULT_MODEL_DIR is not a prepared model",
)
def test_default_model_with_fp8_weights_still_knows_the_capital_of_france() -> None:
    from transformers import AutoTokenizer

    model_dir = Path(SMOLLM_DIR or "")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    runner = ModelRunner(make_settings(model_dir, quantization="fp8", block_size=16, max_model_len=256), CPU)
    assert runner.weights_bytes < 0.45e9  # 0.54 GB in float32 with FP8 linears: embeddings dominate
    sched = ScriptedScheduler(runner, budget=64)
    sched.add(Request("p", prompt, max_new=8))
    assert tokenizer.decode(sched.run()["p"]).startswith("The capital of France is Paris.")


def test_norms_and_activations_hand_their_output_over_quantized(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With dynamic activation scales every linear but o_proj gets its input as FP8 rows from the kernel
    before it (RMSNorm, SiLU-and-mul), with the logits of quantizing inside the linear, bit for bit."""
    model_dir = models["llama"]
    runner = runner_for(model_dir, quantization="fp8")
    names = {id(layer): name.split(".")[-1] for name, layer in quantized_layers(runner.model)}
    inputs: dict[str, bool] = {}
    project = Linear.project

    def recording_project(self: Linear, x: Any, bias: Any) -> torch.Tensor:
        inputs[names[id(self)]] = isinstance(x, Fp8Rows)
        return project(self, x, bias)

    monkeypatch.setattr(Linear, "project", recording_project)
    handed_over = torch.cat(prefill_logits(runner.model, prompts(model_dir)))
    assert inputs == {"qkv_proj": True, "o_proj": False, "gate_up_proj": True, "down_proj": True}
    monkeypatch.setattr(Linear, "takes_quantized_rows", lambda self: False)
    quantized_inside = torch.cat(prefill_logits(runner.model, prompts(model_dir)))
    assert not any(inputs.values())
    assert torch.equal(handed_over, quantized_inside)
