"""The model recipe catalogue (configs/recipes/<model>-<quant>.yaml): which recipes ship, which ones this
build refuses and why (so a test flips when the feature lands), and that each is sized for one H200.

Every recipe's validity is tests/unit/test_config_recipes.py's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import resolve_with_sources
from app.config.show import as_json

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "configs" / "recipes"
DOCS = ROOT / "docs" / "recipes.md"

FP8_RECIPES = ("qwen3-8b-fp8.yaml", "llama-3.1-8b-instruct-fp8.yaml", "qwen3-30b-a3b-fp8.yaml")
# Recipes for local models, owned by the config and model work (not Hub models).
LOCAL = {"smollm2-135m-instruct.yaml", "tiny-test.yaml"}
# Recipes that add speculative decoding to a catalogue recipe: (recipe, its base, the draft's Hub id).
SPECULATIVE = {"llama-3.1-8b-instruct-eagle3.yaml": ("llama-3.1-8b-instruct-bf16.yaml", "EAGLE3",
                                                     "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B")}

H200_BYTES = 141e9


@dataclass(frozen=True)
class Model:
    """Public facts of a Hub model: context length, KV geometry and parameter count."""

    context: int
    layers: int
    kv_heads: int
    head_dim: int
    params: float  # parameters, all of them (embeddings included)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * bytes_per_value


MODELS: dict[str, Model] = {
    "Qwen/Qwen3-0.6B": Model(40960, 28, 8, 128, 0.75e9),
    "Qwen/Qwen3-8B": Model(40960, 36, 8, 128, 8.2e9),
    "Qwen/Qwen3-8B-FP8": Model(40960, 36, 8, 128, 8.2e9),
    "meta-llama/Llama-3.1-8B-Instruct": Model(131072, 32, 8, 128, 8.0e9),
    "Qwen/Qwen2.5-7B-Instruct": Model(32768, 28, 4, 128, 7.6e9),
    "mistralai/Mistral-7B-Instruct-v0.3": Model(32768, 32, 8, 128, 7.25e9),
    "Qwen/Qwen3-30B-A3B": Model(40960, 48, 4, 128, 30.5e9),
    "Qwen/Qwen3-30B-A3B-FP8": Model(40960, 48, 4, 128, 30.5e9),
}
CATALOGUE = {
    "qwen3-0.6b-bf16.yaml", "qwen3-8b-bf16.yaml", "qwen3-8b-fp8.yaml", "llama-3.1-8b-instruct-bf16.yaml",
    "llama-3.1-8b-instruct-fp8.yaml", "qwen2.5-7b-instruct-bf16.yaml", "mistral-7b-instruct-v0.3-bf16.yaml",
    "qwen3-30b-a3b-bf16.yaml", "qwen3-30b-a3b-fp8.yaml",
}
READY = sorted(CATALOGUE)


def document(name: str) -> dict[str, Any]:
    return yaml.safe_load((RECIPES / name).read_text())


def test_the_catalogue_is_complete() -> None:
    present = {p.name for p in RECIPES.glob("*.yaml")}
    assert CATALOGUE <= present, sorted(CATALOGUE - present)
    assert present - CATALOGUE - LOCAL - set(SPECULATIVE) == set(), "classify the new recipe here (CATALOGUE, LOCAL or SPECULATIVE)"


@pytest.mark.parametrize("name", FP8_RECIPES)
def test_fp8_recipes_are_valid(name: str) -> None:
    """The FP8 recipes validate as they are, and `config show` reports the quantization they set."""
    path = RECIPES / name
    resolved = resolve_with_sources(["--config", str(path)], {})
    assert resolved.settings.quantization == "fp8" and resolved.settings.kv_cache_dtype == "auto"
    shown = as_json(resolved)["quantization"]
    assert (shown["value"], shown["source"]) == ("fp8", "file") and str(path) in shown["where"]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_name_follows_model_and_quantization(name: str) -> None:
    doc = document(name)
    quant = re.fullmatch(r"[a-z0-9.\-]+-(bf16|fp8)\.yaml", name).group(1)
    assert doc["dtype"] == "bfloat16"
    assert doc.get("quantization") == (None if quant == "bf16" else "fp8")
    assert doc["model"] in MODELS, "add the model's facts to MODELS"
    assert doc["served_model_name"] == name.removesuffix(".yaml").removesuffix("-bf16")


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_recipe_is_sized_for_one_h200(name: str) -> None:
    doc = document(name)
    model = MODELS[doc["model"]]
    assert doc["max_model_len"] <= model.context
    weight_bytes = model.params * (1 if doc.get("quantization") == "fp8" else 2)
    budget = doc["gpu_memory_utilization"] * H200_BYTES - weight_bytes
    # A full-length sequence for every 16th seat at least: the pool is not a token or two deep.
    assert model.kv_bytes_per_token() * doc["max_model_len"] * doc["max_num_seqs"] / 16 < budget
    assert doc["chunked_prefill_size"] <= doc["max_model_len"]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_recipe_leaves_the_listener_to_the_deployment(name: str) -> None:
    """The container sets host and port by environment (which would silently win over the file)."""
    assert not {"host", "port", "api_key"} & set(document(name))


def test_docs_list_every_recipe() -> None:
    text = DOCS.read_text()
    for name in sorted(CATALOGUE | LOCAL | set(SPECULATIVE)):
        assert f"`{name}`" in text, name
    assert "Qwen3-30B-A3B" in text and "MoE" in text


@pytest.mark.parametrize("name", sorted(SPECULATIVE))
def test_speculative_recipe_is_its_base_plus_the_draft(name: str) -> None:
    """The model and precision are its base recipe's; the method and draft come in speculative_config."""
    base, algorithm, draft = SPECULATIVE[name]
    doc, base_doc = document(name), document(base)
    for key in ("model", "dtype", "load_format", "kv_cache_dtype", "max_model_len", "gpu_memory_utilization"):
        assert doc[key] == base_doc[key], key
    settings = resolve_with_sources(["--config", str(RECIPES / name)], {}).settings
    assert (settings.speculative_algorithm, settings.speculative_draft_model_path) == (algorithm, draft)
    assert (settings.speculative_num_steps, settings.speculative_num_draft_tokens) == (3, 4)
