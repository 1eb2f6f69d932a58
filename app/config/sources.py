"""The layers a configuration is built from, each value tagged with where it came from.

Precedence, highest first: CLI flags, `TOKENSPEED_*` environment variables, the recipe YAML
(`--config FILE` or `TOKENSPEED_CONFIG`), the model's defaults. This module reads the environment
and the recipe; `cli_args` reads the command line; `loader` merges and validates.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from app.config import meta
from app.config.errors import ConfigError
from app.config.names import ALIASES, CONFIG_ENV, ENV_PREFIX, NON_SETTING_ENV_VARS, env_of, key_of

SourceKind = Literal["default", "file", "env", "cli"]


@dataclass(frozen=True)
class Source:
    kind: SourceKind
    where: str  # "--max-num-seqs", "TOKENSPEED_MAX_NUM_SEQS", "configs/x.yaml: max_num_seqs", "default"


@dataclass(frozen=True)
class Entry:
    value: Any
    source: Source


def closest(word: str, candidates: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.75)
    return close[0] if close else None


def suggest(word: str, candidates: Iterable[str]) -> str:
    """" (did you mean X?)" when a candidate is close to the misspelt word, else ""."""
    match = closest(word, candidates)
    return f" (did you mean {match}?)" if match else ""


def put(layer: dict[str, Entry], name: str, entry: Entry) -> None:
    """Add a value to a layer; two spellings of one setting in one place must agree."""
    previous = layer.get(name)
    if previous is not None and previous.source.where != entry.source.where and previous.value != entry.value:
        raise ConfigError(
            f"{previous.source.where} and {entry.source.where} set the same parameter ({name}) to different "
            f"values ({_show(previous.value)} and {_show(entry.value)}); give it once"
        )
    layer[name] = entry


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else repr(value)


# ---------------------------------------------------------------- text values (CLI and env)


def parse_json_object(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a JSON object, got {text!r}")
    return value


def split_list(items: Iterable[str]) -> list[str]:
    """Several values, each of which may itself be comma-separated: `1 2,4` -> ['1', '2', '4']."""
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def env_value(kind: meta.Kind, text: str, where: str) -> Any:
    if kind == "json":
        return parse_json_object(text, where)
    if kind == "list":
        if text.lstrip().startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not a valid JSON list ({exc}): {text!r}") from None
            if not isinstance(value, list):
                raise ConfigError(f"{where}: must be a JSON list or comma-separated values, got {text!r}")
            return value
        return split_list([text])
    return text


# ---------------------------------------------------------------- environment


def env_layer(environ: Mapping[str, str]) -> dict[str, Entry]:
    """Every TOKENSPEED_<FIELD> variable; an unknown TOKENSPEED_* name is an error. Empty values count
    as unset, so `TOKENSPEED_API_KEY=` in a compose file means "no key"."""
    layer: dict[str, Entry] = {}
    unknown: list[str] = []
    fields = meta.fields()
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX) or var in NON_SETTING_ENV_VARS:
            continue
        spelling = var[len(ENV_PREFIX):]
        name = meta.canonical(spelling.lower()) if spelling == spelling.upper() else None
        if name is None:
            match = closest(spelling.lower(), [*fields, *ALIASES])
            unknown.append(var + (f" (did you mean {env_of(match)}?)" if match else ""))
            continue
        if environ[var] == "":
            continue
        where = var
        put(layer, name, Entry(env_value(fields[name].kind, environ[var], where), Source("env", where)))
    if unknown:
        raise ConfigError(
            f"unknown TOKENSPEED_* environment variable{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
            f"(settings are TOKENSPEED_<PARAMETER>, e.g. TOKENSPEED_MAX_NUM_SEQS)"
        )
    return layer


def config_from_env(environ: Mapping[str, str]) -> str | None:
    return environ.get(CONFIG_ENV) or None


# ---------------------------------------------------------------- recipe YAML


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader that refuses duplicate keys instead of silently keeping the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)) or key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate or invalid key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_recipe(path: str, named_by: str) -> Any:
    """The parsed YAML document; `named_by` (--config or TOKENSPEED_CONFIG) is blamed if it is missing."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{named_by}: recipe file not found: {path}")
    try:
        return yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None


def file_layer(path: str, named_by: str) -> dict[str, Entry]:
    """Settings from a recipe: a flat mapping whose keys are snake_case or kebab-case parameter names;
    JSON-valued parameters are written as mappings."""
    document = read_recipe(path, named_by)
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of parameter names to values")
    layer: dict[str, Entry] = {}
    fields = meta.fields()
    for key, value in document.items():
        name = meta.canonical(key_of(key)) if isinstance(key, str) else None
        if name is None:
            raise ConfigError(f"{path}: {key}: unknown key" + suggest(key_of(str(key)), [*fields, *ALIASES]))
        where = f"{path}: {key}"
        if fields[name].kind == "json" and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: must be a mapping, got {value!r}")
        put(layer, name, Entry(value, Source("file", where)))
    return layer
