"""The parameter reference in docs/configuration.md, generated from the Settings model.

`python -m app.config.reference` rewrites the generated part of the page; a test fails when the page
and the model disagree, so the reference never drifts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from app.config import meta, support
from app.config.settings import DERIVED_FROM

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = "<!-- BEGIN GENERATED PARAMETER REFERENCE (python -m app.config.reference) -->"
END = "<!-- END GENERATED PARAMETER REFERENCE -->"


def _default(m: meta.FieldMeta) -> str:
    if m.required:
        return "required"
    if m.name in DERIVED_FROM:
        return f"= {DERIVED_FROM[m.name]}"
    if m.default is None:
        return "unset"
    return f"`{json.dumps(m.default)}`" if not isinstance(m.default, str) else f"`{m.default}`"


def _support(m: meta.FieldMeta) -> str:
    rule = support.BY_FIELD.get(m.name)
    if rule is None:
        return "yes"
    if rule.summary == support.show(m.default):
        return "not yet (default only)"
    return f"only {rule.summary}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _names(m: meta.FieldMeta) -> str:
    names = [m.flag, *(f"--{a.replace('_', '-')}" for a in m.aliases)]
    if m.kind == "bool":
        names.append(m.flag.replace("--", "--no-", 1))
    if m.name == "model":
        return "`MODEL` (positional), " + ", ".join(f"`{n}`" for n in names)
    return ", ".join(f"`{n}`" for n in names)


def render() -> str:
    """The generated reference: one table per seed group."""
    out = [BEGIN, ""]
    for group, members in meta.by_group().items():
        out += [f"### {group}", "", "| Parameter | Env var | Default | This build | Purpose |", "|---|---|---|---|---|"]
        for m in members:
            purpose = m.purpose + (" *(appliance setting, beyond the seed)*" if m.origin == "appliance" else "")
            out.append(f"| {_names(m)} | `{m.env}` | {_cell(_default(m))} | {_cell(_support(m))} | {_cell(purpose)} |")
        out.append("")
    out.append(END)
    return "\n".join(out)


def embedded(page: str) -> str:
    """The generated part of a page (between the markers)."""
    start, end = page.index(BEGIN), page.index(END) + len(END)
    return page[start:end]


def rewrite(page: str) -> str:
    return page.replace(embedded(page), render())


def main() -> int:
    DOC.write_text(rewrite(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
