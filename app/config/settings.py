"""The Settings model: every server parameter of the seed page, one field per flag.

Field `max_num_seqs` is flag `--max-num-seqs`, env `TOKENSPEED_MAX_NUM_SEQS` and YAML key
`max_num_seqs`. Descriptions are the seed page's purpose text; each field carries its seed group.
Fields marked origin "appliance" go beyond the seed. Build it with `app.config.load_settings`, which
layers CLI, env, recipe and defaults and names the source of every bad value; `Settings(**values)`
uses exactly the values given (the ambient environment is not read), which keeps tests and child
processes deterministic.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from app.config import rules, speculative, support
from app.config.errors import Problem, SettingsProblems

MODEL_LOADING = "Model loading"
PRECISION = "Precision and quantization"
API_SURFACE = "API surface"
SCHEDULER = "Scheduler and memory"
PARALLELISM = "Parallelism"
BACKENDS = "Backend selection"
REASONING = "Reasoning and tool calling"
SPECULATIVE = "Speculative decoding"
OBSERVABILITY = "Observability"
TOKENSPEED = "TokenSpeed-specific runtime knobs"
APPLIANCE = "Appliance"
GROUPS = (MODEL_LOADING, PRECISION, API_SURFACE, SCHEDULER, PARALLELISM, BACKENDS, REASONING, SPECULATIVE,
          OBSERVABILITY, TOKENSPEED, APPLIANCE)

AttentionBackend = Literal[
    "torch", "mha", "mla", "fa3", "fa4", "triton", "flashinfer", "trtllm", "trtllm_mla", "flashmla",
    "tokenspeed_mla", "hybrid_linear_attn",
]
MoeBackend = Literal[
    "auto", "triton", "gluon", "flashinfer_trtllm", "flashinfer_cutlass", "flashinfer_cutedsl", "deep_gemm",
    "mega_moe",
]
Quantization = Literal["fp8", "mxfp4", "nvfp4", "w8a8_fp8", "compressed-tensors"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

# Paths where a leading ~ means the user's home (recipes point at ~/.cache/...).
_PATH_FIELDS = ("model", "tokenizer", "chat_template", "download_dir", "quantization_param_path")
BLOCK_SIZES = tuple(2**i for i in range(9))  # powers of two in [1, 256]


def _f(default: Any, purpose: str, group: str, *, origin: str = "seed", **kw: Any) -> Any:
    """A field with the seed's purpose text, its group, and whether it comes from the seed."""
    extra = {"group": group, "origin": origin, **kw.pop("json_schema_extra", {})}
    if callable(default):
        return Field(default_factory=default, description=purpose, json_schema_extra=extra, **kw)
    return Field(default, description=purpose, json_schema_extra=extra, **kw)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        extra="forbid", frozen=True, coerce_numbers_to_str=True, validate_default=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Layering (CLI > env > recipe > defaults) and its error attribution live in the loader.
        return (init_settings,)

    # ------------------------------------------------------------------ model loading
    model: str = _f(..., "Model path or Hugging Face repo ID.", MODEL_LOADING, min_length=1)
    tokenizer: str | None = _f(
        None, "Tokenizer path when it differs from the model path. Defaults to the model.", MODEL_LOADING)
    tokenizer_mode: Literal["auto", "slow", "deepseek_v4"] = _f(
        "auto", "Select tokenizer behavior. auto uses fast tokenizers and model-specific hooks when available.",
        MODEL_LOADING)
    skip_tokenizer_init: bool = _f(
        False, "Skip tokenizer initialization for input-ID-only serving paths.", MODEL_LOADING)
    load_format: Literal["auto", "pt", "safetensors", "npcache", "dummy", "extensible"] = _f(
        "auto", "Weight loading format: auto, pt, safetensors, npcache, dummy, or extensible.", MODEL_LOADING)
    trust_remote_code: bool = _f(False, "Allow custom model code from the model repository.", MODEL_LOADING)
    revision: str | None = _f(None, "Model branch, tag, or commit.", MODEL_LOADING)
    download_dir: str | None = _f(None, "Hugging Face download/cache directory.", MODEL_LOADING)
    hf_overrides: dict[str, Any] = _f(dict, "JSON overrides for model configuration values.", MODEL_LOADING)

    # ------------------------------------------------------------------ precision and quantization
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = _f(
        "auto", "Model weight and activation dtype. auto follows model metadata.", PRECISION)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "mxfp8"] = _f(
        "auto", "KV cache dtype. Lower precision reduces KV memory and may require scaling factors.", PRECISION)
    kv_cache_quant_method: Literal["none", "per_token_head"] = _f(
        "none", "KV cache quantization method.", PRECISION)
    quantization: Quantization | None = _f(
        None, "Weight quantization mode such as fp8, nvfp4, w8a8_fp8, or compressed-tensors.", PRECISION)
    quantization_param_path: str | None = _f(
        None, "JSON file for KV cache scaling factors, commonly needed with FP8 KV cache.", PRECISION)

    # ------------------------------------------------------------------ API surface
    host: str = _f("127.0.0.1", "HTTP bind host.", API_SURFACE, min_length=1)
    port: int = _f(8000, "HTTP bind port.", API_SURFACE, ge=1, le=65535)
    served_model_name: str | None = _f(
        None, "Model name returned by the OpenAI-compatible API. Defaults to the model.", API_SURFACE,
        min_length=1)
    api_key: SecretStr | None = _f(None, "API key required by the server.", API_SURFACE, min_length=1)
    admin_api_key: SecretStr | None = _f(
        None, "API key of the control routes (abort, cache flush, weight version and weight updates, pause and "
        "continue). When set, those routes need it and the --api-key no longer opens them; it also opens every "
        "other route.", API_SURFACE,
        origin="appliance", min_length=1)
    allow_remote_admin: bool = _f(
        False, "Open the control routes on a non-loopback --host without an --admin-api-key (to anyone who "
        "can reach the port, or to --api-key holders when that is set). Without it, and without an admin key, "
        "they answer 403 there. A warning is logged at start-up.", API_SURFACE, origin="appliance")
    weight_update_roots: list[str] = _f(
        list, "Directories below which /update_weights_from_disk may read, besides the model's own directory "
        "and the download cache (--download-dir, else the Hugging Face cache).", API_SURFACE, origin="appliance")
    chat_template: str | None = _f(None, "Built-in chat template name or template file path.", API_SURFACE)
    stream_interval: int = _f(
        1, "Streaming buffer interval in generated tokens. Smaller values stream more frequently.",
        API_SURFACE, ge=1)
    stream_output: bool = _f(False, "Return generated text as disjoint streaming segments.", API_SURFACE)
    weight_version: str = _f(
        "default", "Initial model-weight version stamped into generation metadata. Defaults to default.",
        API_SURFACE)

    # ------------------------------------------------------------------ scheduler and memory
    max_model_len: int | None = _f(
        None, "Maximum sequence length. If omitted, TokenSpeed uses the model config.", SCHEDULER, ge=1)
    gpu_memory_utilization: float = _f(
        0.88, "Fraction of GPU memory used for model weights and KV cache. Lower it to leave headroom.",
        SCHEDULER, gt=0, le=1)
    max_num_seqs: int = _f(
        160, "Maximum number of active sequences the scheduler may process concurrently.", SCHEDULER, ge=1)
    chunked_prefill_size: int = _f(
        8192, "Token budget the scheduler may issue in one iteration. Defaults to 8192. Set -1 to disable "
        "chunked prefill.", SCHEDULER, json_schema_extra={"anyOf": [{"const": -1}, {"minimum": 1}]})
    max_prefill_tokens: int = _f(
        8192, "Prefill token budget used when chunked prefill is disabled. Defaults to 8192.", SCHEDULER, ge=1)
    max_total_tokens: int | None = _f(
        None, "Override the automatically calculated token pool size.", SCHEDULER, ge=1)
    block_size: int = _f(
        16, "KV cache block size (tokens per block; a power of two up to 256).", SCHEDULER,
        json_schema_extra={"enum": list(BLOCK_SIZES)})
    enable_prefix_caching: bool = _f(True, "Enable or disable prefix cache reuse.", SCHEDULER)
    enforce_eager: bool = _f(False, "Disable CUDA graph execution.", SCHEDULER)
    max_cudagraph_capture_size: int | None = _f(
        None, "Largest batch size to capture with CUDA graphs. Unset: 512, capped by --max-num-seqs.", SCHEDULER,
        ge=1)
    cudagraph_capture_sizes: list[int] | None = _f(
        None, "Explicit CUDA graph capture sizes.", SCHEDULER, min_length=1)

    # ------------------------------------------------------------------ parallelism
    tensor_parallel_size: int = _f(
        1, "Familiar alias for setting attention tensor parallel size (also --tp and --attn-tp-size).",
        PARALLELISM, ge=1)
    dense_tp_size: int | None = _f(None, "Tensor parallel size for dense layers.", PARALLELISM, ge=1)
    moe_tp_size: int | None = _f(None, "Tensor parallel size for MoE layers.", PARALLELISM, ge=1)
    data_parallel_size: int = _f(1, "Number of data-parallel replicas.", PARALLELISM, ge=1)
    mm_encoder_tp_mode: Literal["weights", "data"] = _f(
        "weights", "Multimodal encoder parallelism: weights shards encoder weights with attention TP; data uses "
        "TP1 whole-item DP and currently requires aggregate serving, one node, and no attention context "
        "parallelism.", PARALLELISM)
    enable_expert_parallel: bool = _f(
        False, "Set expert parallelism across the selected world size.", PARALLELISM)
    expert_parallel_size: int = _f(1, "Explicit expert parallel size (also --ep-size).", PARALLELISM, ge=1)
    world_size: int | None = _f(None, "Total worker process count across all nodes.", PARALLELISM, ge=1)
    nprocs_per_node: int | None = _f(None, "Worker process count per node.", PARALLELISM, ge=1)
    nnodes: int = _f(1, "Number of nodes.", PARALLELISM, ge=1)
    node_rank: int = _f(0, "Rank of the current node.", PARALLELISM, ge=0)
    dist_init_addr: str | None = _f(
        None, "Distributed initialization address (host:port of node 0's rendezvous; required with --nnodes > 1).",
        PARALLELISM)
    base_gpu_id: int = _f(
        0, "First GPU index this node's workers use (TokenSpeed's --base-gpu-id).", PARALLELISM,
        origin="appliance", ge=0)
    gpu_id_step: int = _f(
        1, "Distance between the GPU indices of consecutive workers (TokenSpeed's --gpu-id-step).", PARALLELISM,
        origin="appliance", ge=1)
    disable_custom_all_reduce: bool = _f(
        True, "Run every tensor-parallel all-reduce on NCCL. `false`: a small one (a decode step's rows, up to "
        "512 KiB of bf16 or fp32) runs as one kernel that reads the other GPUs' buffers over peer memory "
        "(vLLM's and SGLang's --disable-custom-all-reduce). On by default only once measured on two GPUs, "
        "which has not been done yet.", PARALLELISM, origin="appliance")
    load_balance_method: Literal["shortest_queue", "round_robin"] = _f(
        "shortest_queue", "How the front spreads requests over --data-parallel-size replicas: the replica with "
        "the fewest unfinished requests, or in turn (TokenSpeed's --load-balance-method).", PARALLELISM,
        origin="appliance")

    # ------------------------------------------------------------------ backend selection
    attention_backend: AttentionBackend | None = _f(
        None, "Attention kernel backend. Common values include mha, fa3, fa4, triton, flashinfer, trtllm_mla, "
        "and tokenspeed_mla. This appliance adds torch, its portable backend; unset picks it.", BACKENDS)
    drafter_attention_backend: AttentionBackend | None = _f(
        None, "Attention backend for speculative decoding drafter model.", BACKENDS)
    moe_backend: MoeBackend = _f("auto", "MoE backend.", BACKENDS)
    draft_moe_backend: MoeBackend | None = _f(
        None, "MoE backend for the speculative decoding draft model.", BACKENDS)
    all2all_backend: Literal["none", "deepep"] = _f("none", "MoE all-to-all backend.", BACKENDS)
    deepep_mode: Literal["auto", "normal", "low_latency"] = _f(
        "auto", "DeepEP mode: auto, normal, or low_latency.", BACKENDS)
    sampling_backend: Literal["greedy", "flashinfer", "flashinfer_full", "triton", "triton_full"] | None = _f(
        None, "Sampling backend: greedy, flashinfer, flashinfer_full, triton, or triton_full. Unset picks the "
        "appliance's portable torch sampler.", BACKENDS)
    dp_sampling: bool = _f(
        False, "Let the logits processor own the per-forward logits layout and carry its plan to the sampling "
        "backend (batch-DP sampling).", BACKENDS)

    # ------------------------------------------------------------------ reasoning and tool calling
    reasoning_parser: str | None = _f(
        None, "Parser for extracting reasoning content from model outputs.", REASONING, min_length=1)
    tool_call_parser: str | None = _f(
        None, "Parser for OpenAI-compatible tool-call payloads.", REASONING, min_length=1)
    enable_custom_logit_processor: bool = _f(
        False, "Allow custom logit processors. Keep disabled unless the deployment needs it.", REASONING)

    # ------------------------------------------------------------------ speculative decoding
    speculative_config: dict[str, Any] | None = _f(
        None, "JSON speculative decoding configuration.", SPECULATIVE)
    speculative_algorithm: Literal["NGRAM", "EAGLE3", "STANDALONE", "MTP", "DFLASH", "DSPARK"] | None = _f(
        None, "Speculative algorithm, such as EAGLE3, MTP, or DFLASH.", SPECULATIVE)
    speculative_draft_model_path: str | None = _f(None, "Draft model path or repo ID.", SPECULATIVE)
    speculative_draft_model_quantization: Literal["unquant", "fp8", "mxfp4", "nvfp4", "w8a8_fp8",
                                                  "compressed-tensors"] = _f(
        "unquant", "Draft model quantization. Defaults to unquant.", SPECULATIVE)
    speculative_num_steps: int = _f(3, "Number of draft model steps. Defaults to 3.", SPECULATIVE, ge=1)
    speculative_num_draft_tokens: int | None = _f(
        None, "Number of draft tokens. Defaults to --speculative-num-steps + 1.", SPECULATIVE, ge=1)
    speculative_eagle_topk: int = _f(1, "EAGLE top-k. Defaults to 1.", SPECULATIVE, ge=1)
    eagle3_layers_to_capture: list[int] | None = _f(
        None, "EAGLE3 layers to capture.", SPECULATIVE, min_length=1)
    # N-gram (prompt lookup) drafting: SGLang's names and defaults (vLLM: prompt_lookup_min / _max).
    speculative_ngram_min_match_window_size: int = _f(
        1, "NGRAM: the shortest suffix of the sequence looked up in its history.", SPECULATIVE,
        origin="appliance", ge=1)
    speculative_ngram_max_match_window_size: int = _f(
        12, "NGRAM: the longest suffix looked up first (longer matches draft first).", SPECULATIVE,
        origin="appliance", ge=1)

    # ------------------------------------------------------------------ observability
    log_level: LogLevel = _f("info", "Runtime log level.", OBSERVABILITY)
    log_level_http: LogLevel | None = _f(
        None, "HTTP server log level. Defaults to --log-level when unset.", OBSERVABILITY)
    enable_log_requests: bool = _f(False, "Log request metadata and optionally payloads.", OBSERVABILITY)
    log_requests_level: int = _f(
        0, "Request logging verbosity: 0 metadata, 1 partial input/output, 2 full.", OBSERVABILITY, ge=0, le=2)
    enable_log_request_stats: bool = _f(
        False, "Log a one-line per-request performance summary on finish/abort.", OBSERVABILITY)
    enable_metrics: bool = _f(False, "Enable metrics reporting.", OBSERVABILITY)
    metrics_reporters: list[Literal["prometheus"]] = _f(
        lambda: ["prometheus"], "Metrics reporter, such as prometheus.", OBSERVABILITY, min_length=1)
    decode_log_interval: int = _f(40, "Decode batch log interval.", OBSERVABILITY, ge=1)
    enable_cache_report: bool = _f(
        False, "Include cached-token counts in OpenAI-compatible usage details.", OBSERVABILITY)
    kv_events_config: dict[str, Any] | None = _f(
        None, "JSON config for KV cache mutation events. Set enable_kv_cache_events and a publisher such as zmq "
        "to publish device prefix-cache stores and removals.", OBSERVABILITY)

    # ------------------------------------------------------------------ TokenSpeed-specific knobs
    # TokenSpeed enables its host KV store unless --disable-kvstore; this build has none, so the
    # default is True here and asking for the store is refused (see support.py).
    disable_kvstore: bool = _f(
        True, "Disable the host (L2) KV store. This build has no host KV store, so it is always disabled.",
        TOKENSPEED)
    kvstore_ratio: float = _f(2.0, "Host KV store size relative to the device KV pool.", TOKENSPEED, gt=0)
    kvstore_size: float | None = _f(
        None, "Host KV store size in GB (overrides --kvstore-ratio).", TOKENSPEED, gt=0)
    kvstore_io_backend: Literal["kernel", "direct"] | None = _f(
        None, "Host KV store copy backend: kernel or direct.", TOKENSPEED)
    kvstore_mem_layout: Literal["layer_first", "page_first", "page_head"] | None = _f(
        None, "Host KV store memory layout: layer_first, page_first, or page_head.", TOKENSPEED)
    kvstore_storage_backend: Literal["mooncake"] | None = _f(
        None, "Third-level KV storage backend (mooncake).", TOKENSPEED)
    kvstore_storage_backend_extra_config: dict[str, Any] | None = _f(
        None, "JSON extra configuration for the KV storage backend.", TOKENSPEED)
    enable_mla_l1_5_cache: bool = _f(False, "Enable the MLA L1.5 cache.", TOKENSPEED)
    mla_chunk_multiplier: int = _f(4, "MLA prefill chunk multiplier.", TOKENSPEED, ge=1)
    disaggregation_mode: Literal["null", "prefill", "decode", "encode"] = _f(
        "null", "Prefill/decode disaggregation role: null (aggregate), prefill, decode, or encode.", TOKENSPEED)
    disaggregation_bootstrap_port: int = _f(
        8998, "Bootstrap server port of a disaggregated prefill node.", TOKENSPEED, ge=1, le=65535)
    disaggregation_transfer_backend: Literal["mooncake"] = _f(
        "mooncake", "KV transfer backend for disaggregation.", TOKENSPEED)
    disaggregation_ib_device: str | None = _f(
        None, "InfiniBand device(s) for disaggregated KV transfer.", TOKENSPEED)
    disaggregation_layerwise_interval: int = _f(
        1, "Layers per layerwise KV transfer in disaggregation.", TOKENSPEED, ge=1)
    comm_fusion_max_num_tokens: int = _f(
        2048, "Largest token count handled by fused communication kernels.", TOKENSPEED, ge=1)
    enable_allreduce_fusion: bool = _f(False, "Fuse all-reduce with the following norm.", TOKENSPEED)

    # ------------------------------------------------------------------ appliance (beyond the seed)
    device: Literal["auto", "cuda", "cpu"] = _f(
        "auto", "Device the worker runs on: auto picks cuda when available, else cpu.", APPLIANCE,
        origin="appliance")
    seed: int = _f(0, "Base random seed of the worker (per-request seeds override it).", APPLIANCE,
                   origin="appliance", ge=0)
    drain_timeout: float = _f(
        30.0, "Seconds in-flight requests may take to finish after SIGTERM/SIGINT before the children are "
        "stopped.", APPLIANCE, origin="appliance", gt=0)
    engine_startup_timeout: float = _f(
        1800.0, "Seconds the supervisor waits for every process to report ready (model load and warm-up).",
        APPLIANCE, origin="appliance", gt=0)
    max_queued_requests: int = _f(
        1024, "Requests that may wait for a running slot; beyond --max-num-seqs running plus this many "
        "waiting, new requests get 503 with Retry-After.", APPLIANCE, origin="appliance", ge=1)
    request_timeout: float | None = _f(
        None, "Seconds a request may take in all (queueing included); past it the request is aborted, its KV "
        "freed, and the client gets 504 (or a terminal stream error). Unset: no limit.", APPLIANCE,
        origin="appliance", gt=0)
    ttft_timeout: float | None = _f(
        None, "Seconds a request may wait for its first token; past it the request is aborted and the client "
        "gets 504. Unset: no limit.", APPLIANCE, origin="appliance", gt=0)
    piecewise_cuda_graph_max_tokens: int = _f(
        2048, "Largest prefill or mixed step, in tokens, run as CUDA graph pieces cut at each layer's attention "
        "(token buckets up to it are captured at start-up; larger steps run eagerly). 0: none. Off with "
        "--enforce-eager; with tensor parallelism prefills run eagerly.", APPLIANCE, origin="appliance", ge=0)
    enable_pdl: bool = _f(
        True, "Launch the decode-path Triton kernels with programmatic dependent launch (each one's programs "
        "are scheduled while the kernel before it finishes, and read meanwhile what no kernel writes: weight "
        "scales, positions, sequence lengths). Takes "
        "effect on one GPU of compute capability 9.0 or newer (Hopper); elsewhere the kernels launch "
        "plainly.", APPLIANCE, origin="appliance")
    grammar_compile_timeout: float = _f(
        30.0, "Seconds a structured-output grammar (JSON schema, regex, EBNF) may take to compile; past it the "
        "request waiting for it fails with 400 (the compile finishes in the background and is cached).",
        APPLIANCE, origin="appliance", gt=0)
    grammar_cache_size: int = _f(
        64, "Compiled structured-output grammars kept by their text (least recently used go first); a "
        "cached grammar costs a request no compile.", APPLIANCE, origin="appliance", ge=0)
    heartbeat_timeout: float = _f(
        30.0, "Seconds the http, tokenizer or scheduler process may go without a liveness heartbeat before the "
        "supervisor declares it wedged and stops the appliance (exit 1).", APPLIANCE, origin="appliance", gt=0)
    worker_heartbeat_timeout: float = _f(
        600.0, "Seconds a worker may go without a liveness heartbeat (one step, or a weight update) before the "
        "supervisor declares it wedged and stops the appliance (exit 1).", APPLIANCE, origin="appliance", gt=0)

    # ------------------------------------------------------------------ validators
    @field_validator(*_PATH_FIELDS)
    @classmethod
    def _expand_home(cls, value: str | None) -> str | None:
        return os.path.expanduser(value) if value is not None and value.startswith("~") else value

    @field_validator("log_level", "log_level_http", mode="before")
    @classmethod
    def _lower_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_budget(cls, value: int) -> int:
        if value != -1 and value <= 0:
            raise ValueError("must be -1 (chunked prefill off) or a positive token budget")
        return value

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value not in BLOCK_SIZES:
            raise ValueError(f"must be a power of two in [1, 256]: one of {', '.join(map(str, BLOCK_SIZES))}")
        return value

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        problems, from_json = speculative.expand_config(self.__dict__, self.model_fields_set)
        problems += [_from_json(p, from_json) for p in support.unsupported(self.__dict__)]
        derived = {
            "tokenizer": self.model,
            "served_model_name": self.model,
            "log_level_http": self.log_level,
            "speculative_num_draft_tokens": self.speculative_num_steps + 1,
        }
        for name, value in derived.items():
            if getattr(self, name) is None:
                self.__dict__[name] = value  # frozen model: set once, here, during validation
        problems += rules.cross_field_problems(self.__dict__)
        problems += [_from_json(p, from_json) for p in speculative.spec_problems(self.__dict__)]
        problems += [_from_json(p, from_json) for p in speculative.draft_problems(self.__dict__)]
        if problems:
            raise SettingsProblems(problems)
        return self

    # ------------------------------------------------------------------ accessors
    @property
    def api_key_value(self) -> str | None:
        """The API key in clear, for the code that checks requests (repr/str/config show mask it)."""
        return self.api_key.get_secret_value() if self.api_key is not None else None

    @property
    def admin_api_key_value(self) -> str | None:
        """The admin API key in clear (repr/str/config show mask it)."""
        return self.admin_api_key.get_secret_value() if self.admin_api_key is not None else None


def _from_json(problem: Problem, from_json: set[str]) -> Problem:
    """A problem about values --speculative-config wrote is that JSON's, for the source it names."""
    if not from_json or not set(problem.fields) & from_json:
        return problem
    others = tuple(name for name in problem.fields if name not in from_json)
    return Problem(("speculative_config", *others), f"{problem.text} (from --speculative-config)")


# Fields whose default is computed from another setting, and what it follows (for `config show`).
DERIVED_FROM = {
    "tokenizer": "model",
    "served_model_name": "model",
    "log_level_http": "log_level",
    "speculative_num_draft_tokens": "speculative_num_steps + 1",
}
