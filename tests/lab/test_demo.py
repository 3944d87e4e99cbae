"""The newcomer's path: `sfq-proxy demo` as a real subprocess on a free port (its banner, its
admin key, its live table), one line rather than a traceback for a port in use, and
check-config's warning about a state file the proxy could not write."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from sfq_proxy.config import load_config
from sfq_proxy.config.summary import warnings
from sfq_proxy.lab.demo import TEAMS, TRY_KEY

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "sfq_proxy.cli"]
ENV = {k: v for k, v in os.environ.items() if k not in ("SFQ_DEMO_ADMIN_KEY", "SFQ_LOG_FORMAT")}
WAIT_S = 60  # for a line of output: never an assertion on time, only a bound on a hang


class Demo:
    """A running `sfq-proxy demo`, read line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def line(self) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), WAIT_S)
        assert raw, f"the demo ended: {self.lines}"
        self.lines.append(raw.decode().rstrip("\n"))
        return self.lines[-1]

    async def until(self, prefix: str) -> str:
        while not (line := await self.line()).startswith(prefix):
            pass
        return line

    def banner(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
async def demo_with_traffic() -> AsyncIterator[Demo]:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "demo", "--traffic", "--port", "0", "--log-format", "json",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=ENV,
    )  # fmt: skip
    try:
        yield Demo(proc)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), WAIT_S) == 0


async def test_the_demo_on_a_free_port_prints_what_works(demo_with_traffic: Demo) -> None:
    demo = demo_with_traffic
    first = await demo.line()
    url = re.search(r"proxy on (http://127\.0\.0\.1:\d+),", first)
    assert url, first
    base = url[1]
    assert not base.endswith(":8080")  # --port 0: a free port, not the default
    admin_line = await demo.until("Admin key: ")
    admin = admin_line.split()[2]
    assert admin.startswith("sk-demo-admin-")
    assert "generated for this run" in admin_line
    await demo.until("Metrics: ")
    banner = demo.banner()
    # the snippets use a key of a team that does not flood the pool
    flooding = {team.key for team in TEAMS if team.clients > 2}
    assert TRY_KEY not in flooding
    assert f"Authorization: Bearer {TRY_KEY}" in banner
    assert f'api_key="{TRY_KEY}"' in banner
    assert not [key for key in flooding if f"Bearer {key}" in banner or f'"{key}"' in banner]
    # the admin curl it prints works as printed
    [admin_curl] = [line.strip() for line in demo.lines if "/admin/state" in line]
    assert admin_curl == f"curl -s {base}/admin/state -H 'Authorization: Bearer {admin}'"
    async with aiohttp.ClientSession() as http:
        async with http.get(
            f"{base}/admin/state", headers={"Authorization": f"Bearer {admin}"}
        ) as resp:
            assert resp.status == 200
            state = await resp.json()
        assert set(state["pools"]) == {"sim"}
        assert len(state["pools"]["sim"]["backends"]) == 2
        wrong = {"Authorization": "Bearer sk-demo-product"}
        async with http.get(f"{base}/admin/state", headers=wrong) as resp:
            assert resp.status == 401
    # the live table: per flow its weight, whether it was backlogged, its entitled share
    header = await demo.until("  flow ")
    assert header.split() == [
        "flow", "weight", "backlogged", "entitled", "served", "done", "median", "latency",
    ]  # fmt: skip
    rows = {}
    while (line := await demo.line()).startswith("  ") and not line.startswith("  *"):
        flow, weight, backlogged, entitled, served, *_ = line.split()
        rows[flow] = (weight, backlogged, entitled, served)
    assert rows.keys() <= {team.flow for team in TEAMS}
    expected = {"analytics/batch": "1", "research/batch": "1", "product/interactive": "12"}
    assert {flow: row[0] for flow, row in rows.items()} == {flow: expected[flow] for flow in rows}
    for _, backlogged, entitled, served in rows.values():
        assert backlogged == "always" or re.fullmatch(r"\d+%", backlogged)
        assert (entitled == "asked") == (backlogged != "always"), (backlogged, entitled)
        assert re.fullmatch(r"\d+%", served)


def test_the_admin_key_can_be_chosen(tmp_path: Path) -> None:
    """SFQ_DEMO_ADMIN_KEY sets it (the banner says where it came from)."""
    proc = subprocess.Popen(
        [*CLI, "demo", "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**ENV, "SFQ_DEMO_ADMIN_KEY": "sk-my-admin"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(8)]
        assert "Admin key: sk-my-admin ($SFQ_DEMO_ADMIN_KEY; " in "".join(lines)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 0


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process (this one) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=ENV,
        timeout=WAIT_S, check=False,
    )  # fmt: skip


def test_demo_on_a_port_in_use_says_so_in_one_line(taken_port: int) -> None:
    result = run("demo", "--port", str(taken_port))
    assert result.returncode == 1
    assert result.stderr == (
        f"sfq-proxy demo: cannot listen on 127.0.0.1:{taken_port}: the address is in use "
        "(another process listens on it); choose another port with --port (make run PORT=...)\n"
    )


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, taken_port: int) -> None:
    path = tmp_path / "sfq.yaml"
    path.write_text(
        f"listen: {{host: 127.0.0.1, port: {taken_port}}}\n"
        "keys: [{key: sk-a, org: a, classes: [batch]}]\n"
        "pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9', slots: 1}]}}\n"
    )
    result = run("serve", "--config", path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"sfq-proxy: cannot listen on 127.0.0.1:{taken_port}: the address is in use "
        "(another process listens on it); change listen.port"
    )


def test_demo_port_must_be_a_port() -> None:
    result = run("demo", "--port", "70000")
    assert result.returncode == 2
    assert "argument --port: 70000 is not a port (0 to 65535)" in result.stderr


def _config_with_state_file(tmp_path: Path, state_file: Path) -> Path:
    path = tmp_path / "sfq.yaml"
    path.write_text(
        "keys: [{key: sk-a, org: a, classes: [batch]}]\n"
        "pools: {p: {models: [m], backends: [{url: 'http://127.0.0.1:9', slots: 1}]}}\n"
        f"calibration: {{state_file: {json.dumps(str(state_file))}}}\n"
    )
    return path


def test_check_config_warns_of_a_state_file_it_could_not_write(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "calibration.json"
    result = run("check-config", _config_with_state_file(tmp_path, missing))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"warning: calibration.state_file {missing}: directory {missing.parent} does not exist: "
        "what calibration learns will not be kept across restarts (the proxy logs a warning "
        "at every save); create it, or run as a user who may write there"
    )
    # a directory it may write to: no warning
    fine = tmp_path / "calibration.json"
    result = run("check-config", _config_with_state_file(tmp_path, fine))
    assert "warning" not in result.stdout
    # a directory it may not write to (root may write anywhere)
    if os.getuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        result = run("check-config", _config_with_state_file(tmp_path, locked / "c.json"))
        assert f"directory {locked} is not writable by this user" in result.stdout


def test_check_config_warns_of_a_state_directory_this_user_may_not_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user without write access there (root may write anywhere, so the access check
    is made to say no)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    config = load_config(_config_with_state_file(tmp_path, locked / "calibration.json"))
    assert warnings(config) == []
    denied = {locked}
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: Path(path) not in denied and real_access(path, mode)
    )
    [warning] = warnings(config)
    assert (
        f"warning: calibration.state_file {locked / 'calibration.json'}: directory {locked} "
        f"is not writable by this user (uid {os.getuid()})"
    ) in warning
