"""Which quantization is in effect: --quantization against the checkpoint's quantization_config, the
formats this build reads, and what the config system accepts or refuses (and why)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

from app.config import ConfigError, load_settings
from app.worker.quantization import Fp8Scheme, QuantizationError, resolve_quantization
from tests.support.model_factory import fp8_quantization_config

BLOCK = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def config(quantization_config: dict[str, Any] | None = None, layers: int = 2) -> SimpleNamespace:
    fields: dict[str, Any] = {"num_hidden_layers": layers}
    if quantization_config is not None:
        fields["quantization_config"] = quantization_config
    return SimpleNamespace(**fields)


def test_unquantized_checkpoint() -> None:
    assert resolve_quantization(None, config()) is None
    assert resolve_quantization("fp8", config()) == Fp8Scheme("fp8", serialized=False)
    assert resolve_quantization("w8a8_fp8", config()) == Fp8Scheme("w8a8_fp8", serialized=False)
    with pytest.raises(QuantizationError, match="compressed-tensors needs a checkpoint in that format"):
        resolve_quantization("compressed-tensors", config())


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ("fp8-channel", Fp8Scheme("fp8", serialized=True)),
        ("fp8-tensor-static", Fp8Scheme("fp8", serialized=True, static_activations=True)),
        ("fp8-block", Fp8Scheme("fp8", serialized=True, block=(128, 128), scale_name="weight_scale_inv")),
        ("w8a8-channel", Fp8Scheme("w8a8_fp8", serialized=True)),
        ("w8a8-tensor-static", Fp8Scheme("w8a8_fp8", serialized=True, static_activations=True)),
        ("ct-channel-dynamic", Fp8Scheme("compressed-tensors", serialized=True)),
        ("ct-tensor-static", Fp8Scheme("compressed-tensors", serialized=True, static_activations=True)),
        ("ct-block", Fp8Scheme("compressed-tensors", serialized=True, block=(128, 128))),
    ],
)
def test_checkpoint_formats_are_read_from_config_json(fmt: str, expected: Fp8Scheme) -> None:
    qc = fp8_quantization_config(fmt)
    assert resolve_quantization(None, config(qc)) == expected  # the checkpoint decides
    assert resolve_quantization(expected.method, config(qc)) == expected  # the flag may repeat it


def test_flag_that_contradicts_the_checkpoint_is_an_error() -> None:
    with pytest.raises(
        QuantizationError,
        match=r"--quantization w8a8_fp8 does not match the checkpoint, "
        r"which is quantized with fp8 .*set it to fp8",
    ):
        resolve_quantization("w8a8_fp8", config(BLOCK))
    with pytest.raises(QuantizationError, match="quantized with compressed-tensors"):
        resolve_quantization("fp8", config(fp8_quantization_config("ct-channel-dynamic")))


@pytest.mark.parametrize("flag", ["nvfp4", "mxfp4"])
def test_fp4_formats_name_the_gpus_they_need(flag: str) -> None:
    with pytest.raises(QuantizationError, match="Blackwell"):
        resolve_quantization(flag, config())
    with pytest.raises(QuantizationError, match="Blackwell"):
        resolve_quantization(None, config({"quant_method": flag}))
    with pytest.raises(QuantizationError, match="Blackwell"):  # ModelOpt names the algorithm apart
        resolve_quantization(None, config({"quant_method": "modelopt", "quant_algo": flag.upper()}))


def _ct(**changes: Any) -> dict[str, Any]:
    qc = copy.deepcopy(fp8_quantization_config("ct-channel-dynamic"))
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key].update(value)
        elif key == "targets":
            group[key] = value
        else:
            qc[key] = value
    return qc


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "awq"}, "quantized with awq"),
        ({**BLOCK, "fmt": "e5m2"}, "only e4m3"),
        (
            {**BLOCK, "activation_scheme": "static"},
            "block-scaled FP8 checkpoints need activation_scheme dynamic",
        ),
        ({**BLOCK, "weight_block_size": [128]}, "two positive integers"),
        ({**BLOCK, "scale_fmt": "ue8m0"}, "only float32 scales"),
        ({**BLOCK, "modules_to_not_convert": ["model.layers.1.mlp"]}, "keeps model.layers.1.mlp.gate_proj"),
        (
            {"quant_method": "w8a8_fp8", "weight_block_size": [128, 128]},
            "w8a8_fp8 checkpoints with weight_block",
        ),
        (_ct(format="pack-quantized"), "only float-quantized"),
        (_ct(weights={"num_bits": 4, "type": "int"}), "4-bit int is not supported"),
        (_ct(weights={"symmetric": False}), "asymmetric"),
        (_ct(weights={"strategy": "group"}), "weight strategy 'group'"),
        (
            _ct(input_activations={"dynamic": False, "strategy": "token"}),
            "static activation strategy 'token'",
        ),
        (_ct(targets=["re:.*q_proj"]), "one config group targeting Linear"),
        (_ct(ignore=[]), "quantized lm_head is not supported"),
        (_ct(ignore=["lm_head", "re:.*down_proj"]), "keeps model.layers.0.mlp.down_proj unquantized"),
        (_ct(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
    ],
)
def test_unsupported_checkpoint_variants_are_refused(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(QuantizationError, match=message):
        resolve_quantization(None, config(qc))


def test_excluding_only_the_lm_head_is_fine() -> None:
    assert resolve_quantization(None, config({**BLOCK, "modules_to_not_convert": ["lm_head"]})).block == (
        128,
        128,
    )


def test_describe_says_what_runs() -> None:
    assert resolve_quantization("fp8", config()).describe() == (
        "fp8 (e4m3 weights: quantized at load, per-channel; activations: dynamic per-token)"
    )
    assert "128x128 blocks requantized per-channel" in resolve_quantization(None, config(BLOCK)).describe()


# ---------------------------------------------------------------- the config system


@pytest.mark.parametrize(
    "argv",
    [
        ["--quantization", "fp8"], ["--quantization", "w8a8_fp8"], ["--quantization", "compressed-tensors"],
        ["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype", "fp8_e4m3"],
        ["--kv-cache-dtype", "fp8_e4m3", "--quantization-param-path", "/x.json"],
    ],
)  # fmt: skip
def test_fp8_settings_are_accepted(argv: list[str]) -> None:
    assert load_settings(["m", *argv], {}).model == "m"


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--quantization", "nvfp4"], "nvfp4 and mxfp4 need NVIDIA Blackwell GPUs"),
        (["--quantization", "mxfp4"], "nvfp4 and mxfp4 need NVIDIA Blackwell GPUs"),
        (["--kv-cache-dtype", "mxfp8"], "an MXFP8 KV cache needs NVIDIA Blackwell GPUs"),
        (["--kv-cache-quant-method", "per_token_head"], "per-token-head KV scales are not built"),
    ],
)
def test_unbuilt_formats_are_refused_with_the_reason(argv: list[str], reason: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_settings(["m", *argv], {})
    assert f"{' '.join(argv)} is not supported yet: {reason}" in str(refused.value)
