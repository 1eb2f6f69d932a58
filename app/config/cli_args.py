"""The serve command line, generated from the Settings fields so flags and fields never drift.

`MODEL` may be positional or `--model`/`--model-path` (not both). Booleans take `--x`, `--x true|false`
or `--no-x`. List parameters take several values (`--cudagraph-capture-sizes 1 2 4`, or `1,2,4`);
JSON parameters take a JSON object string (parsed here, so a syntax error names the flag). Other
values stay strings: the model converts and checks them, and the loader names the flag in any error.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from app.config import meta, support
from app.config.errors import ConfigError
from app.config.names import flag_of
from app.config.sources import Entry, Source, parse_json_object, put, split_list, suggest

BOOL_WORDS = frozenset({"true", "false", "1", "0", "yes", "no", "on", "off"})
POSITIONAL_MODEL = "the positional MODEL argument"
_GIVEN = "_given"  # namespace attribute collecting {field: Entry}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


class _Record(argparse.Action):
    """Records a setting's raw value and the option string that gave it."""

    def __init__(self, option_strings: list[str], dest: str, *, field: str, fixed: Any = None, **kw: Any):
        self.field = field
        self.fixed = fixed  # the value of a flag that takes none (--no-x: False)
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        where = option_string or flag_of(self.field)
        kind = meta.fields()[self.field].kind
        if self.fixed is not None:
            value = self.fixed
        elif kind == "list":
            value = split_list(values)
        elif kind == "json":
            value = parse_json_object(values, where)
        else:
            value = values
        put(namespace.__dict__.setdefault(_GIVEN, {}), self.field, Entry(value, Source("cli", where)))


@dataclass(frozen=True)
class CommandLine:
    entries: dict[str, Entry]
    config: str | None  # --config FILE
    namespace: argparse.Namespace  # for extra options a command adds (config show --json)


def _help(m: meta.FieldMeta) -> str:
    text = m.purpose
    if not m.required and m.default not in (None, {}, []):
        shown = " ".join(map(str, m.default)) if isinstance(m.default, list) else m.default
        text += f" [default: {str(shown).lower() if isinstance(shown, bool) else shown}]"
    rule = support.BY_FIELD.get(m.name)
    if rule is not None:
        text += f" [this build supports: {rule.summary}]"
    if m.origin == "appliance":
        text += " [appliance setting, beyond the seed]"
    return text.replace("%", "%%")


def _metavar(m: meta.FieldMeta) -> str:
    if m.choices:
        return "{" + ",".join(str(c) for c in m.choices) + "}"
    if m.kind == "json":
        return "JSON"
    item = typing.get_args(m.annotation)[0] if m.kind == "list" else m.annotation
    return {int: "N", float: "X"}.get(item, "VALUE")


def _add_field(group: argparse._ArgumentGroup, m: meta.FieldMeta) -> None:
    options = [m.flag, *(flag_of(alias) for alias in m.aliases)]
    dest = f"_field_{m.name}"
    if m.kind == "bool":
        group.add_argument(*options, action=_Record, field=m.name, dest=dest, nargs="?", const="true",
                           metavar="true|false", help=_help(m))
        group.add_argument(flag_of(f"no_{m.name}"), action=_Record, field=m.name, fixed=False, dest=dest,
                           nargs=0, help=f"Same as {m.flag} false.")
        return
    metavar = _metavar(m)
    nargs = "+" if m.kind == "list" else None
    group.add_argument(*options, action=_Record, field=m.name, dest=dest, nargs=nargs, metavar=metavar,
                       help=_help(m))


def build_parser(prog: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
                 ) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog, usage=f"{prog} [MODEL] [options]", allow_abbrev=False,
        description="Precedence, highest first: these flags, TOKENSPEED_<PARAMETER> environment variables, "
        "the recipe (--config or TOKENSPEED_CONFIG), the defaults.",
    )
    parser.add_argument("model_positional", nargs="?", metavar="MODEL",
                        help="Model path or Hugging Face repo ID (same as --model).")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="Recipe YAML file (also TOKENSPEED_CONFIG); flags and environment override it.")
    if extra is not None:
        extra(parser)
    for title, members in meta.by_group().items():
        group = parser.add_argument_group(title)
        for m in members:
            _add_field(group, m)
    return parser


def _normalise_bools(argv: Sequence[str], bool_flags: set[str]) -> list[str]:
    """`--x` -> `--x=true` and `--x false` -> `--x=false`, so a bool flag never swallows the MODEL."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in bool_flags:
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is not None and following.lower() in BOOL_WORDS:
                out.append(f"{token}={following}")
                i += 2
                continue
            token = f"{token}=true"
        out.append(token)
        i += 1
    return out


def parse_command_line(argv: Sequence[str], parser: argparse.ArgumentParser) -> CommandLine:
    fields = meta.fields()
    bool_flags = {flag_of(name) for name, m in fields.items() if m.kind == "bool"}
    # The positional is taken from the leftovers: argparse would bind an optional positional to
    # nothing when flags come first, then refuse the MODEL given after them.
    namespace, rest = parser.parse_known_args(_normalise_bools(argv, bool_flags))
    given: dict[str, Entry] = namespace.__dict__.pop(_GIVEN, {})
    flags = [t for t in rest if t.startswith("-") and t != "-"]
    if flags:
        known = [o for action in parser._actions for o in action.option_strings]
        name = flags[0].split("=", 1)[0]
        raise ConfigError(f"unknown flag {name}" + suggest(name, known))
    positionals = ([namespace.model_positional] if namespace.model_positional is not None else []) + rest
    if len(positionals) > 1:
        raise ConfigError(f"unexpected argument(s) {' '.join(positionals[1:])}: only one MODEL may be given")
    if positionals:
        if "model" in given:
            raise ConfigError(
                f"the model is given twice: as {POSITIONAL_MODEL} ({positionals[0]}) and by "
                f"{given['model'].source.where} ({given['model'].value}); give it once")
        given["model"] = Entry(positionals[0], Source("cli", POSITIONAL_MODEL))
    return CommandLine(entries=given, config=namespace.config, namespace=namespace)
