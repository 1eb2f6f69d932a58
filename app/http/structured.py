"""Structured-output request fields -> one GrammarSpec (app/grammar compiles it in the tokenizer process).

OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
"strict", "description"}}. vLLM's clients: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
or `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag"}.
SGLang's /generate: `sampling_params.json_schema` | `regex` | `ebnf` | `structural_tag`. One constraint a
request: two are refused, naming both. Only the shape is checked here; whether the schema, regex or grammar
compiles is the compiler's answer (a 400 naming the same field).
"""

from __future__ import annotations

import json
from typing import Any

from app.grammar import EBNF, JSON_OBJECT, JSON_SCHEMA, REGEX, STRUCTURAL_TAG
from app.http.errors import bad_request
from app.protocol import GrammarSpec

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_STRUCTURED_OUTPUTS = {"json": JSON_SCHEMA, "regex": REGEX, "choice": EBNF, "grammar": EBNF,
                       "json_object": JSON_OBJECT, "structural_tag": STRUCTURAL_TAG}
# vLLM's structured_outputs options that change nothing here when left at their defaults.
_STRUCTURED_DEFAULTS = {"disable_fallback": False, "disable_any_whitespace": False,
                        "disable_additional_properties": False, "whitespace_pattern": None}


def openai_grammar(response_format: Any, guided: dict[str, Any], structured_outputs: Any) -> GrammarSpec | None:
    """The constraint of an OpenAI request (chat or completions), or None. guided: vLLM's guided_* fields."""
    specs = [spec for spec in (
        _response_format(response_format),
        *(_guided(name, value) for name, value in guided.items() if value is not None),
        *_structured_outputs(structured_outputs),
    ) if spec is not None]
    return _one(specs)


def native_grammar(fields: dict[str, Any], param: str) -> GrammarSpec | None:
    """The constraint of /generate sampling params: json_schema, regex, ebnf or structural_tag."""
    specs = []
    for name, value in fields.items():
        if value is None:
            continue
        where = f"{param}.{name}"
        if name == "json_schema":
            specs.append(GrammarSpec(JSON_SCHEMA, _schema_text(value, where), where))
        elif name == "structural_tag":
            specs.append(GrammarSpec(STRUCTURAL_TAG, _schema_text(value, where), where))
        else:
            specs.append(GrammarSpec(REGEX if name == "regex" else EBNF, _text(value, where), where))
    return _one(specs)


def choice_grammar(choices: Any, where: str) -> str:
    """EBNF whose only sentences are the given strings (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"invalid value for '{where}': must be a non-empty list of non-empty strings", param=where)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _RESPONSE_FORMATS:
        raise bad_request(f"invalid value for 'response_format.type': must be one of {', '.join(_RESPONSE_FORMATS)}",
                          param="response_format.type")
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        name = sorted(extra)[0] if extra else "json_schema"
        raise bad_request(f"unknown field 'response_format.{name}' for type '{kind}'", param=f"response_format.{name}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(JSON_OBJECT, "", "response_format")
    return GrammarSpec(JSON_SCHEMA, *_openai_schema(value.get("json_schema")))


def _openai_schema(value: Any) -> tuple[str, str]:
    where = "response_format.json_schema"
    if not isinstance(value, dict):
        raise bad_request(f"missing or invalid '{where}': an object with 'name' and 'schema'", param=where)
    unknown = set(value) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"unknown field '{where}.{sorted(unknown)[0]}'", param=f"{where}.{sorted(unknown)[0]}")
    name = value.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise bad_request(f"invalid value for '{where}.name': a string of 1 to 64 characters", param=f"{where}.name")
    if value.get("strict") not in (None, True, False):
        raise bad_request(f"invalid value for '{where}.strict': must be a boolean", param=f"{where}.strict")
    if "schema" not in value:
        raise bad_request(f"missing '{where}.schema': the JSON schema the output must follow", param=f"{where}.schema")
    return _schema_text(value["schema"], f"{where}.schema"), f"{where}.schema"


def _guided(name: str, value: Any) -> GrammarSpec:
    if name == "guided_json":
        return GrammarSpec(JSON_SCHEMA, _schema_text(value, name), name)
    if name == "guided_choice":
        return GrammarSpec(EBNF, choice_grammar(value, name), name)
    return GrammarSpec(REGEX if name == "guided_regex" else EBNF, _text(value, name), name)


def _structured_outputs(value: Any) -> list[GrammarSpec]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise bad_request("invalid value for 'structured_outputs': must be an object", param="structured_outputs")
    specs = []
    for key, item in value.items():
        where = f"structured_outputs.{key}"
        if key in _STRUCTURED_DEFAULTS:
            if item != _STRUCTURED_DEFAULTS[key]:
                raise bad_request(f"'{where}' is not supported: this server's JSON output is compact", param=where)
            continue
        if key not in _STRUCTURED_OUTPUTS:
            raise bad_request(f"unknown field '{where}' (one of {', '.join(_STRUCTURED_OUTPUTS)})", param=where)
        if item is None or item is False:
            continue
        kind = _STRUCTURED_OUTPUTS[key]
        if key == "json_object":
            specs.append(GrammarSpec(JSON_OBJECT, "", where))
        elif key == "choice":
            specs.append(GrammarSpec(EBNF, choice_grammar(item, where), where))
        elif kind in (JSON_SCHEMA, STRUCTURAL_TAG):
            specs.append(GrammarSpec(kind, _schema_text(item, where), where))
        else:
            specs.append(GrammarSpec(kind, _text(item, where), where))
    return specs


def _schema_text(value: Any, where: str) -> str:
    """A JSON schema given as an object (or as JSON text) -> its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"invalid value for '{where}': not valid JSON: {exc}", param=where) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"invalid value for '{where}': a JSON schema must be an object", param=where)
    return json.dumps(value)


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"invalid value for '{where}': must be a non-empty string", param=where)
    return value


def _one(specs: list[GrammarSpec]) -> GrammarSpec | None:
    if len(specs) > 1:
        raise bad_request(f"'{specs[0].param}' and '{specs[1].param}' cannot be combined: a request takes one "
                          "output constraint", param=specs[1].param)
    return specs[0] if specs else None
