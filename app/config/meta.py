"""What the loaders, the CLI and the docs need to know about each field, read off the model."""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pydantic import SecretStr
from pydantic_core import PydanticUndefined

from app.config.names import ALIASES, env_of, flag_of
from app.config.settings import GROUPS, Settings

# How a raw string (CLI or env) becomes a value: bool words, JSON objects, lists, or a plain scalar.
Kind = Literal["bool", "json", "list", "scalar"]


@dataclass(frozen=True)
class FieldMeta:
    name: str
    kind: Kind
    annotation: Any  # the type without Optional
    group: str
    origin: str  # "seed" or "appliance"
    purpose: str
    required: bool
    default: Any
    choices: tuple[Any, ...] | None  # the Literal values, if any
    secret: bool

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    @property
    def env(self) -> str:
        return env_of(self.name)

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(alias for alias, target in ALIASES.items() if target == self.name)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _kind(annotation: Any) -> Kind:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return "bool"
    if origin is dict:
        return "json"
    if origin is list:
        return "list"
    return "scalar"


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


@cache
def fields() -> dict[str, FieldMeta]:
    """Every setting, in declaration order (which follows the seed's groups)."""
    out: dict[str, FieldMeta] = {}
    for name, info in Settings.model_fields.items():
        annotation = _strip_optional(info.annotation)
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        default = info.default_factory() if info.default_factory is not None else info.default
        out[name] = FieldMeta(
            name=name,
            kind=_kind(annotation),
            annotation=annotation,
            group=str(extra["group"]),
            origin=str(extra["origin"]),
            purpose=info.description or "",
            required=info.is_required(),
            default=None if default is PydanticUndefined else default,
            choices=_choices(annotation),
            secret=annotation is SecretStr,
        )
    return out


def by_group() -> dict[str, list[FieldMeta]]:
    grouped: dict[str, list[FieldMeta]] = {group: [] for group in GROUPS}
    for meta in fields().values():
        grouped[meta.group].append(meta)
    return grouped


def canonical(spelling: str) -> str | None:
    """The field a field-style name (or alias) refers to, or None if it is not a setting."""
    name = ALIASES.get(spelling, spelling)
    return name if name in fields() else None
