"""The one way tests build settings: a real `app.config.Settings`, validated as the appliance validates
it, from the fields a test names; every other field keeps its default (`Settings(**values)` reads no
environment). Process entry points and the model runner take nothing else, so a test that leaves a
field out gets the appliance's default, never a stand-in's guess.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.config import Settings

# The CPU runner tests' shapes: float32 (exact against transformers), a small pool and small blocks so
# that a few short prompts cross block and chunk boundaries.
CPU_RUNNER: dict[str, Any] = {
    "dtype": "float32",
    "max_num_seqs": 6,
    "block_size": 4,
    "chunked_prefill_size": 16,
    "max_total_tokens": 4096,
}
# The GPU runner tests' shapes: a fixed share of the H200, so that tests may share the GPU.
GPU_RUNNER: dict[str, Any] = {
    "gpu_memory_utilization": 0.3,
    "max_num_seqs": 8,
    "chunked_prefill_size": 64,
    "max_total_tokens": 8192,
    "block_size": 16,
    "seed": 0,
}


def make_settings(model: str | Path = "test-model", base: dict[str, Any] | None = None, **fields: Any) -> Settings:
    """Settings for `model`: `base` (e.g. CPU_RUNNER), then `fields` over it, the rest at their defaults."""
    return Settings(model=str(model), **{**(base or {}), **fields})
