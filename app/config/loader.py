"""Merge the layers (CLI > env > recipe > defaults), validate once, and name the source of any error."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from app.config import meta
from app.config.cli_args import CommandLine, build_parser, parse_command_line
from app.config.errors import ConfigError, Problem, SettingsProblems
from app.config.names import CONFIG_ENV, flag_of
from app.config.settings import DERIVED_FROM, Settings
from app.config.sources import Entry, Source, config_from_env, env_layer, file_layer

SERVE_PROG = "tokenspeed serve"


@dataclass(frozen=True)
class Resolved:
    settings: Settings
    sources: dict[str, Source]  # every field: where its value came from


def load_settings(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings for `tokenspeed serve ARGV` in environment `environ` (default: os.environ).
    `argv` are the serve arguments, e.g. ["my-model", "--max-num-seqs", "8"]; None means no flags.
    Raises ConfigError naming the offending key and its source."""
    return resolve_with_sources(argv, environ).settings


def resolve_with_sources(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
                         ) -> Resolved:
    """Like load_settings, and also where each value came from (for `config show`)."""
    return resolve(parse_command_line(list(argv or []), build_parser(SERVE_PROG)), environ)


def resolve(command_line: CommandLine, environ: Mapping[str, str] | None = None) -> Resolved:
    environ = os.environ if environ is None else environ
    env = env_layer(environ)
    recipe: dict[str, Entry] = {}
    if command_line.config is not None:
        recipe = file_layer(command_line.config, "--config")
    elif (path := config_from_env(environ)) is not None:
        recipe = file_layer(path, CONFIG_ENV)
    merged = {**recipe, **env, **command_line.entries}
    settings = _validate(merged)
    return Resolved(settings, {name: _source(name, merged) for name in meta.fields()})


def _source(name: str, merged: dict[str, Entry]) -> Source:
    if name in merged:
        return merged[name].source
    if name in DERIVED_FROM:
        return Source("default", f"default (follows {DERIVED_FROM[name]})")
    return Source("default", "default")


def _validate(merged: dict[str, Entry]) -> Settings:
    try:
        return Settings(**{name: entry.value for name, entry in merged.items()})
    except SettingsProblems as exc:
        raise ConfigError(_join([_problem_line(p, merged) for p in exc.problems])) from None
    except ValidationError as exc:
        raise ConfigError(_join([_error_line(e, merged) for e in exc.errors()])) from None


def _join(lines: list[str]) -> str:
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} configuration errors:\n" + "\n".join(f"  - {line}" for line in lines)


def _where(name: str, merged: dict[str, Entry]) -> str:
    return merged[name].source.where if name in merged else "default"


def _problem_line(problem: Problem, merged: dict[str, Entry]) -> str:
    if len(problem.fields) == 1:
        return f"{problem.text} (set by {_where(problem.fields[0], merged)})"
    origins = "; ".join(
        f"{flag_of(name)}: " + (f"set by {merged[name].source.where}" if name in merged else "default")
        for name in problem.fields
    )
    return f"{problem.text} ({origins})"


def _error_line(error: Any, merged: dict[str, Entry]) -> str:
    name = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "missing" and name == "model":
        return ("no model given: pass it as the positional MODEL argument, --model, TOKENSPEED_MODEL, or "
                "`model:` in the recipe")
    where = _where(name, merged)
    for part in error["loc"][1:]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    got = "" if error["type"] == "missing" else f" (got {_shown_input(name, error['input'])})"
    return f"{where}: {error['msg']}{got}"


def _shown_input(name: str, value: Any) -> str:
    fields = meta.fields()
    if name in fields and fields[name].secret:
        return "<hidden>"
    return repr(value)
