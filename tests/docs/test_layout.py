"""The package reads top down (docs/design.md §1, Packages): a module imports from its own
subpackage and from those below it, never from one above; no modules import each other in
a circle; no module is too long to read (the Lua functions aside). Read from the code's
own imports, so a move that breaks the layering fails here."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sfq_proxy"
# bottom up; the modules at the package's top (cli.py, keys_cli.py) stand above them all
LAYERS = ["config", "core", "state", "observability", "http", "runner", "sim", "lab"]
MAX_LINES = 650


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports, at its top or inside a function (an
    import under TYPE_CHECKING too: it is an arrow of the picture all the same)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def _layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_module_imports_from_a_package_above_its_own() -> None:
    assert len(GRAPH) > 60  # the modules were read
    assert sum(map(len, GRAPH.values())) > 150  # and their imports
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if _layer(target) > _layer(name)
    )
    assert upward == []


def test_no_modules_import_each_other_in_a_circle() -> None:
    try:
        TopologicalSorter(GRAPH).prepare()
    except CycleError as err:
        raise AssertionError(f"a circle: {' -> '.join(err.args[1])}") from None


def test_no_module_is_over_the_length_one_reads() -> None:
    long = {
        name: n for name, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_subpackage_has_its_place_in_the_layers() -> None:
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS)


def test_test_modules_have_names_of_their_own() -> None:
    """tests/ mirrors the package, one folder a subpackage, with no ``__init__.py``: pytest
    imports each test module by its name alone, so two of one name in two folders would not
    both run (the second fails to collect)."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert len(names) > 100
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
