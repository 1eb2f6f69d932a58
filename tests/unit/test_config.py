"""The Settings model and its loader: sources, precedence, aliases, validation and support rules."""

from __future__ import annotations

import multiprocessing
import operator
import os
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import ConfigError, Settings, load_settings, meta, resolve_with_sources, support
from app.config.cli_args import build_parser, parse_command_line
from app.config.sources import env_layer

# Every flag in the seed page's tables (the `--kvstore-*` and `--disaggregation-*` families are
# checked separately; `--max-num-batched-tokens` is only named there as *not* a TokenSpeed flag).
SEED_FLAGS = """
--model --tokenizer --tokenizer-mode --skip-tokenizer-init --load-format --trust-remote-code --revision
--download-dir --hf-overrides --dtype --kv-cache-dtype --kv-cache-quant-method --quantization
--quantization-param-path --host --port --served-model-name --api-key --chat-template --stream-interval
--stream-output --weight-version --max-model-len --gpu-memory-utilization --max-num-seqs
--chunked-prefill-size --max-prefill-tokens --max-total-tokens --block-size --enable-prefix-caching
--no-enable-prefix-caching --enforce-eager --max-cudagraph-capture-size --cudagraph-capture-sizes
--tensor-parallel-size --tp --attn-tp-size --dense-tp-size --moe-tp-size --data-parallel-size
--mm-encoder-tp-mode --enable-expert-parallel --expert-parallel-size --ep-size --world-size
--nprocs-per-node --nnodes --node-rank --dist-init-addr --attention-backend --drafter-attention-backend
--moe-backend --draft-moe-backend --all2all-backend --deepep-mode --sampling-backend --dp-sampling
--reasoning-parser --tool-call-parser --enable-custom-logit-processor --speculative-config
--speculative-algorithm --speculative-draft-model-path --speculative-draft-model-quantization
--speculative-num-steps --speculative-num-draft-tokens --speculative-eagle-topk --eagle3-layers-to-capture
--log-level --log-level-http --enable-log-requests --log-requests-level --enable-log-request-stats
--enable-metrics --metrics-reporters --decode-log-interval --enable-cache-report --kv-events-config
--enable-mla-l1-5-cache --mla-chunk-multiplier --comm-fusion-max-num-tokens --enable-allreduce-fusion
""".split()

TOKENSPEED_FAMILIES = {
    "kvstore": ["disable_kvstore", "kvstore_ratio", "kvstore_size", "kvstore_io_backend", "kvstore_mem_layout",
                "kvstore_storage_backend"],
    "disaggregation": ["disaggregation_mode", "disaggregation_bootstrap_port", "disaggregation_transfer_backend",
                       "disaggregation_ib_device", "disaggregation_layerwise_interval"],
}


def load(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return load_settings(argv, env or {})


def error_of(argv: list[str], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(argv, env)
    return str(info.value)


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- the model


def test_every_seed_flag_is_a_setting() -> None:
    options = {o for action in build_parser("tokenspeed serve")._actions for o in action.option_strings}
    missing = [flag for flag in SEED_FLAGS if flag not in options]
    assert not missing, missing
    for family, names in TOKENSPEED_FAMILIES.items():
        assert all(name in meta.fields() for name in names), family


def test_every_field_has_a_seed_group_and_purpose() -> None:
    from app.config.settings import GROUPS

    for m in meta.fields().values():
        assert m.group in GROUPS and m.purpose, m.name
        assert m.origin in ("seed", "appliance"), m.name
    appliance = {name for name, m in meta.fields().items() if m.origin == "appliance"}
    assert appliance == {
        "device", "seed", "drain_timeout", "engine_startup_timeout", "admin_api_key", "max_queued_requests",
        "request_timeout", "ttft_timeout", "heartbeat_timeout", "worker_heartbeat_timeout", "base_gpu_id",
        "gpu_id_step", "load_balance_method", "disable_custom_all_reduce", "piecewise_cuda_graph_max_tokens",
        "enable_pdl", "allow_remote_admin", "weight_update_roots", "grammar_compile_timeout",
        "grammar_cache_size", "speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size",
    }


def test_defaults_follow_the_reference() -> None:
    s = load(["m"])
    expected = {
        "chunked_prefill_size": 8192, "max_prefill_tokens": 8192, "max_num_seqs": 160,
        "gpu_memory_utilization": 0.88, "speculative_num_steps": 3, "speculative_eagle_topk": 1,
        "speculative_draft_model_quantization": "unquant", "weight_version": "default", "deepep_mode": "auto",
        "log_level": "info", "decode_log_interval": 40, "port": 8000, "host": "127.0.0.1", "stream_interval": 1,
        "enable_prefix_caching": True, "metrics_reporters": ["prometheus"], "kv_cache_dtype": "auto",
        "kv_cache_quant_method": "none", "dtype": "auto", "load_format": "auto", "tokenizer_mode": "auto",
        "block_size": 16, "device": "auto", "seed": 0, "drain_timeout": 30.0, "engine_startup_timeout": 1800.0,
        "max_model_len": None, "max_total_tokens": None, "api_key": None, "hf_overrides": {},
        "tensor_parallel_size": 1, "disable_kvstore": True,
    }
    assert {k: getattr(s, k) for k in expected} == expected


def test_derived_defaults_follow_their_source() -> None:
    s = load(["org/model", "--log-level", "debug"])
    assert (s.tokenizer, s.served_model_name, s.log_level_http) == ("org/model", "org/model", "debug")
    assert s.speculative_num_draft_tokens == 4  # steps (3) + 1
    s = load(["org/model", "--tokenizer", "tok", "--served-model-name", "name", "--log-level-http", "error"])
    assert (s.tokenizer, s.served_model_name, s.log_level_http) == ("tok", "name", "error")
    sources = resolve_with_sources(["org/model"], {}).sources
    assert sources["tokenizer"].kind == "default" and "model" in sources["tokenizer"].where


def test_settings_ignore_the_ambient_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_MAX_NUM_SEQS", "3")
    assert Settings(model="m").max_num_seqs == 160
    assert load_settings(["m"]).max_num_seqs == 3  # environ=None reads os.environ


def test_settings_are_frozen_and_picklable() -> None:
    s = load(["m", "--api-key", "sk-secret", "--hf-overrides", '{"a": {"b": 1}}', "--max-num-seqs", "7"])
    clone = pickle.loads(pickle.dumps(s))
    assert clone == s and clone.api_key_value == "sk-secret" and clone.hf_overrides == {"a": {"b": 1}}
    with pytest.raises(ValidationError):
        s.max_num_seqs = 8  # type: ignore[misc]


def test_settings_cross_a_spawned_process() -> None:
    s = load(["m", "--max-num-seqs", "7", "--api-key", "sk-secret"])
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(operator.attrgetter("max_num_seqs", "api_key_value"), (s,)) == (7, "sk-secret")


def test_secrets_are_masked_in_repr_str_and_errors(tmp_path: Path) -> None:
    s = load(["m", "--api-key", "sk-secret"])
    assert "sk-secret" not in repr(s) and "sk-secret" not in str(s)
    assert s.api_key_value == "sk-secret"
    assert load(["m"]).api_key_value is None
    recipe = write(tmp_path, "model: m\napi_key: [sk-secret]\n")
    message = error_of(["--config", recipe])
    assert message.startswith(f"{recipe}: api_key: ") and "sk-secret" not in message and "<hidden>" in message


def test_home_is_expanded_in_paths() -> None:
    home = os.path.expanduser("~")
    s = load(["~/models/x", "--chat-template", "~/t.jinja", "--download-dir", "~/dl", "--tokenizer", "~/tok"])
    assert s.model == f"{home}/models/x" and s.chat_template == f"{home}/t.jinja"
    assert s.download_dir == f"{home}/dl" and s.tokenizer == f"{home}/tok"
    assert load(["org/repo"]).model == "org/repo"


# ---------------------------------------------------------------- precedence


def test_precedence_across_the_four_sources(tmp_path: Path) -> None:
    recipe = write(tmp_path, "model: from-file\nmax_num_seqs: 4\nport: 9000\nblock_size: 32\nmax_model_len: 1024\n")
    env = {"TOKENSPEED_MAX_NUM_SEQS": "5", "TOKENSPEED_PORT": "9001", "TOKENSPEED_BLOCK_SIZE": "64"}
    resolved = resolve_with_sources(["--config", recipe, "--max-num-seqs", "6"], env)
    s, src = resolved.settings, resolved.sources
    assert (s.max_num_seqs, s.port, s.block_size, s.max_model_len, s.model) == (6, 9001, 64, 1024, "from-file")
    assert s.stream_interval == 1
    assert (src["max_num_seqs"].kind, src["max_num_seqs"].where) == ("cli", "--max-num-seqs")
    assert (src["port"].kind, src["port"].where) == ("env", "TOKENSPEED_PORT")
    assert (src["max_model_len"].kind, src["max_model_len"].where) == ("file", f"{recipe}: max_model_len")
    assert (src["stream_interval"].kind, src["stream_interval"].where) == ("default", "default")


def test_recipe_from_env_and_cli_config_wins(tmp_path: Path) -> None:
    a = write(tmp_path, "model: a\nmax_num_seqs: 2\n", "a.yaml")
    b = write(tmp_path, "model: b\n", "b.yaml")
    assert load([], {"TOKENSPEED_CONFIG": a}).max_num_seqs == 2
    s = load(["--config", b], {"TOKENSPEED_CONFIG": a})
    assert (s.model, s.max_num_seqs) == ("b", 160)
    assert load(["m"], {"TOKENSPEED_CONFIG": ""}).model == "m"  # empty: no recipe


def test_model_from_env_only() -> None:
    assert load([], {"TOKENSPEED_MODEL": "env-model"}).model == "env-model"
    assert load(["cli-model"], {"TOKENSPEED_MODEL": "env-model"}).model == "cli-model"


def test_empty_env_values_count_as_unset() -> None:
    s = load(["m"], {"TOKENSPEED_API_KEY": "", "TOKENSPEED_MAX_MODEL_LEN": ""})
    assert s.api_key is None and s.max_model_len is None


def test_yaml_keys_in_snake_or_kebab_case(tmp_path: Path) -> None:
    recipe = write(tmp_path, "model: m\nmax-num-seqs: 3\nenable-prefix-caching: false\nserved_model_name: x\n")
    s = load(["--config", recipe])
    assert (s.max_num_seqs, s.enable_prefix_caching, s.served_model_name) == (3, False, "x")


# ---------------------------------------------------------------- aliases and flag forms


def test_model_positional_or_flag_but_not_both() -> None:
    assert load(["--model", "a"]).model == "a"
    assert load(["--model-path", "a"]).model == "a"
    assert load(["--max-num-seqs", "2", "a"]).model == "a"  # positional after flags
    message = error_of(["a", "--model", "b"])
    assert "positional MODEL" in message and "--model" in message
    assert "only one MODEL" in error_of(["a", "b"])


def test_tp_aliases_name_one_field() -> None:
    for flag in ("--tp", "--attn-tp-size", "--tensor-parallel-size"):
        resolved = resolve_with_sources(["m", flag, "1"], {})
        assert resolved.settings.tensor_parallel_size == 1 and resolved.sources["tensor_parallel_size"].where == flag
    assert load(["m", "--tp", "2"]).tensor_parallel_size == 2
    message = error_of(["m", "--tp", "1", "--attn-tp-size", "2"])
    assert "--tp and --attn-tp-size" in message and "tensor_parallel_size" in message
    assert load(["m", "--tp", "1", "--attn-tp-size", "1"]).tensor_parallel_size == 1
    assert resolve_with_sources(["m"], {"TOKENSPEED_TP": "4"}).sources["tensor_parallel_size"].where == "TOKENSPEED_TP"
    assert load(["m", "--ep-size", "1"]).expert_parallel_size == 1
    assert "(set by --ep-size)" in error_of(["m", "--ep-size", "8"])


def test_alias_conflicts_in_env_and_yaml(tmp_path: Path) -> None:
    message = error_of(["m"], {"TOKENSPEED_TP": "1", "TOKENSPEED_ATTN_TP_SIZE": "2"})
    assert "TOKENSPEED_ATTN_TP_SIZE" in message and "TOKENSPEED_TP" in message
    recipe = write(tmp_path, "model: m\nmax_num_seqs: 3\nmax-num-seqs: 4\n")
    assert "max_num_seqs" in error_of(["--config", recipe]) and "max-num-seqs" in error_of(["--config", recipe])


@pytest.mark.parametrize(("argv", "expected"), [
    (["--enforce-eager"], True),
    (["--enforce-eager", "false"], False),
    (["--enforce-eager", "TRUE"], True),
    (["--enforce-eager=off"], False),
    (["--no-enforce-eager"], False),
    (["--enforce-eager", "1"], True),
])
def test_boolean_flag_forms(argv: list[str], expected: bool) -> None:
    assert load(["m", *argv]).enforce_eager is expected


def test_boolean_flag_does_not_swallow_the_model() -> None:
    s = load(["--enforce-eager", "my-model", "--no-enable-prefix-caching"])
    assert (s.model, s.enforce_eager, s.enable_prefix_caching) == ("my-model", True, False)


def test_boolean_env_and_yaml(tmp_path: Path) -> None:
    assert load(["m"], {"TOKENSPEED_ENABLE_PREFIX_CACHING": "false"}).enable_prefix_caching is False
    assert load(["--config", write(tmp_path, "model: m\nenforce_eager: true\n")]).enforce_eager is True
    assert "TOKENSPEED_ENFORCE_EAGER" in error_of(["m"], {"TOKENSPEED_ENFORCE_EAGER": "maybe"})


# ---------------------------------------------------------------- JSON and list parameters


def test_json_parameters_from_cli_env_and_yaml(tmp_path: Path) -> None:
    assert load(["m", "--hf-overrides", '{"rope_theta": 5}']).hf_overrides == {"rope_theta": 5}
    assert load(["m"], {"TOKENSPEED_HF_OVERRIDES": '{"a": [1]}'}).hf_overrides == {"a": [1]}
    recipe = write(tmp_path, "model: m\nhf_overrides:\n  num_hidden_layers: 2\n  rope: {theta: 1.5}\n")
    assert load(["--config", recipe]).hf_overrides == {"num_hidden_layers": 2, "rope": {"theta": 1.5}}


def test_json_parameter_errors_name_the_source(tmp_path: Path) -> None:
    assert error_of(["m", "--hf-overrides", "{bad"]).startswith("--hf-overrides: not valid JSON")
    assert error_of(["m"], {"TOKENSPEED_KV_EVENTS_CONFIG": "[1]"}).startswith(
        "TOKENSPEED_KV_EVENTS_CONFIG: must be a JSON object")
    recipe = write(tmp_path, "model: m\nhf_overrides: [1, 2]\n")
    assert error_of(["--config", recipe]).startswith(f"{recipe}: hf_overrides: must be a mapping")


def test_json_speculative_config_parses_then_is_refused(tmp_path: Path) -> None:
    config = '{"method": "MTP", "num_speculative_tokens": 3}'
    message = error_of(["m", "--speculative-config", config])
    assert message.startswith("--speculative-algorithm MTP is not supported yet")
    assert message.endswith("(from --speculative-config) (set by --speculative-config)")
    recipe = write(tmp_path, "model: m\nspeculative-config:\n  method: MTP\n")
    assert error_of(["--config", recipe]).endswith(f"(set by {recipe}: speculative-config)")


def test_list_parameters_from_cli_and_env() -> None:
    parser = build_parser("tokenspeed serve")
    line = parse_command_line(["m", "--cudagraph-capture-sizes", "1", "2,4"], parser)
    assert line.entries["cudagraph_capture_sizes"].value == ["1", "2", "4"]
    assert env_layer({"TOKENSPEED_CUDAGRAPH_CAPTURE_SIZES": "[1, 2]"})["cudagraph_capture_sizes"].value == [1, 2]
    assert env_layer({"TOKENSPEED_CUDAGRAPH_CAPTURE_SIZES": "8,16"})["cudagraph_capture_sizes"].value == ["8", "16"]
    assert load(["m", "--cudagraph-capture-sizes", "1", "2,4"]).cudagraph_capture_sizes == [1, 2, 4]
    assert error_of(["m", "--cudagraph-capture-sizes", "1", "x"]).startswith(
        "--cudagraph-capture-sizes[1]: Input should be a valid integer")
    assert load(["m", "--metrics-reporters", "prometheus"]).metrics_reporters == ["prometheus"]


# ---------------------------------------------------------------- errors name key and source


def test_out_of_range_names_the_key_and_source(tmp_path: Path) -> None:
    assert error_of(["m", "--max-num-seqs", "0"]) == (
        "--max-num-seqs: Input should be greater than or equal to 1 (got '0')")
    assert error_of(["m"], {"TOKENSPEED_MAX_NUM_SEQS": "0"}).startswith("TOKENSPEED_MAX_NUM_SEQS: ")
    recipe = write(tmp_path, "model: m\nmax_num_seqs: 0\n")
    assert error_of(["--config", recipe]).startswith(f"{recipe}: max_num_seqs: Input should be greater")


def test_wrong_type_names_the_key_and_source(tmp_path: Path) -> None:
    assert error_of(["m", "--port", "http"]).startswith("--port: Input should be a valid integer")
    assert error_of(["m"], {"TOKENSPEED_GPU_MEMORY_UTILIZATION": "lots"}).startswith(
        "TOKENSPEED_GPU_MEMORY_UTILIZATION: Input should be a valid number")
    recipe = write(tmp_path, "model: m\nenable_prefix_caching: [1]\n")
    assert error_of(["--config", recipe]).startswith(f"{recipe}: enable_prefix_caching: Input should be")


def test_unknown_names_are_errors(tmp_path: Path) -> None:
    assert error_of(["m", "--max-num-seq", "3"]) == "unknown flag --max-num-seq (did you mean --max-num-seqs?)"
    assert error_of(["m", "--bogus=1"]).startswith("unknown flag --bogus")
    assert error_of(["m", "--max-num"]).startswith("unknown flag --max-num")  # no prefix matching
    message = error_of(["m"], {"TOKENSPEED_MAX_NUM_SEQ": "3", "OTHER": "x", "TOKENSPEED_CONFIG": ""})
    assert message.startswith("unknown TOKENSPEED_* environment variable: TOKENSPEED_MAX_NUM_SEQ")
    assert "did you mean TOKENSPEED_MAX_NUM_SEQS?" in message
    assert load(["m"], {"TOKENSPEED_DEFAULT_MODEL_DIR": "/x"}).model == "m"  # reserved, not a setting
    recipe = write(tmp_path, "model: m\nmax_num_seq: 3\n")
    assert error_of(["--config", recipe]) == f"{recipe}: max_num_seq: unknown key (did you mean max_num_seqs?)"


def test_bad_recipe_files(tmp_path: Path) -> None:
    assert error_of(["--config", str(tmp_path / "none.yaml")]).startswith("--config: recipe file not found")
    assert error_of([], {"TOKENSPEED_CONFIG": str(tmp_path / "none.yaml")}).startswith(
        "TOKENSPEED_CONFIG: recipe file not found")
    listing = write(tmp_path, "- a\n- b\n", "list.yaml")
    assert "must be a mapping" in error_of(["--config", listing])
    broken = write(tmp_path, "model: [unclosed\n", "broken.yaml")
    assert error_of(["--config", broken]).startswith(f"{broken}: invalid YAML")
    twice = write(tmp_path, "model: a\nmodel: b\n", "twice.yaml")
    assert "duplicate" in error_of(["--config", twice])
    assert load(["m", "--config", write(tmp_path, "", "empty.yaml")]).model == "m"


def test_missing_model_and_missing_value() -> None:
    assert error_of([]).startswith("no model given")
    assert "--max-num-seqs" in error_of(["m", "--max-num-seqs"])


def test_invalid_choice_lists_the_valid_ones() -> None:
    message = error_of(["m", "--attention-backend", "foo"])
    assert message.startswith("--attention-backend: Input should be")
    assert all(f"'{choice}'" in message for choice in ("torch", "fa3", "flashinfer", "tokenspeed_mla"))
    assert "'bfloat16'" in error_of(["m"], {"TOKENSPEED_DTYPE": "bf17"})


def test_several_errors_in_one_message() -> None:
    message = error_of(["m", "--max-num-seqs", "0", "--port", "0"])
    assert message.startswith("2 configuration errors:")
    assert "--max-num-seqs:" in message and "--port:" in message


# ---------------------------------------------------------------- cross-field rules


def test_chunking_off_needs_prefill_budget_for_max_model_len(tmp_path: Path) -> None:
    recipe = write(tmp_path, "model: m\nchunked_prefill_size: -1\n")
    message = error_of(["--config", recipe, "--max-model-len", "16384"])
    assert message.startswith("--max-prefill-tokens 8192 must be >= --max-model-len 16384")
    assert "--max-model-len: set by --max-model-len" in message
    assert f"--chunked-prefill-size: set by {recipe}: chunked_prefill_size" in message
    assert "--max-prefill-tokens: default" in message
    s = load(["--config", recipe, "--max-model-len", "4096"])
    assert (s.chunked_prefill_size, s.max_prefill_tokens) == (-1, 8192)
    assert load(["m", "--max-model-len", "16384"]).max_model_len == 16384  # chunking on: fine


@pytest.mark.parametrize(("argv", "flag"), [
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size"),
    (["--chunked-prefill-size", "-2"], "--chunked-prefill-size"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--gpu-memory-utilization", "1.01"], "--gpu-memory-utilization"),
    (["--block-size", "48"], "--block-size"),
    (["--block-size", "512"], "--block-size"),
    (["--block-size", "0"], "--block-size"),
    (["--stream-interval", "0"], "--stream-interval"),
    (["--log-requests-level", "3"], "--log-requests-level"),
    (["--port", "70000"], "--port"),
])
def test_ranges(argv: list[str], flag: str) -> None:
    assert error_of(["m", *argv]).startswith(f"{flag}: ")


def test_edges_of_ranges_are_accepted() -> None:
    s = load(["m", "--gpu-memory-utilization", "1", "--block-size", "256", "--chunked-prefill-size", "1"])
    assert (s.gpu_memory_utilization, s.block_size, s.chunked_prefill_size) == (1.0, 256, 1)
    assert load(["m", "--block-size", "1", "--log-level", "DEBUG"]).log_level == "debug"


def test_pool_must_hold_a_full_sequence() -> None:
    message = error_of(["m", "--max-total-tokens", "1024", "--max-model-len", "2048"])
    assert message.startswith("--max-total-tokens 1024 must be >= --max-model-len 2048")
    assert "smaller than one KV block" in error_of(["m", "--max-total-tokens", "8", "--block-size", "16"])


# ---------------------------------------------------------------- what this build supports


def test_unsupported_message_names_flag_and_source() -> None:
    assert error_of(["m"], {"TOKENSPEED_SPECULATIVE_ALGORITHM": "MTP"}) == (
        "--speculative-algorithm MTP is not supported yet: " + support._SPEC
        + " (set by TOKENSPEED_SPECULATIVE_ALGORITHM)"
    )


@pytest.mark.parametrize("argv", [
    ["--attention-backend", "fa3"], ["--sampling-backend", "flashinfer_full"],
    ["--sampling-backend", "triton_full"], ["--kv-cache-quant-method", "per_token_head"],
    ["--load-format", "npcache"],
    ["--load-format", "extensible"], ["--tokenizer-mode", "deepseek_v4"],
    ["--enable-expert-parallel"], ["--ep-size", "2"], ["--mm-encoder-tp-mode", "data"], ["--moe-backend", "gluon"],
    ["--moe-backend", "flashinfer_cutlass"], ["--all2all-backend", "deepep"],
    ["--deepep-mode", "normal"], ["--drafter-attention-backend", "fa3"], ["--draft-moe-backend", "triton"],
    ["--reasoning-parser", "qwen"], ["--tool-call-parser", "hermes"], ["--enable-custom-logit-processor"],
    ["--speculative-eagle-topk", "2"], ["--speculative-draft-model-quantization", "nvfp4"],
    ["--no-disable-kvstore"], ["--kvstore-ratio", "1.5"], ["--kvstore-size", "4"], ["--kvstore-io-backend", "direct"],
    ["--kvstore-mem-layout", "page_first"], ["--kvstore-storage-backend", "mooncake"],
    ["--enable-mla-l1-5-cache"], ["--mla-chunk-multiplier", "2"], ["--disaggregation-mode", "prefill"],
    ["--disaggregation-bootstrap-port", "9000"], ["--disaggregation-ib-device", "mlx5_0"],
    ["--disaggregation-layerwise-interval", "2"], ["--comm-fusion-max-num-tokens", "1024"],
    ["--enable-allreduce-fusion"], ["--dp-sampling"], ["--tokenizer-mode", "slow"],
    ["--quantization", "nvfp4"], ["--kv-cache-dtype", "mxfp8"],
])
def test_unbuilt_features_are_refused(argv: list[str]) -> None:
    message = error_of(["m", *argv])
    assert "is not supported yet" in message and message.endswith(f"(set by {argv[0]})")


@pytest.mark.parametrize("argv", [
    ["--attention-backend", "torch"], ["--sampling-backend", "greedy"], ["--load-format", "dummy"],
    ["--load-format", "pt"], ["--load-format", "safetensors"], ["--dtype", "bfloat16"],
    ["--dtype", "half"], ["--dtype", "float"], ["--disable-kvstore"], ["--skip-tokenizer-init"],
    ["--trust-remote-code"], ["--enforce-eager"], ["--reasoning-parser", "qwen3"], ["--tool-call-parser", "json"],
    ["--reasoning-parser", "kimi_k25"], ["--tool-call-parser", "deepseek_v4"], ["--enable-log-requests", "--log-requests-level", "2"],
    ["--enable-cache-report"], ["--stream-output"], ["--device", "cpu"], ["--seed", "7"], ["--drain-timeout", "0.5"],
    ["--speculative-num-draft-tokens", "4"], ["--tp", "1"], ["--kvstore-ratio", "2"],
    ["--attention-backend", "flashinfer"], ["--attention-backend", "triton"], ["--max-cudagraph-capture-size", "8"],
    ["--kv-cache-dtype", "fp8"], ["--quantization", "fp8"], ["--quantization", "w8a8_fp8"],
    ["--enable-metrics"], ["--enable-log-request-stats"], ["--kv-events-config", '{"enable_kv_cache_events": true}'],
    ["--moe-backend", "triton"], ["--moe-tp-size", "1"], ["--tp", "2", "--moe-tp-size", "2"],
])
def test_built_features_are_accepted(argv: list[str]) -> None:
    load(["m", *argv])


def test_moe_tp_size_other_than_tp_and_expert_parallelism_are_refused() -> None:
    assert "--moe-tp-size 2 differs from --tensor-parallel-size 1" in error_of(["m", "--moe-tp-size", "2"])
    for argv in (["--ep-size", "2"], ["--enable-expert-parallel"]):
        assert "expert parallelism is not built: it needs several GPUs" in error_of(["m", *argv])


def test_support_rules_accept_every_default_and_name_real_fields() -> None:
    fields = meta.fields()
    for rule in support.RULES:
        assert rule.field in fields, rule.field
        assert rule.supported(fields[rule.field].default), rule.field
    assert len(support.BY_FIELD) == len(support.RULES)  # one rule per field
