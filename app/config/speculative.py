"""Speculative decoding settings: `--speculative-config` JSON expanded into the flat flags, and the rules
that tie them together.

The JSON carries a recipe's method, draft model and token count together (the seed prefers it). Its keys
are vLLM's (`method`, `model`, `num_speculative_tokens`, `quantization`, `prompt_lookup_min`,
`prompt_lookup_max`) or the flat flags' own names without the `speculative_` prefix (`algorithm`,
`draft_model_path`, `num_steps`, `num_draft_tokens`, `eagle_topk`, `ngram_min_match_window_size`,
`ngram_max_match_window_size`). A key it does not know, or a value that contradicts a flag set
explicitly, is a problem naming both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.config.errors import Problem

# JSON key -> settings field.
KEYS: dict[str, str] = {
    "method": "speculative_algorithm",
    "algorithm": "speculative_algorithm",
    "model": "speculative_draft_model_path",
    "draft_model_path": "speculative_draft_model_path",
    "quantization": "speculative_draft_model_quantization",
    "draft_model_quantization": "speculative_draft_model_quantization",
    "num_speculative_tokens": "speculative_num_steps",
    "num_steps": "speculative_num_steps",
    "num_draft_tokens": "speculative_num_draft_tokens",
    "eagle_topk": "speculative_eagle_topk",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "ngram_min_match_window_size": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
    "ngram_max_match_window_size": "speculative_ngram_max_match_window_size",
}
# vLLM's method names for SGLang's algorithms.
METHODS = {"ngram": "NGRAM", "eagle3": "EAGLE3", "draft_model": "STANDALONE", "standalone": "STANDALONE",
           "mtp": "MTP", "dflash": "DFLASH", "dspark": "DSPARK"}
ALGORITHMS = ("NGRAM", "EAGLE3", "STANDALONE", "MTP", "DFLASH", "DSPARK")
# What only means something once an algorithm is chosen, with its default.
KNOBS = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_draft_model_quantization": "unquant",
         "speculative_ngram_min_match_window_size": 1, "speculative_ngram_max_match_window_size": 12}


def expand_config(values: dict[str, Any], explicit: Iterable[str]) -> tuple[list[Problem], set[str]]:
    """Write --speculative-config's entries into `values` (the settings' fields, changed in place).
    Returns the problems and the fields the JSON set (their problems are attributed to the JSON)."""
    config = values.get("speculative_config")
    if config is None:
        return [], set()
    where = ("speculative_config",)
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        return [Problem(where, f"--speculative-config has unknown keys {unknown}: use {sorted(KEYS)}")], set()
    explicit = set(explicit)
    problems: list[Problem] = []
    filled: set[str] = set()
    for key, value in config.items():
        name = KEYS[key]
        if name == "speculative_algorithm" and isinstance(value, str):
            value = METHODS.get(value.lower(), value.upper())
        error = _value_problem(name, value)
        if error:
            problems.append(Problem(where, f"--speculative-config's {key!r}: {error}"))
            continue
        if name in filled and values[name] != value:
            problems.append(Problem(where, f"--speculative-config sets {name[12:]} twice, to different values"))
        elif name in explicit and name not in filled and values[name] != value:
            problems.append(Problem(
                (*where, name),
                f"--speculative-config's {key!r} ({value!r}) contradicts --{name.replace('_', '-')} "
                f"{values[name]!r}: set it in one place",
            ))
        values[name] = value
        filled.add(name)
    if "speculative_num_steps" in filled and "speculative_num_draft_tokens" not in filled | explicit:
        values["speculative_num_draft_tokens"] = None  # derived again from the JSON's steps
    return problems, filled


def _value_problem(name: str, value: Any) -> str | None:
    """Why a JSON value cannot be this field's (the flags' own values pydantic checks), or None."""
    if name == "speculative_algorithm":
        return None if value in ALGORITHMS else f"{value!r} is not one of {list(ALGORITHMS)} (or {sorted(METHODS)})"
    if name in ("speculative_draft_model_path", "speculative_draft_model_quantization"):
        return None if isinstance(value, str) and value else f"{value!r} must be a non-empty string"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{value!r} must be an integer >= 1"
    return None


def spec_problems(values: Mapping[str, Any]) -> list[Problem]:
    """The combinations this build runs: a chain (top-k 1) of num_steps drafts, verified as num_steps + 1
    positions; the n-gram windows in order; no knob without an algorithm."""
    algorithm = values["speculative_algorithm"]
    steps = values["speculative_num_steps"]
    problems: list[Problem] = []
    if algorithm is None:
        changed = [name for name, default in KNOBS.items() if values[name] != default]
        if values["speculative_num_draft_tokens"] not in (None, steps + 1):
            changed.append("speculative_num_draft_tokens")
        for name in changed:
            problems.append(Problem(
                (name,), f"--{name.replace('_', '-')} has no effect without --speculative-algorithm (or "
                "--speculative-config's method): set one, or leave it out"))
        return problems
    draft_tokens = values["speculative_num_draft_tokens"]
    if draft_tokens is not None and draft_tokens != steps + 1:
        problems.append(Problem(
            ("speculative_num_draft_tokens", "speculative_num_steps"),
            f"--speculative-num-draft-tokens {draft_tokens} must be --speculative-num-steps + 1 = {steps + 1}: "
            "a chain of drafts verifies the steps' tokens plus one (a token tree is not supported yet)"))
    low = values["speculative_ngram_min_match_window_size"]
    high = values["speculative_ngram_max_match_window_size"]
    if low > high:
        problems.append(Problem(
            ("speculative_ngram_min_match_window_size", "speculative_ngram_max_match_window_size"),
            f"--speculative-ngram-min-match-window-size {low} must be <= "
            f"--speculative-ngram-max-match-window-size {high}"))
    return problems


# The methods that draft with a model (--speculative-draft-model-path): their knobs mean nothing elsewhere.
MODEL_DRAFTS = ("STANDALONE", "EAGLE3")


def draft_problems(values: Mapping[str, Any]) -> list[Problem]:
    """A draft model's flags with its methods only: STANDALONE and EAGLE3 need --speculative-draft-model-path,
    --eagle3-layers-to-capture is EAGLE3's (three layer ids), FP8 is for a draft model, not a head."""
    algorithm = values["speculative_algorithm"]
    path = values["speculative_draft_model_path"]
    problems: list[Problem] = []
    other = f"not {algorithm}" if algorithm else "set one"
    if algorithm in MODEL_DRAFTS and not path:
        what = "an EAGLE-3 head" if algorithm == "EAGLE3" else "a draft model of the target's tokenizer"
        problems.append(Problem(("speculative_algorithm",),
                                f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path ({what})"))
    owned = {"speculative_draft_model_path": path is not None,
             "drafter_attention_backend": values["drafter_attention_backend"] is not None}
    for name, given in owned.items():
        if given and algorithm not in MODEL_DRAFTS:
            problems.append(Problem((name,), f"--{name.replace('_', '-')} is for --speculative-algorithm "
                                             f"STANDALONE or EAGLE3: {other}"))
    layers = values["eagle3_layers_to_capture"]
    if layers is not None and algorithm != "EAGLE3":
        problems.append(Problem(("eagle3_layers_to_capture",),
                                f"--eagle3-layers-to-capture is for --speculative-algorithm EAGLE3: {other}"))
    elif layers is not None and (len(layers) != 3 or min(layers) < 0):
        problems.append(Problem(("eagle3_layers_to_capture",), "--eagle3-layers-to-capture needs three layer ids "
                                "(>= 0) of the target, whose outputs the head's fc reads; got " + str(layers)))
    if algorithm == "EAGLE3" and values["speculative_draft_model_quantization"] != "unquant":
        problems.append(Problem(("speculative_draft_model_quantization",),
                                "--speculative-draft-model-quantization fp8 is for a draft model (STANDALONE): an "
                                "EAGLE-3 head runs unquantized"))
    return problems
