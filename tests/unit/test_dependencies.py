"""The dependency rules of docs/architecture.md, read from the source with `ast` (nothing is imported).

Every import statement counts: at module level, inside functions (imported late, but run all the same)
and under `if TYPE_CHECKING:` (a type-only import still ties the two modules together, and such
imports are where cycles hide). Importing a module runs its packages' `__init__` first, so those count
too. Rules:
- the scheduler, tokenizer and http processes never reach torch or app.worker, through any chain of
  app modules (they run without torch; the worker is the one process that loads it);
- app.protocol and app.config import no process package: only each other and third-party packages;
- kernels/ (installed as tokenspeed_kernels) imports nothing from app;
- only the command line (app.cli) imports app.supervisor: no child process reaches the parent's code;
- no import cycle between app modules (a package `__init__` re-exporting its modules aside).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Import name -> folder: `kernels/` is installed under another name (pyproject.toml's package-dir).
PACKAGES = {"app": ROOT / "app", "tokenspeed_kernels": ROOT / "kernels"}
TORCH_FREE = ("app.scheduler", "app.tokenizer", "app.http")
CONFIG_LAYER = ("app.config", "app.protocol")
SUPERVISOR_IMPORTERS = {"app.cli"}


def module_files() -> dict[str, Path]:
    """Every module of our packages by its dotted name (a package by its own name: its __init__)."""
    found: dict[str, Path] = {}
    for top, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = module_files()


def within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def imported_names(path: Path, module: str) -> Iterator[str]:
    """The dotted names each import statement of the file names: `from x import y` gives x.y when y is
    a module of ours, else x; relative imports are resolved against the module's package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def parents(name: str) -> list[str]:
    """The packages Python runs before the module itself: a.b.c -> a, a.b."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def direct_imports(module: str) -> frozenset[str]:
    """What the module names, as written (ours resolved to a module, third-party by its top package)."""
    names = set()
    for name in imported_names(MODULES[module], module):
        names.add(name if name.split(".")[0] in PACKAGES else name.split(".")[0])
    return frozenset(names)


@cache
def runs(module: str) -> frozenset[str]:
    """What importing the module executes: its imports and their packages' __init__s (ours), and the
    third-party top-level packages among them."""
    out = set()
    for name in direct_imports(module):
        out.add(name)
        out.update(p for p in parents(name) if p in MODULES)
    return frozenset(out)


def chain(start: str, bad: str) -> list[str] | None:
    """The shortest chain of imports from start to a module within bad, through our modules; None: none."""
    seen, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for module in frontier:
            for name in sorted(runs(module)):
                if name in seen:
                    continue
                seen[name] = [*seen[module], name]
                if within(name, (bad,)):
                    return seen[name]
                if name in MODULES:
                    nxt.append(name)
        frontier = nxt
    return None


def modules_within(prefixes: Iterable[str]) -> list[str]:
    return [m for m in MODULES if within(m, tuple(prefixes))]


def test_the_source_tree_is_found() -> None:
    """A guard for the rules below: they pass vacuously if the walk finds nothing."""
    assert {"app.scheduler.scheduler", "app.worker.model_runner", "app.config.settings",
            "tokenspeed_kernels.gemv", "app.supervisor"} <= MODULES.keys()  # fmt: skip
    assert "torch" in runs("app.worker.model_runner")
    assert "app.worker.quantization" in runs("app.worker.layers.linear")  # the package of its import, run first


@pytest.mark.parametrize("module", modules_within(TORCH_FREE))
@pytest.mark.parametrize("forbidden", ["torch", "app.worker"])
def test_frontend_processes_never_reach_torch_or_the_worker(module: str, forbidden: str) -> None:
    assert chain(module, forbidden) is None, " -> ".join(chain(module, forbidden) or [])


@pytest.mark.parametrize("module", modules_within(CONFIG_LAYER))
def test_protocol_and_config_import_no_process_package(module: str) -> None:
    ours = {name for name in runs(module) if name.split(".")[0] in PACKAGES and name != "app"}
    assert all(within(name, CONFIG_LAYER) for name in ours), sorted(ours)


@pytest.mark.parametrize("module", modules_within(["tokenspeed_kernels"]))
def test_kernels_import_nothing_from_app(module: str) -> None:
    assert not [name for name in runs(module) if within(name, ("app",))]


def test_only_the_command_line_imports_the_supervisor() -> None:
    importers = {m for m in MODULES if "app.supervisor" in runs(m)}
    assert importers <= SUPERVISOR_IMPORTERS, sorted(importers - SUPERVISOR_IMPORTERS)


def cycles() -> list[list[str]]:
    """Strongly connected groups of our modules over the imports each names (not the implicit package
    __init__s: a package re-exporting its own modules is not a cycle between them)."""
    graph = {m: sorted(n for n in direct_imports(m) if n in MODULES and not within(m, (n,))) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in graph:
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_the_rules_catch_a_break(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above on a made-up tree that breaks each rule once."""
    files = {
        "app/__init__.py": "",
        "app/protocol.py": "from app.scheduler import core\n",
        "app/supervisor.py": "",
        "app/scheduler/__init__.py": "",
        "app/scheduler/core.py": "def f():\n    from app.worker import runner\n",
        "app/worker/__init__.py": "",
        "app/worker/runner.py": "import torch\nfrom app.supervisor import x\nfrom app.worker import cycle\n",
        "app/worker/cycle.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .runner import y\n",
        "kernels/__init__.py": "",
        "kernels/k.py": "from app import protocol\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(f"{__name__}.PACKAGES", {"app": tmp_path / "app", "tokenspeed_kernels": tmp_path / "kernels"})
    monkeypatch.setattr(f"{__name__}.MODULES", module_files())
    direct_imports.cache_clear()
    runs.cache_clear()
    try:
        assert chain("app.scheduler.core", "torch") == ["app.scheduler.core", "app.worker.runner", "torch"]
        assert not all(within(n, CONFIG_LAYER) for n in runs("app.protocol") if n != "app")
        assert "app" in {n.split(".")[0] for n in runs("tokenspeed_kernels.k")}
        assert "app.supervisor" in runs("app.worker.runner")
        assert cycles() == [["app.worker.cycle", "app.worker.runner"]]
    finally:
        direct_imports.cache_clear()
        runs.cache_clear()
