"""Both logs of ``sfq-proxy serve`` as a process writes them (docs/operations.md, Logs): the
access log on stdout and the operational log on stderr, in the format and at the level
chosen by flag or environment, on pipes and on a terminal.

The proxy's one backend (port 9) is down, so every run logs a warning (the backend marked
down) and its requests, for a model nobody serves, are answered 404 — each an access line.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

TS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
KEY, NAMED_KEY = "sk-logs-team-a-000001", "sk-logs-ci-bot-000002"
BANNER = re.compile(r"sfq-proxy listening on (http://127\.0\.0\.1:\d+)")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "127.0.0.1", "port": 0},
                "keys": [
                    {"key": KEY, "org": "team-a", "classes": ["batch"]},
                    {"key": NAMED_KEY, "org": "team-b", "classes": ["batch"], "name": "ci-bot"},
                ],
                "pools": {
                    "p": {"models": ["m"], "backends": [{"url": "http://127.0.0.1:9", "slots": 1}]}
                },
                "drain_timeout_s": 5,
            }
        )
    )
    return path


def environment(**env: str) -> dict[str, str]:
    """This environment without the log variables, then ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SFQ_LOG_")}
    return base | env


def ask(url: str) -> None:
    """Two requests for a model nobody serves, one by each key: two access lines."""
    for key in (KEY, NAMED_KEY):
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(
                {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
            ).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 404


def read_line(stream: Any, timeout_s: float = 30) -> str:
    ready, _, _ = select.select([stream], [], [], timeout_s)
    assert ready, "nothing printed in time"
    return str(stream.readline())


def serve(config: Path, *args: str, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """Run ``serve``, ask it twice, stop it; its stdout and stderr lines."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(config), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        first = read_line(proc.stdout)
        found = BANNER.search(first)
        assert found, first + proc.communicate(timeout=10)[1]
        ask(found[1])
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    return [first.rstrip("\n"), *out.splitlines()], err.splitlines()


def access_json(lines: list[str]) -> list[dict[str, Any]]:
    parsed = [json.loads(line) for line in lines if line.startswith("{")]
    return [line for line in parsed if line["logger"] == "sfq_proxy.access"]


def banners(lines: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """The URL and (level, logger, msg) of the JSON lines of stdout that are no access
    lines: the banners, shaped as log lines; every line of stdout is JSON."""
    parsed = [json.loads(line) for line in lines]
    for line in parsed:
        assert re.fullmatch(TS, line["ts"])
    said = [(b["level"], b["logger"], b.get("msg", "")) for b in parsed]
    return parsed[0]["url"], [line for line in said if line[1] != "sfq_proxy.access"]


def test_on_pipes_both_logs_are_json_lines_with_ts_level_logger(config: Path) -> None:
    out, err = serve(config, "--log-level", "info", env=environment())
    # stdout: the banners and one line per request, every one JSON
    url, said_out = banners(out)
    assert said_out == [
        ("info", "sfq_proxy.runner", f"sfq-proxy listening on {url}"),
        ("info", "sfq_proxy.runner", "sfq-proxy draining…"),
    ]
    access = access_json(out)
    assert len(access) == 2 == len(out) - 2
    for line in access:
        assert re.fullmatch(TS, line["ts"])
        assert (line["level"], line["logger"]) == ("info", "sfq_proxy.access")
        assert (line["status"], line["outcome"], line["reason"]) == (404, "rejected", "invalid")
    assert [(line["org"], line["key"]) for line in access] == [
        ("team-a", "team-a#0"),
        ("team-b", "ci-bot"),
    ]
    # stderr: JSON lines only, each with ts, level, logger and msg
    records = [json.loads(line) for line in err]
    for record in records:
        assert set(record) == {"ts", "level", "logger", "msg"}
        assert re.fullmatch(TS, record["ts"])
    said = [(r["level"], r["logger"], r["msg"]) for r in records]
    assert ("info", "sfq_proxy.runner.server", f"listening on {url}") in said
    assert ("info", "sfq_proxy.http.proxy", "draining: in-flight requests have up to 5 s") in said
    assert any(level == "warning" and "marked down" in msg for level, _, msg in said), said
    text = "\n".join(out + err)
    assert KEY not in text
    assert NAMED_KEY not in text


def test_the_environment_chooses_text_and_the_level(config: Path) -> None:
    out, err = serve(config, env=environment(SFQ_LOG_FORMAT="text", SFQ_LOG_LEVEL="ERROR"))
    assert out[0].startswith("sfq-proxy listening on ")
    access = out[1:-1]
    assert len(access) == 2
    for line in access:
        assert re.match(f"{TS} INFO sfq_proxy.access: request_id=[0-9a-f]{{32}} org=team-", line)
    assert " key=team-a#0 " in access[0]
    assert " key=ci-bot " in access[1]
    assert err == []  # the backend's warning is below ERROR


def test_a_flag_wins_over_the_environment(config: Path) -> None:
    env = environment(SFQ_LOG_FORMAT="text", SFQ_LOG_LEVEL="error")
    out, err = serve(config, "--log-format", "json", "--log-level", "warning", env=env)
    assert len(access_json(out)) == 2
    assert [json.loads(line)["level"] for line in err] == ["warning"]


@contextlib.contextmanager
def on_a_terminal(config: Path, *args: str, env: dict[str, str]) -> Iterator[list[str]]:
    """``serve`` with stdout and stderr on one terminal (as `docker run -t` gives it): the
    lines it wrote there, once the block (which gets the URL) has asked and it stopped."""
    main, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(config), *args],
        stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal, env=env,
    )  # fmt: skip
    os.close(terminal)
    written = b""
    lines: list[str] = []

    def more(timeout_s: float = 30) -> bool:
        nonlocal written
        ready, _, _ = select.select([main], [], [], timeout_s)
        assert ready, "nothing written in time"
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        written += chunk
        return bool(chunk)

    try:
        while not (found := BANNER.search(written.decode(errors="replace"))):
            assert more(), written
        ask(found[1])
        proc.send_signal(signal.SIGTERM)
        while more():
            pass
        assert proc.wait(timeout=30) == 0
        lines += written.decode().splitlines()
        yield lines
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main)


def test_on_a_terminal_the_default_is_text(config: Path) -> None:
    with on_a_terminal(config, env=environment()) as lines:
        access = [line for line in lines if " sfq_proxy.access: " in line]
        assert len(access) == 2
        assert all(re.match(f"{TS} INFO sfq_proxy.access: request_id=", a) for a in access)
        assert any(
            re.match(f"{TS} WARNING sfq_proxy.state.pool: .*marked down", line) for line in lines
        ), lines
        assert not [line for line in lines if line.startswith("{")]


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_json_chosen_stays_json_on_a_terminal(config: Path, how: str) -> None:
    args = ["--log-format", "json"] if how == "flag" else []
    env = environment(SFQ_LOG_FORMAT="json") if how == "environment" else environment()
    with on_a_terminal(config, *args, env=env) as lines:
        logged = [json.loads(line) for line in lines if line.startswith("{")]
        assert [line["key"] for line in logged if line["logger"] == "sfq_proxy.access"] == [
            "team-a#0",
            "ci-bot",
        ]
        assert any(line["level"] == "warning" for line in logged)
        assert [line for line in lines if not line.startswith("{")] == []  # the banners too
        url = next(line["url"] for line in logged if "url" in line)
        assert [line["msg"] for line in logged if line["logger"] == "sfq_proxy.runner"] == [
            f"sfq-proxy listening on {url}",
            "sfq-proxy draining…",
        ]
