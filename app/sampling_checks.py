"""Checks of SamplingParams against what the samplers can honour (torch-free: the HTTP layer may call it).

The checks are about meaning, not API policy: OpenAI's ranges (penalties in [-2, 2], logit bias in
[-100, 100], at most 20 top logprobs) belong to the HTTP layer; here a value is refused only when no
sampler could honour it (a negative temperature, a token id outside the vocabulary, ...).
"""

from __future__ import annotations

import math

from app.protocol import SamplingParams


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_truncation(p: SamplingParams) -> str | None:
    if not _is_real(p.temperature) or p.temperature < 0:
        return f"temperature must be a finite number >= 0, got {p.temperature!r}"
    if not _is_real(p.top_p) or not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p!r}"
    if not _is_int(p.top_k) or (p.top_k != -1 and p.top_k < 1):
        return f"top_k must be -1 (disabled) or an integer >= 1, got {p.top_k!r}"
    if not _is_real(p.min_p) or not 0 <= p.min_p <= 1:
        return f"min_p must be in [0, 1], got {p.min_p!r}"
    return None


def _check_penalties(p: SamplingParams) -> str | None:
    for name in ("presence_penalty", "frequency_penalty"):
        if not _is_real(getattr(p, name)):
            return f"{name} must be a finite number, got {getattr(p, name)!r}"
    if not _is_real(p.repetition_penalty) or p.repetition_penalty <= 0:
        return f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}"
    return None


def _check_token_ids(p: SamplingParams, vocab_size: int) -> str | None:
    for token, bias in p.logit_bias.items():
        if not _is_int(token) or not 0 <= token < vocab_size:
            return f"logit_bias key {token!r} is not a token id in [0, {vocab_size})"
        if not _is_real(bias):
            return f"logit_bias value for token {token} must be a finite number, got {bias!r}"
    for token in p.stop_token_ids:
        if not _is_int(token) or not 0 <= token < vocab_size:
            return f"stop_token_ids entry {token!r} is not a token id in [0, {vocab_size})"
    return None


def _check_rest(p: SamplingParams, vocab_size: int) -> str | None:
    if not _is_int(p.min_new_tokens) or p.min_new_tokens < 0:
        return f"min_new_tokens must be an integer >= 0, got {p.min_new_tokens!r}"
    if p.seed is not None and not _is_int(p.seed):
        return f"seed must be an integer, got {p.seed!r}"
    if not _is_int(p.top_logprobs) or not 0 <= p.top_logprobs <= vocab_size:
        return f"top_logprobs must be an integer in [0, {vocab_size}], got {p.top_logprobs!r}"
    if p.top_logprobs and not p.logprobs:
        return "top_logprobs requires logprobs"
    return None


def check_params(params: SamplingParams, vocab_size: int) -> str | None:
    """The first reason `params` cannot be sampled over a vocabulary of `vocab_size`, or None."""
    return (
        _check_truncation(params)
        or _check_penalties(params)
        or _check_token_ids(params, vocab_size)
        or _check_rest(params, vocab_size)
    )


# Fields the greedy backend does not implement, with the value that means "off".
_GREEDY_UNSUPPORTED: dict[str, object] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}


def check_greedy_params(params: SamplingParams, vocab_size: int) -> str | None:
    """check_params plus the limits of the argmax-only backend."""
    error = check_params(params, vocab_size)
    if error:
        return error
    if not params.greedy:
        return (
            "sampling backend 'greedy' supports only greedy decoding (temperature 0), "
            f"got temperature={params.temperature}"
        )
    for name, off in _GREEDY_UNSUPPORTED.items():
        if getattr(params, name) != off:
            return f"sampling backend 'greedy' does not implement {name}"
    if params.logit_bias:
        return "sampling backend 'greedy' does not implement logit_bias"
    return None


# --sampling-backend values this build implements (None: portable torch). flashinfer keeps every
# semantic of the portable sampler, so it validates like it.
BACKENDS = (None, "greedy", "flashinfer")


def unknown_backend(backend: object) -> str:
    return (
        f"unknown sampling backend {backend!r}: this build implements the portable torch sampler "
        "(no backend given), 'greedy' and 'flashinfer'"
    )


def check_for_backend(backend: str | None, params: SamplingParams, vocab_size: int) -> str | None:
    """What validate() of make_sampler(backend, ...) answers, without building a sampler (or torch)."""
    if backend not in BACKENDS:
        raise ValueError(unknown_backend(backend))
    check = check_greedy_params if backend == "greedy" else check_params
    return check(params, vocab_size)
