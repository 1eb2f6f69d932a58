"""Model families and the registry from a Hugging Face `architectures[0]` to our class."""

from __future__ import annotations

from typing import Any

from app.worker.models.dense import DenseCausalLM
from app.worker.models.llama import LlamaForCausalLM, MistralForCausalLM
from app.worker.models.mixtral import MixtralForCausalLM
from app.worker.models.qwen2 import Qwen2ForCausalLM
from app.worker.models.qwen2_moe import Qwen2MoeForCausalLM
from app.worker.models.qwen3 import Qwen3ForCausalLM
from app.worker.models.qwen3_moe import Qwen3MoeForCausalLM

_FAMILIES: tuple[type[DenseCausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
)
MODEL_REGISTRY: dict[str, type[DenseCausalLM]] = {
    arch: cls for cls in _FAMILIES for arch in cls.architectures
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(MODEL_REGISTRY))


class UnsupportedModelError(ValueError):
    pass


def model_class_for(config: Any) -> type[DenseCausalLM]:
    """The class for config.architectures[0]; a clear error naming the supported ones otherwise."""
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise UnsupportedModelError(
            f"the model config names no architectures; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if archs[0] not in MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return MODEL_REGISTRY[archs[0]]


__all__ = [
    "MODEL_REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "DenseCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "UnsupportedModelError",
    "model_class_for",
]
