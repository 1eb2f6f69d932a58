"""`tokenspeed config show`: every resolved value with its source; secrets masked."""

from __future__ import annotations

import json
from typing import Any

from app.config import meta
from app.config.loader import Resolved
from app.config.sources import Source

MASK = "********"


def _plain(name: str, value: Any) -> Any:
    """The value as JSON data, with secrets replaced by a mask (None stays None: no key is set)."""
    if value is None:
        return None
    if meta.fields()[name].secret:
        return MASK
    return value


def _label(source: Source) -> str:
    return source.where if source.kind == "default" else f"{source.kind}: {source.where}"


def as_json(resolved: Resolved) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "value": _plain(name, getattr(resolved.settings, name)),
            "source": resolved.sources[name].kind,
            "where": resolved.sources[name].where,
        }
        for name in meta.fields()
    }


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def as_text(resolved: Resolved) -> str:
    values = {name: _text_value(_plain(name, getattr(resolved.settings, name))) for name in meta.fields()}
    name_width = max(len(name) for name in values)
    value_width = min(max(len(v) for v in values.values()), 40)
    lines: list[str] = []
    for group, members in meta.by_group().items():
        lines.append(f"# {group}")
        for m in members:
            source = _label(resolved.sources[m.name])
            lines.append(f"{m.name:<{name_width}}  {values[m.name]:<{value_width}}  [{source}]")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
