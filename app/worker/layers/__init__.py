"""Building blocks shared by every model family."""

from app.worker.layers.activation import SiluAndMul
from app.worker.layers.embedding import LMHead, VocabEmbedding
from app.worker.layers.linear import SHARD_ROWS, GateUpLinear, Linear, MergedLinear, QKVLinear
from app.worker.layers.norm import RMSNorm
from app.worker.layers.rotary import Rope, RopeSpec, RotaryEmbedding, apply_rotary, rope_spec_from_config

__all__ = [
    "SHARD_ROWS",
    "GateUpLinear",
    "LMHead",
    "Linear",
    "MergedLinear",
    "QKVLinear",
    "RMSNorm",
    "Rope",
    "RopeSpec",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "apply_rotary",
    "rope_spec_from_config",
]
