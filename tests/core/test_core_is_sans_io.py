"""The core decides and the shell acts: nothing in ``sfq_proxy.core`` does I/O or reads a clock.

Read from the modules' own source (every ``import``, at any depth), so a lazy import inside
a function is caught too. What a core module may import: the standard library's pure
parts, pydantic (through the config), and other core modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sfq_proxy.core

CORE = Path(sfq_proxy.core.__file__).parent
# I/O, event loops, clocks and randomness: the shell's business, never the core's
FORBIDDEN = {
    "aiohttp", "asyncio", "uvloop", "socket", "ssl", "selectors", "subprocess", "threading",
    "time", "datetime", "random", "secrets", "os", "tempfile", "shutil", "pathlib", "io",
    "logging", "signal", "prometheus_client", "yaml", "http", "urllib",
}  # fmt: skip
SHELL = ("sfq_proxy.http", "sfq_proxy.lab", "sfq_proxy.sim", "sfq_proxy.cli")


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (``from ..http import x`` → sfq_proxy.http.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to sfq_proxy.core
                parts = ["sfq_proxy", "core"][: 3 - node.level]
                base = ".".join([*parts, base] if base else parts)
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
    return found


CORE_MODULES = sorted(CORE.glob("*.py"))


@pytest.mark.parametrize("path", CORE_MODULES, ids=[p.stem for p in CORE_MODULES])
def test_a_core_module_imports_no_io_no_clock_and_nothing_of_the_shell(path: Path) -> None:
    bad = sorted(
        name
        for name in imports_of(path)
        if name.split(".")[0] in FORBIDDEN or name.startswith(SHELL)
    )
    assert not bad, f"{path.name} imports {bad}"


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checker itself can fail: a lazy import, a relative one into the shell, an alias."""
    module = tmp_path / "bad.py"
    module.write_text(
        "import time as clock\n"
        "from ..http.relay import forward\n"
        "def later():\n    from asyncio import sleep\n"
    )
    assert {"time", "sfq_proxy.http.relay", "asyncio"} <= imports_of(module)


def test_there_is_a_core_to_check() -> None:
    assert {"fair_queue", "scheduler", "placement", "errors"} <= {p.stem for p in CORE_MODULES}
