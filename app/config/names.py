"""How a setting is spelled in each place: field `max_num_seqs`, flag `--max-num-seqs`,
env var `TOKENSPEED_MAX_NUM_SEQS`, YAML key `max_num_seqs` or `max-num-seqs`."""

from __future__ import annotations

ENV_PREFIX = "TOKENSPEED_"
CONFIG_ENV = "TOKENSPEED_CONFIG"

# TOKENSPEED_* variables that are not settings (so the unknown-variable check leaves them alone).
# TOKENSPEED_CONFIG names the recipe; TOKENSPEED_DEFAULT_MODEL_DIR is where `make model` puts the
# embedded default model (the Makefile exports it to the test run). TOKENSPEED_TEST_FAULT is the
# test-only fault switch the worker reads (app/worker/process.py; never set it in production).
TEST_FAULT_ENV = "TOKENSPEED_TEST_FAULT"
NON_SETTING_ENV_VARS = frozenset({CONFIG_ENV, "TOKENSPEED_DEFAULT_MODEL_DIR", TEST_FAULT_ENV})

# Alternative names of a setting (field spelling), accepted on the CLI, in env and in YAML.
ALIASES: dict[str, str] = {
    "model_path": "model",
    "tp": "tensor_parallel_size",
    "attn_tp_size": "tensor_parallel_size",
    "ep_size": "expert_parallel_size",
}


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


def key_of(spelling: str) -> str:
    """A YAML key or flag body in either case style, as a field-style name."""
    return spelling.strip().replace("-", "_")
