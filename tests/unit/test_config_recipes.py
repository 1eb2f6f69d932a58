"""Every recipe in configs/recipes/ is complete and valid; the recipe schema accepts them; the
parameter reference in docs/configuration.md matches the model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import load_settings, meta
from app.config.reference import DOC, embedded, render
from app.config.schema import recipe_schema

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
TEST_MODEL = "/tmp/tiny-model"  # recipes without a model get one from the command line, as tests do


def recipe_settings(path: Path) -> Any:
    argv = ["--config", str(path)]
    if "model" not in (yaml.safe_load(path.read_text()) or {}):
        argv.append(TEST_MODEL)
    return load_settings(argv, {})


def test_there_are_recipes() -> None:
    assert {p.name for p in RECIPES} >= {"smollm2-135m-instruct.yaml", "tiny-test.yaml"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_is_valid(path: Path) -> None:
    settings = recipe_settings(path)
    assert settings.served_model_name and settings.max_model_len and settings.max_num_seqs


def test_default_model_recipe() -> None:
    s = recipe_settings(ROOT / "configs" / "recipes" / "smollm2-135m-instruct.yaml")
    assert s.model == os.path.expanduser("~/.cache/tokenspeed/models/smollm2-135m-instruct")
    assert (s.served_model_name, s.dtype, s.max_model_len, s.max_num_seqs, s.device) == (
        "smollm2-135m-instruct", "auto", 2048, 32, "auto")
    assert s.max_total_tokens == 8192  # a CPU-sized KV pool: the whole appliance within ~1.5 GB


def test_tiny_test_recipe_takes_the_model_from_the_test() -> None:
    path = ROOT / "configs" / "recipes" / "tiny-test.yaml"
    assert "model" not in yaml.safe_load(path.read_text())
    s = load_settings(["--config", str(path)], {"TOKENSPEED_MODEL": TEST_MODEL})
    assert (s.model, s.max_total_tokens, s.block_size) == (TEST_MODEL, 4096, 16)


# ---------------------------------------------------------------- schema


def _type_ok(kind: str, value: Any) -> bool:
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "null": lambda v: v is None,
    }
    return checks[kind](value)


def _conforms(schema: dict[str, Any], value: Any) -> bool:
    """The JSON-schema keywords our recipe schema uses (jsonschema is not installed here)."""
    if "type" in schema and not _type_ok(schema["type"], value):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    if "anyOf" in schema and not any(_conforms(option, value) for option in schema["anyOf"]):
        return False
    number = _type_ok("number", value)
    if number and "minimum" in schema and value < schema["minimum"]:
        return False
    if number and "maximum" in schema and value > schema["maximum"]:
        return False
    if number and "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        return False
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        return False
    if isinstance(value, list):
        return len(value) >= schema.get("minItems", 0) and all(_conforms(schema.get("items", {}), v) for v in value)
    if isinstance(value, dict) and "properties" in schema:
        for key, item in value.items():
            if key not in schema["properties"]:
                if schema.get("additionalProperties", True) is False:
                    return False
            elif not _conforms(schema["properties"][key], item):
                return False
    return True


def validate(document: Any) -> bool:
    try:
        import jsonschema
    except ImportError:
        return _conforms(recipe_schema(), document)
    try:
        jsonschema.validate(document, recipe_schema())
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_schema_accepts_every_recipe(path: Path) -> None:
    assert validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("document", [
    {"max_num_seq": 3},  # unknown key
    {"max_num_seqs": "many"},  # wrong type
    {"max_num_seqs": 0},  # out of range
    {"attention_backend": "foo"},  # not a choice
    {"block_size": 48},  # not a power of two
    {"chunked_prefill_size": 0},
    {"gpu_memory_utilization": 0},
    {"hf_overrides": [1]},
    {"enable_prefix_caching": "yes"},
])
def test_schema_rejects_bad_recipes(document: dict[str, Any]) -> None:
    assert not validate(document)


def test_schema_covers_every_spelling() -> None:
    properties = recipe_schema()["properties"]
    for name in meta.fields():
        assert name in properties and name.replace("_", "-") in properties
    assert {"tp", "attn-tp-size", "ep_size", "model-path"} <= set(properties)
    assert "required" not in recipe_schema()  # a recipe may leave the model to the CLI
    assert validate({"max-num-seqs": 4, "tp": 1, "chunked_prefill_size": -1, "hf_overrides": {"a": 1}})


# ---------------------------------------------------------------- docs


def test_parameter_reference_is_current() -> None:
    page = DOC.read_text(encoding="utf-8")
    assert embedded(page) == render(), "run: .venv/bin/python -m app.config.reference"
    for m in meta.fields().values():
        assert f"`{m.flag}`" in page and f"`{m.env}`" in page, m.name
