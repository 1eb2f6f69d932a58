#!/usr/bin/env python3
"""Print the pinned runtime requirements of pyproject.toml (plus chosen extras), one per line.

The image installs these in a layer of their own before it copies the source, so a code change
does not reinstall torch. Standard library only: it runs in the bare build stage.

    python3 docker/requirements.py pyproject.toml [EXTRA[,EXTRA...]]   (empty: no extras)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {', '.join(unknown)}; pyproject.toml has {', '.join(sorted(optional))}")
    return [*project["dependencies"], *(req for extra in extras for req in optional[extra])]


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: requirements.py PYPROJECT [EXTRA[,EXTRA...]]")
    extras = [extra.strip() for arg in argv[1:] for extra in arg.split(",") if extra.strip()]
    print("\n".join(requirements(Path(argv[0]), extras)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
