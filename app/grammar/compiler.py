"""XGrammar behind one small interface: the tokenizer's vocabulary as XGrammar sees it, compiling a
GrammarSpec, and (de)serializing compiled grammars so they cross from the tokenizer to the worker.

Both processes build the TokenizerInfo the same way (tokenizer_info below, from the engine's vocabulary
size and EOS ids): a serialized grammar carries the vocabulary's metadata and deserializes only against
an equal one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from app.grammar import EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, STRUCTURAL_TAG, GrammarError
from app.protocol import GrammarSpec

# JSON output is compact (one space after ',' and ':', no newlines): with XGrammar's any-whitespace JSON
# a model may loop on whitespace until max_tokens and never close the value (seen with SmolLM2-135M).
JSON_SEPARATORS = (", ", ": ")


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """XGrammar's view of `tokenizer`, over the model's `vocab_size` logits (ids the tokenizer does not
    have are never allowed) with the engine's EOS ids as the tokens that end a complete output."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))


class Compiler:
    """Compiles GrammarSpecs for one vocabulary. XGrammar's own cache is off: app/grammar/cache.py keeps
    the serialized outcomes (bounded), and the compiler's threads are the caller's to choose."""

    def __init__(self, info: Any, max_threads: int = 1) -> None:
        import xgrammar as xgr

        self.info = info
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        """The CompiledGrammar of `spec`; GrammarError with the compiler's message (naming spec.param)."""
        try:
            return self._compile(spec)
        except GrammarError:
            raise
        except Exception as exc:  # XGrammar raises RuntimeError / ValueError with a parser message
            where = spec.param or "grammar"
            raise GrammarError(f"invalid value for '{where}': {_message(exc)}") from None

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self._compiler
        if spec.kind == JSON_SCHEMA:
            return c.compile_json_schema(_json_text(spec), any_whitespace=False, separators=JSON_SEPARATORS,
                                         strict_mode=True)
        if spec.kind == JSON_OBJECT:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS,
                                         strict_mode=False)
        if spec.kind == REGEX:
            return c.compile_regex(spec.value)
        if spec.kind == EBNF:
            return c.compile_grammar(spec.value)
        if spec.kind == STRUCTURAL_TAG:
            return c.compile_structural_tag(_json_text(spec))
        raise GrammarError(f"invalid value for '{spec.param or 'grammar'}': unknown grammar kind {spec.kind!r}")

    def serialize(self, compiled: Any) -> str:
        return compiled.serialize_json()

    def deserialize(self, text: str) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(text, self.info)


def _json_text(spec: GrammarSpec) -> str:
    """The value as JSON text, refused (naming the field) if it is not JSON."""
    try:
        json.loads(spec.value)
    except ValueError as exc:
        raise GrammarError(f"invalid value for '{spec.param or 'grammar'}': not valid JSON: {exc}") from None
    return spec.value


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[02:13:40] /project/cpp/regex_converter.cc:83: "


def _message(exc: Exception) -> str:
    """XGrammar's message without its time stamp and C++ source location."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return _SOURCE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
