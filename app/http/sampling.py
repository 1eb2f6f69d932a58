"""Sampling parameters as the HTTP APIs accept them: value types with their ranges, and the checks that need
the engine's vocabulary."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from app.http.errors import bad_request

# Size limits of one request's sampling options (docs/operations.md): each violation is a 400 naming it.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024  # matched against the tail of the output at every token
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # entries
SEED_MIN, SEED_LIMIT = -(2**63), 2**64  # what torch.Generator.manual_seed takes
INT32_MAX = 2**31 - 1  # counts beyond this are nonsense (and would not fit the wire format)

Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
MinP = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
RepetitionPenalty = Annotated[float, Field(gt=0, le=2)]
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
MinTokens = Annotated[int, Field(ge=0, le=INT32_MAX)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
NumChoices = Annotated[int, Field(ge=1, le=128)]
NumLogprobs = Annotated[int, Field(ge=0, le=20)]
Seed = Annotated[int, Field(ge=SEED_MIN, lt=SEED_LIMIT)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)]


def check_top_k(value: int | None) -> int | None:
    if value is not None and value != -1 and value < 1:
        raise ValueError("must be -1 (disabled) or at least 1")
    return value


def normalize_stop(value: Any) -> Any:
    """A string or a list of strings -> a list (pydantic then checks the item types)."""
    if value is None or isinstance(value, str):
        return None if value is None else [value]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of strings")
    return value


def check_stop(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    if any(s == "" for s in value):
        raise ValueError("stop strings must not be empty")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in value):
        raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters")
    return value


def _outside(tid: int, vocab_size: int | None) -> str | None:
    if tid < 0 or (vocab_size is not None and tid >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        return f"token id {tid} is outside {bound}"
    return None


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> None:
    """Token ids must lie in [0, vocab_size) (the upper bound once the engine reported it)."""
    for i, tid in enumerate(ids):
        if (problem := _outside(tid, vocab_size)) is not None:
            raise bad_request(f"invalid value for '{param}[{i}]': {problem}", param=f"{param}[{i}]")


def logit_bias_ids(bias: dict[str, float] | None, vocab_size: int | None, param: str = "logit_bias") -> dict[int, float]:
    """OpenAI's {"token id as a string": bias in [-100, 100]} -> {token id: bias}."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        path = f"{param}.{key}"
        try:
            tid = int(key)
        except ValueError:
            raise bad_request(f"invalid value for '{path}': {key!r} is not a token id", param=path) from None
        if (problem := _outside(tid, vocab_size)) is not None:
            raise bad_request(f"invalid value for '{path}': {problem}", param=path)
        if not -100 <= value <= 100:
            raise bad_request(f"invalid value for '{path}': bias {value} is outside [-100, 100]", param=path)
        out[tid] = float(value)
    return out


def per_sample_seed(seed: int | None, sample: int) -> int | None:
    """The n samples of one prompt are separate engine requests: seed + i keeps them reproducible
    without making them identical."""
    if seed is None:
        return None
    value = seed + sample
    return value - 2**64 if value >= SEED_LIMIT else value
