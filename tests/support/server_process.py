"""A real inference server as a child process: what the vLLM and llama.cpp set-ups share.

Each family says how it is started (``command``), how it is checked (``health_path``) and how
long it may take; starting, waiting, stopping and the ``serve`` command line are here once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def step(what: str, n: int, of: int, text: str) -> None:
    """A line per step of a long set-up (`make vllm`, `make llamacpp`), at once: its
    minutes are never silent, in a terminal or in CI's log."""
    print(f"[{what} {n}/{of}] {text}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """One server on a loopback port; start() and stop() may be repeated."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    family = "server"  # in log file names and messages
    health_path = "/health"
    ready_within_s = 60.0
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(f"/tmp/sfq-{self.family}-{self.port}.log")

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env={**os.environ, **self.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends its workers too
            )

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_within_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.family} on {self.port} exited; see {self.log_path}")
            if self._healthy():
                return
            time.sleep(0.3)
        raise TimeoutError(
            f"{self.family} on {self.port} not ready in {self.ready_within_s} s; "
            f"see {self.log_path}"
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{self.health_path}", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def running(servers: Sequence[ServerProcess]) -> Iterator[Sequence[ServerProcess]]:
    """``servers`` started together, ready, and stopped whatever happens."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def serve_until_signal(make: Callable[[int], ServerProcess], ports: Sequence[int]) -> None:
    """The ``serve`` command of a set-up script: servers on ``ports`` until Ctrl-C."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    with running([make(port) for port in ports]) as servers:
        for server in servers:
            print(f"{server.family} serving at {server.url}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
