"""Sampling parameters as the HTTP APIs accept them: value types with their ranges, the fields both APIs
declare (SamplingBody, mapped to the engine's SamplingParams in one place), and the checks that need the
engine's vocabulary."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar

from pydantic import AliasGenerator, ConfigDict, Field, field_validator

from app.http.body import StrictBody
from app.http.errors import bad_request
from app.protocol import GrammarSpec, SamplingParams

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


class SamplingBody(StrictBody):
    """The sampling fields of /generate's sampling_params and of the OpenAI bodies, declared once under the
    engine's names (SamplingParams). An API that calls a field otherwise renames it (renamed_fields): clients
    send that name and errors show it. A field named as a SamplingParams field reaches the engine unchanged
    (to_params); so a new sampling field is one line here, and one in SamplingParams."""

    max_new_tokens: MaxTokens | None = None
    min_new_tokens: MinTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    seed: Seed | None = None
    stop: list[str] | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None  # keep the matched stop string in the output

    # Fields that need more than a copy: the API resolves the token limit; these three are checked here.
    _MAPPED: ClassVar[frozenset[str]] = frozenset({"max_new_tokens", "logit_bias", "stop", "stop_token_ids"})

    _top_k = field_validator("top_k")(check_top_k)
    _stop_shape = field_validator("stop", mode="before")(normalize_stop)
    _stop = field_validator("stop")(check_stop)

    @classmethod
    def api_name(cls, field: str) -> str:
        """The name clients send for `field` (its rename, if the API has one)."""
        alias = cls.model_fields[field].validation_alias
        return alias if isinstance(alias, str) else field

    def path(self, prefix: str, field: str) -> str:
        """Where `field` sits in the request body, as errors name it (prefix: the object holding the fields)."""
        name = self.api_name(field)
        return f"{prefix}.{name}" if prefix else name

    def grammar(self, prefix: str) -> GrammarSpec | None:
        """The output constraint from the API's structured-output fields (each API names its own)."""
        return None

    def to_params(self, vocab_size: int | None, prefix: str, max_new_tokens: int | None, top_logprobs: int | None,
                  **engine: Any) -> SamplingParams:
        """The engine's parameters. max_new_tokens: the API's limit (its default applied); top_logprobs None: no
        logprobs, k: the sampled token's and k alternatives; engine: values the API sets itself (seed, ...)."""
        check_token_ids(self.stop_token_ids or [], vocab_size, self.path(prefix, "stop_token_ids"))
        if self.min_new_tokens is not None and max_new_tokens is not None and self.min_new_tokens > max_new_tokens:
            raise bad_request(f"'{self.path(prefix, 'min_new_tokens')}' ({self.min_new_tokens}) must not exceed the "
                              f"maximum number of tokens ({max_new_tokens})", param=self.path(prefix, "min_new_tokens"))
        given = {name: getattr(self, name) for name in _ENGINE_FIELDS & set(SamplingBody.model_fields) - self._MAPPED
                 if getattr(self, name) is not None}
        return SamplingParams(**{
            **given,
            "max_new_tokens": max_new_tokens,
            "logit_bias": logit_bias_ids(self.logit_bias, vocab_size, self.path(prefix, "logit_bias")),
            "stop": list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "logprobs": top_logprobs is not None,
            "top_logprobs": top_logprobs or 0,
            "grammar": self.grammar(prefix),
            **engine,
        })


_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def renamed_fields(renames: dict[str, str]) -> ConfigDict:
    """A SamplingBody subclass's model_config under which the engine-named fields in `renames` take the API's
    names (only those: the engine's name is then an unknown parameter)."""
    return ConfigDict(alias_generator=AliasGenerator(validation_alias=lambda name: renames.get(name, name)))


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
