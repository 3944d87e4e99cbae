"""The ``sfq-proxy`` command line, run as a real subprocess (serve is left to end-to-end tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "example.yaml"
EXAMPLE_ENV = {  # the variables config/example.yaml says it needs
    "ANALYTICS_KEY": "sk-analytics-SECRET-1",
    "PRODUCT_KEY": "sk-product-SECRET-2",
    "PROVIDER_A_KEY": "sk-provider-SECRET-3",
    "SFQ_ADMIN_KEY": "admin-SECRET-4",
}
PLAIN_SECRET = "sk-plain-SECRET-5"


def sfq_proxy(
    *args: str | Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    drop = (*EXAMPLE_ENV, "SFQ_LOG_LEVEL", "SFQ_LOG_FORMAT")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, "-m", "sfq_proxy.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**base, **(env or {})},
        timeout=60,
        check=False,
    )


def write_config(
    tmp_path: Path, slots: int = 4, name: str = "bad.yaml", classes: str = "[interactive]"
) -> Path:
    path = tmp_path / name
    path.write_text(
        f"""
keys:
  - {{key: {PLAIN_SECRET}, org: product, classes: {classes}}}
pools:
  llama-8b:
    models: [meta-llama/Llama-3.1-8B-Instruct]
    backends:
      - {{url: "http://127.0.0.1:8001", slots: {slots}}}
""",
        encoding="utf-8",
    )
    return path


def test_help_lists_every_command() -> None:
    result = sfq_proxy("--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: sfq-proxy")
    for command in ("serve", "check-config", "demo", "sim-backend"):
        assert f"    {command}" in result.stdout


def test_no_command_is_a_usage_error() -> None:
    result = sfq_proxy()
    assert result.returncode == 2
    assert "required: COMMAND" in result.stderr


def test_check_config_of_the_example_summarises_it_without_secrets() -> None:
    result = sfq_proxy("check-config", "config/example.yaml", env=EXAMPLE_ENV)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    out = result.stdout
    assert out.startswith("listen 0.0.0.0:8080 ")
    assert "pool llama-8b: models [meta-llama/Llama-3.1-8B-Instruct], vllm servers\n" in out
    assert "pool provider-a: models [gpt-4o-mini], openai servers\n" in out
    assert "  backend gpu-b: http://10.0.0.12:8000, 32 slots\n" in out
    assert "  keys[0]: org=analytics, classes=[batch] (from env ANALYTICS_KEY)\n" in out
    assert "  keys[2]: org=ops, classes=[system, interactive] (sha256)\n" in out
    assert "  product/interactive/llama-8b: 12\n" in out
    # each class's worst-case share of each pool (system is the band, capped at 4)
    assert (
        "  worst-case shares of 24 slots (all classes backlogged, equal org weights):\n"
        "    system: up to 16.7% (priority, max_in_flight=4)\n"
        "    interactive: at least 71.4% (85.7% of the rest)\n"
        "    batch: at least 11.9% (14.2% of the rest)\n"
    ) in out
    assert "  worst-case shares of 64 slots" in out
    # the ceiling per request bounds c_max: max(input_weight, output_weight) × ceiling
    assert (
        "  per request: at most 131072 tokens in + out (c_max 524288), more is refused; "
        "none asked: sent max_tokens=1024\n"
    ) in out
    for secret in EXAMPLE_ENV.values():
        assert secret not in out


def test_check_config_of_the_example_without_its_env_names_the_variables() -> None:
    result = sfq_proxy("check-config", EXAMPLE)
    assert result.returncode == 1
    assert result.stdout == ""
    assert f"{EXAMPLE}: invalid configuration:" in result.stderr
    assert "keys[0].key_env: environment variable ANALYTICS_KEY is not set" in result.stderr
    assert "keys[1].key_env: environment variable PRODUCT_KEY is not set" in result.stderr


def test_check_config_of_a_valid_file_never_prints_its_plain_key(tmp_path: Path) -> None:
    result = sfq_proxy("check-config", write_config(tmp_path, name="ok.yaml"))
    assert result.returncode == 0, result.stderr
    assert "  keys[0]: org=product, classes=[interactive] (plain)\n" in result.stdout
    assert PLAIN_SECRET not in result.stdout + result.stderr


def test_check_config_of_a_bad_file_names_the_path_and_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, slots=0)
    result = sfq_proxy("check-config", path)
    assert result.returncode != 0
    assert result.stdout == ""
    assert f"{path}: invalid configuration:" in result.stderr
    assert "pools.llama-8b.backends[0].slots: must be > 0" in result.stderr
    assert "bad.yaml" in result.stderr
    assert PLAIN_SECRET not in result.stderr


def test_check_config_refuses_a_band_that_could_fill_a_pool(tmp_path: Path) -> None:
    # the default system class (max_in_flight 4), granted to a key, on a pool of 4 slots
    path = write_config(tmp_path, classes="[interactive, system]")
    result = sfq_proxy("check-config", path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert (
        "classes.system.max_in_flight: the priority band's max_in_flight total 4 (system 4) "
        "leaves no slot of pool 'llama-8b' (4 slots) to the fair queue"
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_of_a_missing_file_says_so(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    result = sfq_proxy("check-config", path)
    assert result.returncode != 0
    assert result.stdout == ""
    assert f"cannot read {path}" in result.stderr
    assert "No such file or directory" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("keys: [\n", "line "),
        ("", "the configuration is empty"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
    ids=["yaml-syntax", "empty", "not-a-mapping"],
)
def test_check_config_of_unparsable_yaml(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text, encoding="utf-8")
    result = sfq_proxy("check-config", path)
    assert result.returncode == 1
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_says_where_the_state_is_and_never_its_password(tmp_path: Path) -> None:
    path = write_config(tmp_path, name="ok.yaml")
    result = sfq_proxy("check-config", path)
    assert "\nstate: memory (this process alone is each pool's fairness domain)\n" in result.stdout
    with path.open("a") as file:
        file.write("state: {redis: 'redis://:hunter2@r.internal:6380/1', lease_ttl_s: 3}\n")
    result = sfq_proxy("check-config", path)
    assert result.returncode == 0, result.stderr
    assert (
        "\nstate: redis redis://r.internal:6380/1: every process sharing it is one fairness "
        "domain per pool; a dead one's slots back within 3 s; Redis unreachable: requests "
        "refused (503)\n"
    ) in result.stdout
    assert "hunter2" not in result.stdout


def test_version_is_the_installed_packages() -> None:
    result = sfq_proxy("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"sfq-proxy {metadata.version('sfq-proxy')}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert metadata.version("sfq-proxy") == project["version"]


@pytest.mark.parametrize("command", ["serve", "demo"])
@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        (["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
        (["--log-format", "xml"], {}, "argument --log-format: invalid choice: 'xml'"),
        ([], {"SFQ_LOG_LEVEL": "loud"}, "environment variable SFQ_LOG_LEVEL: invalid choice: "
         "'loud' (choose from debug, info, warning, error, critical)"),
        ([], {"SFQ_LOG_FORMAT": "xml"}, "environment variable SFQ_LOG_FORMAT: invalid choice: "
         "'xml' (choose from json, text)"),
    ],
    ids=["level-flag", "format-flag", "level-env", "format-env"],
)  # fmt: skip
def test_a_bad_log_option_is_a_usage_error(
    tmp_path: Path, command: str, args: list[str], env: dict[str, str], error: str
) -> None:
    config = ["--config", str(write_config(tmp_path, name="ok.yaml"))] if command == "serve" else []
    result = sfq_proxy(command, *config, *args, env=env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(f"usage: sfq-proxy {command} ")
    assert result.stderr.splitlines()[-1].startswith(f"sfq-proxy {command}: error: {error}")


def test_a_log_flag_spares_its_variable_from_being_read(tmp_path: Path) -> None:
    """The flag wins: a bad SFQ_LOG_FORMAT is not even looked at (here the missing file is
    the error)."""
    result = sfq_proxy(
        "serve", "--config", tmp_path / "absent.yaml", "--log-format", "json",
        env={"SFQ_LOG_FORMAT": "xml"},
    )  # fmt: skip
    assert result.returncode == 1
    assert "cannot read" in result.stderr
    assert "SFQ_LOG_FORMAT" not in result.stderr


CONFIG_WITH_VARIABLES = """
keys:
  - {key: "${TEAM_KEY}", org: product, classes: [interactive]}
pools:
  llama-8b:
    models: [meta-llama/Llama-3.1-8B-Instruct]
    backends:
      - url: http://${BACKEND_HOST}:${BACKEND_PORT:-8001}
        slots: 4
        name: "${BACKEND_NAME:-gpu-a}"
"""


def test_check_config_expands_variables_and_names_an_unset_one(tmp_path: Path) -> None:
    path = tmp_path / "vars.yaml"
    path.write_text(CONFIG_WITH_VARIABLES, encoding="utf-8")
    env = {"TEAM_KEY": PLAIN_SECRET, "BACKEND_HOST": "10.1.2.3"}
    result = sfq_proxy("check-config", path, env=env)
    assert result.returncode == 0, result.stderr
    assert "  backend gpu-a: http://10.1.2.3:8001, 4 slots\n" in result.stdout
    assert PLAIN_SECRET not in result.stdout + result.stderr
    result = sfq_proxy("check-config", path, env={"TEAM_KEY": PLAIN_SECRET})
    assert result.returncode == 1
    assert result.stdout == ""
    assert (
        "pools.llama-8b.backends[0].url: environment variable BACKEND_HOST is not set "
        "(and has no default)"
    ) in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_read_by_a_command_that_left_ends_without_a_traceback() -> None:
    """``check-config sfq.yaml | head``: once head has its lines it leaves, and the rest of
    the summary has nowhere to go (here the reader leaves before the first line)."""
    read, write = os.pipe()
    os.close(read)
    base = {k: v for k, v in os.environ.items() if k not in ("SFQ_LOG_LEVEL", "SFQ_LOG_FORMAT")}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "sfq_proxy.cli", "check-config", str(EXAMPLE)],
            stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**base, **EXAMPLE_ENV}, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (0, "")
