"""Structured output: compiling grammars (JSON schema, regex, EBNF, structural tags) with XGrammar.

The tokenizer process compiles a request's GrammarSpec off the step loop (app/tokenizer/grammar.py, through
the bounded cache in cache.py) and ships the compiled grammar, serialized, to the worker, which runs a
matcher per constrained sequence and masks its logits before sampling (app/worker/sampling/grammar.py).
This package imports no torch and no xgrammar at import time: xgrammar loads with the first grammar.
"""

from __future__ import annotations

from app.protocol import GrammarSpec, SamplingParams

JSON_SCHEMA = "json_schema"
JSON_OBJECT = "json_object"
REGEX = "regex"
EBNF = "ebnf"
STRUCTURAL_TAG = "structural_tag"
KINDS = (JSON_SCHEMA, JSON_OBJECT, REGEX, EBNF, STRUCTURAL_TAG)


class GrammarError(ValueError):
    """A grammar that cannot be compiled (the compiler's message), or one that does not fit the request."""


def check_request(spec: GrammarSpec, sampling: SamplingParams) -> str | None:
    """Why a grammar cannot constrain a request with these parameters, or None.

    ignore_eos and min_new_tokens would force tokens past the point where the grammar accepts only EOS:
    every token would be masked."""
    where = spec.param or "grammar"
    if spec.kind not in KINDS:
        return f"invalid value for '{where}': unknown grammar kind {spec.kind!r} (one of {', '.join(KINDS)})"
    if spec.kind != JSON_OBJECT and not spec.value:
        return f"invalid value for '{where}': the {spec.kind} must not be empty"
    if sampling.ignore_eos:
        return f"'ignore_eos' cannot be combined with '{where}': the output ends where the grammar does"
    if sampling.min_new_tokens:
        return f"'min_tokens' cannot be combined with '{where}': the output ends where the grammar does"
    return None


def cache_key(spec: GrammarSpec) -> tuple[str, str]:
    """What a compiled grammar is cached by: its kind and text (the value of json_object does not matter)."""
    return (spec.kind, "" if spec.kind == JSON_OBJECT else spec.value)
