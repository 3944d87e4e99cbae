"""The README's commands as a newcomer types them at the repository's root: the command it
names is the one `make` installs in `.venv`, its five-minute config passes `check-config`
with the keys its `export` line sets, each `sfq-proxy` and `make` command it shows exists,
and its Python snippet reads the variables that line exports. (Serving that config would
listen on port 8080 and call 10.0.0.x: tests/runner/test_serve.py serves real configs.)"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMAND = ".venv/bin/sfq-proxy"  # as the README writes it
# the console script beside the interpreter that runs the tests: .venv's own under `make`
INSTALLED = Path(sys.executable).parent / "sfq-proxy"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.MULTILINE | re.DOTALL)


def shell_lines() -> list[str]:
    """Each command of the README's sh blocks, its trailing comment and continuations gone."""
    text = "\n".join(blocks("sh")).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip()]


def exported() -> dict[str, str]:
    [line] = [line for line in shell_lines() if line.startswith("export ")]
    return dict(word.split("=", 1) for word in line.split()[1:])


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})},
        timeout=60, check=False,
    )  # fmt: skip


def test_the_command_it_names_is_the_one_make_installs() -> None:
    assert re.search(r"^VENV \?= \.venv$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert INSTALLED.is_file(), f"no sfq-proxy beside {sys.executable}"
    commands = [line for line in shell_lines() if "sfq-proxy" in line]
    assert commands
    assert all(line.startswith(f"{COMMAND} ") for line in commands), commands


def test_its_config_passes_check_config_with_the_keys_it_exports(tmp_path: Path) -> None:
    [config] = blocks("yaml")
    (tmp_path / "sfq.yaml").write_text(config, encoding="utf-8")
    assert f"{COMMAND} check-config sfq.yaml" in shell_lines()
    result = subprocess.run(
        [str(INSTALLED), "check-config", "sfq.yaml"], capture_output=True, text=True,
        cwd=tmp_path, env={**os.environ, **exported()}, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "pool llama: models [meta-llama/Llama-3.1-8B-Instruct]" in result.stdout
    assert not [line for line in result.stdout.splitlines() if line.startswith("warning")]
    assert not set(exported().values()) & set(result.stdout.split())  # keys never shown


def test_each_command_it_shows_exists() -> None:
    lines = shell_lines()
    subcommands = [line.split()[1] for line in lines if line.startswith(COMMAND)]
    assert {"check-config", "serve"} <= set(subcommands)
    for subcommand in subcommands:
        assert run([str(INSTALLED), subcommand, "--help"]).returncode == 0, subcommand
    targets = [line.split()[1] for line in lines if line.startswith("make ")]
    assert {"run", "test"} <= set(targets)
    for target in targets:  # -n: what it would run, nothing run
        result = run(["make", "-n", target])
        assert result.returncode == 0, (target, result.stderr)


def test_its_python_snippet_reads_the_keys_it_exports() -> None:
    [snippet] = blocks("python")
    ast.parse(snippet)
    named = set(re.findall(r'os\.environ\["(\w+)"\]', snippet))
    assert named
    assert named <= set(exported())
