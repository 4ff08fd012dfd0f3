"""Imports go one way: no two modules of ``mesh_hicache``, nor two of the bundled
``runtime``, import each other (also not under ``TYPE_CHECKING`` or inside a function),
and no module of the library imports the runtime."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules(package: str = "mesh_hicache") -> dict[str, Path]:
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize(
    ("package", "known"), [("mesh_hicache", "radix.eviction"), ("runtime", "server.main")]
)
def test_no_two_modules_import_each_other(package: str, known: str) -> None:
    modules = _modules(package)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph = {name: _imports(path, modules) & modules.keys() for name, path in modules.items()}
    assert f"{package}.{known}" in graph  # the walk found the package
    pairs = sorted(
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a < b and a in graph[b] and not {a, b} & packages
    )
    assert pairs == []


def test_the_library_never_imports_the_runtime() -> None:
    modules = _modules()
    users = [
        n for n, p in modules.items() if any(i.startswith("runtime") for i in _imports(p, modules))
    ]
    assert users == []
