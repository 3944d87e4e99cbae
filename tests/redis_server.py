"""A real redis-server as a child process for the shared-state tests.

Real Redis, no mocks: the scripts, expiries and reconnects under test are Redis's own.
restart() keeps the port, so clients built from ``url`` reconnect to the new server (which
starts empty: nothing is saved). pause() and resume() freeze and thaw it (SIGSTOP, SIGCONT)
for the tests of a Redis that stops answering without closing its connections.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from server_process import ServerProcess


@dataclass
class RedisServer(ServerProcess):
    """One redis-server on a loopback port; start() (which waits until it answers) and
    stop() may be repeated."""

    workdir: Path | None = None
    family = "redis"
    ready_within_s = 10.0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        assert self.workdir is not None
        return [
            "redis-server",
            *("--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir)),
        ]

    def start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="sfq-redis-"))  # not the working directory
        super().start()
        self.wait_ready()

    def _healthy(self) -> bool:
        return self.pings()

    def pings(self) -> bool:
        """Whether it answers PING within a second."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        super().stop()
        self._remove_workdir()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._remove_workdir()

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _remove_workdir(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def _signal(self, signum: signal.Signals) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"redis-server on {self.port} is not running")
        os.kill(self.proc.pid, signum)


@dataclass
class RedisSentinel(RedisServer):
    """A Sentinel (redis-server --sentinel) watching ``primary`` as service ``mymaster``."""

    primary_port: int = 0
    service = "mymaster"
    family = "redis-sentinel"

    def command(self) -> list[str]:
        assert self.workdir is not None
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites its file: a copy of its own
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 1\n"
        )
        return ["redis-server", str(conf), "--sentinel"]


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A started redis-server, stopped whatever happens."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


async def queued_in_redis(redis_url: str, pool: str = "sim") -> int:
    """How many requests wait in the pool's shared line (its ``meta`` hash)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        return int(await client.hget(f"sfq:{{{pool}}}:meta", "queued") or 0)
    finally:
        await client.aclose()


async def queued_is(redis_url: str, n: int) -> bool:
    return await queued_in_redis(redis_url) == n
