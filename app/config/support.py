"""What this build supports: the one table to edit as features land.

Each rule names a setting, a predicate that is true for the values this build implements, and why
other values are refused. A setting without a rule is fully supported. Every rule must accept the
setting's default (a test checks it), so only an explicit choice of a missing feature is refused,
with the flag and where it was set, instead of being accepted and silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.config.errors import Problem
from app.config.kv_events import kv_events_config_problem
from app.config.names import flag_of

# The parser names this build implements (app/tokenizer/reasoning.py and tool_parsers.py hold one format
# each; a test keeps the lists equal). Named here because the config must not import the tokenizer.
REASONING_PARSERS = ("base", "qwen3", "deepseek_r1", "deepseek_v31", "kimi_k25")
TOOL_CALL_PARSERS = ("qwen", "json", "kimik2", "deepseek_v4", "passthrough")


@dataclass(frozen=True)
class Rule:
    field: str
    supported: Callable[[Any], bool]
    message: str  # why other values are refused
    summary: str  # the supported values, for --help and docs/configuration.md


def show(value: Any) -> str:
    """A value as the docs and --help print it: auto, 4, true, unset, ["prometheus"]."""
    if value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value)


def only(field: str, *values: Any, why: str) -> Rule:
    """Supported: exactly these values (the first one is normally the default)."""
    summary = ", ".join(show(v) for v in values)
    return Rule(field, lambda v: any(v == ok and type(v) is type(ok) for ok in values), why, summary)


def _all(fields: Iterable[str], value: Any, why: str) -> list[Rule]:
    return [only(f, value, why=why) for f in fields]


_EP = ("expert parallelism is not built: it needs several GPUs to spread the experts over; this build holds every "
       "expert on each TP rank, its intermediate dimension split over the ranks (--moe-tp-size = TP size)")
_COMM_FUSION = "fused all-reduce + norm kernels are not built yet (tensor parallelism uses plain all-reduces)"
_SPEC = ("this build speculates with NGRAM (prompt lookup), STANDALONE (a draft model) and EAGLE3 (an EAGLE-3 "
         "head); MTP and DFLASH need a model with MTP heads, which this build does not serve yet, and DSPARK is "
         "not built")
_DRAFT_MOE = "the draft model's MoE layers run the target's --moe-backend (triton)"
_KVSTORE = "this build has no host KV store (--disable-kvstore is the only mode)"
_DISAGG = "prefill/decode disaggregation is not built yet"

RULES: tuple[Rule, ...] = (
    # Model loading and precision.
    only("tokenizer_mode", "auto",
         why="transformers 5 has fast tokenizers only (slow mode cannot be honoured) and the deepseek_v4 "
         "tokenizer mode is not built yet"),
    only("load_format", "auto", "safetensors", "pt", "dummy",
         why="npcache and extensible weight loading are not built yet"),
    # FP8 (docs/quantization.md). The FP4/MX formats need Blackwell; --quantization-param-path (FP8 KV
    # scales) is accepted as any path and checked by the worker (it needs an FP8 KV cache).
    only("kv_cache_dtype", "auto", "fp8", "fp8_e4m3",
         why="an MXFP8 KV cache needs NVIDIA Blackwell GPUs (SM100 or newer); this build runs an FP8 (e4m3) "
         "KV cache on Hopper"),
    only("kv_cache_quant_method", "none",
         why="per-token-head KV scales are not built (the FP8 KV cache uses per-layer scales from "
         "--quantization-param-path)"),
    only("quantization", None, "fp8", "w8a8_fp8", "compressed-tensors",
         why="nvfp4 and mxfp4 need NVIDIA Blackwell GPUs (B200/GB200, SM100 or newer); this build runs FP8 "
         "(fp8, w8a8_fp8, compressed-tensors) on Hopper (H100/H200) and Ada"),
    # Parallelism: tensor and data parallel and multi-node are built (app/topology.py; the combinations
    # are checked in rules.py, --moe-tp-size with them); expert parallelism needs several GPUs.
    Rule("moe_tp_size", lambda v: v is None or v >= 1, _EP,
         "unset, or equal to --tensor-parallel-size (checked with it)"),
    only("expert_parallel_size", 1, why=_EP),
    only("enable_expert_parallel", False, why=_EP),
    only("mm_encoder_tp_mode", "weights", why="multimodal models are not built yet"),
    # Backends.
    only("attention_backend", None, "torch", "triton", "flashinfer",
         why="this build has the torch (portable), triton and flashinfer (CUDA) attention backends"),
    only("sampling_backend", None, "greedy", "flashinfer",
         why="this build has the portable torch sampler (unset), greedy and flashinfer (CUDA); the "
         "flashinfer_full, triton and triton_full samplers are not built"),
    only("drafter_attention_backend", None, "torch", "triton", "flashinfer",
         why="the drafter's cache runs one of this build's attention backends (unset: the target's)"),
    only("draft_moe_backend", None, why=_DRAFT_MOE),
    only("moe_backend", "auto", "triton",
         why="this build has the triton MoE backend (kernels/moe.py; auto picks it); the gluon, flashinfer, "
         "deep_gemm and mega_moe backends are not built"),
    only("all2all_backend", "none", why=_EP),
    only("deepep_mode", "auto", why=_EP),
    only("dp_sampling", False, why="data-parallel sampling is not built yet"),
    # Reasoning and tools.
    only("reasoning_parser", None, *REASONING_PARSERS,
         why="this build parses the reasoning formats of these families (docs/api.md)"),
    only("tool_call_parser", None, *TOOL_CALL_PARSERS,
         why="this build parses the tool-call formats of these families (docs/api.md)"),
    only("enable_custom_logit_processor", False, why="custom logit processors are not built yet"),
    # Speculative decoding (docs/speculative.md): n-gram drafts in a chain; the JSON config and the
    # step counts are checked in app/config/speculative.py.
    only("speculative_algorithm", None, "NGRAM", "STANDALONE", "EAGLE3", why=_SPEC),
    only("speculative_draft_model_quantization", "unquant", "fp8",
         why="a draft model runs unquantized or with FP8 weights (quantized at load, or its FP8 checkpoint)"),
    only("speculative_eagle_topk", 1,
         why="tree speculation is not supported yet: drafts form a chain (--speculative-eagle-topk 1)"),
    # Observability: metrics, request stats and KV events are built; the events config is checked here.
    Rule("kv_events_config", lambda v: kv_events_config_problem(v) is None,
         "it must be a JSON object with the keys enable_kv_cache_events (bool), publisher (zmq or null), "
         "endpoint, topic, replay_endpoint, buffer_steps (>= 1) and hwm (>= 0); see docs/kv-events.md",
         "unset, or a JSON object of the keys in docs/kv-events.md"),
    # TokenSpeed-specific runtime knobs.
    only("disable_kvstore", True, why=_KVSTORE),
    only("kvstore_ratio", 2.0, why=_KVSTORE),
    *_all(["kvstore_size", "kvstore_io_backend", "kvstore_mem_layout", "kvstore_storage_backend",
           "kvstore_storage_backend_extra_config"], None, _KVSTORE),
    only("enable_mla_l1_5_cache", False, why="MLA models are not built yet"),
    only("mla_chunk_multiplier", 4, why="MLA models are not built yet"),
    only("disaggregation_mode", "null", why=_DISAGG),
    only("disaggregation_bootstrap_port", 8998, why=_DISAGG),
    only("disaggregation_transfer_backend", "mooncake", why=_DISAGG),
    only("disaggregation_ib_device", None, why=_DISAGG),
    only("disaggregation_layerwise_interval", 1, why=_DISAGG),
    only("comm_fusion_max_num_tokens", 2048, why=_COMM_FUSION),
    only("enable_allreduce_fusion", False, why=_COMM_FUSION),
)

BY_FIELD: dict[str, Rule] = {rule.field: rule for rule in RULES}


def describe(field: str, value: Any) -> str:
    """How the operator would have written this value: `--enable-metrics`, `--dtype half`."""
    flag = flag_of(field)
    if isinstance(value, bool):
        return flag if value else flag.replace("--", "--no-", 1)
    if isinstance(value, list):
        return f"{flag} {' '.join(str(v) for v in value)}"
    if isinstance(value, dict):
        return f"{flag} '{json.dumps(value)}'"
    return f"{flag} {value}"


def unsupported(values: Mapping[str, Any]) -> list[Problem]:
    """A problem for every setting whose value this build does not implement."""
    return [
        Problem((rule.field,), f"{describe(rule.field, values[rule.field])} is not supported yet: {rule.message}")
        for rule in RULES
        if rule.field in values and not rule.supported(values[rule.field])
    ]
