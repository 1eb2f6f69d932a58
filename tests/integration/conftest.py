"""Fixtures that start the whole appliance on real models made or prepared for the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.appliance import Appliance


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    from tests.support.model_factory import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: build_tiny_model(arch, root / arch, seed=1) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    path = os.environ.get("TOKENSPEED_DEFAULT_MODEL_DIR")
    if not path or not Path(path, "config.json").exists():
        pytest.skip("TOKENSPEED_DEFAULT_MODEL_DIR does not point at a prepared SmolLM2 (make test sets it)")
    return Path(path)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("appliance-logs")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir, log_dir):
    """The embedded default model served with its recipe, shared by a module's tests."""
    with Appliance(
        smollm2_dir, "--config", "configs/recipes/smollm2-135m-instruct.yaml", "--dtype", "float32", log_dir=log_dir
    ) as app:
        yield app
