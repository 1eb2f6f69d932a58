"""Finding, configuring and loading a model: files, HF config (+ overrides), dtype, weights."""

from app.worker.loader.hf_config import (
    checkpoint_dtype,
    eos_token_ids,
    load_hf_config,
    resolve_dtype,
    resolve_max_model_len,
)
from app.worker.loader.source import resolve_model_path
from app.worker.loader.weights import (
    DUMMY_SEED,
    LOAD_FORMATS,
    CheckpointError,
    checkpoint_files,
    init_dummy,
    iterate_tensors,
    load_tensors,
    load_weights,
)

__all__ = [
    "DUMMY_SEED",
    "LOAD_FORMATS",
    "CheckpointError",
    "checkpoint_dtype",
    "checkpoint_files",
    "eos_token_ids",
    "init_dummy",
    "iterate_tensors",
    "load_hf_config",
    "load_tensors",
    "load_weights",
    "resolve_dtype",
    "resolve_max_model_len",
    "resolve_model_path",
]
