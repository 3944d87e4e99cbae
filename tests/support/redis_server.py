"""A real redis-server as a child process for the shared-state tests.

Real Redis, no mocks: the scripts, expiries and reconnects under test are Redis's own.
restart() keeps the port, so clients built from ``url`` reconnect to the new server (which
starts empty: nothing is saved). pause() and resume() freeze and thaw it (SIGSTOP, SIGCONT)
for the tests of a Redis that stops answering without closing its connections.
RedisClusterNodes is a real Redis Cluster of such servers (three primaries, no replicas);
ReplicatedRedis a primary, its replica and a Sentinel that fails it over.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio as aioredis
from lag_relay import LagRelay
from redis.crc import key_slot
from server_process import ServerProcess, free_port
from tools import need_tool


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
class RedisReplica(RedisServer):
    """A redis-server replicating ``primary_port`` (``--replicaof``) from its start."""

    primary_port: int = 0
    family = "redis-replica"

    def command(self) -> list[str]:
        return [*super().command(), "--replicaof", "127.0.0.1", str(self.primary_port)]


@dataclass
class RedisSentinel(RedisServer):
    """A Sentinel watching ``primary`` as service ``mymaster``: Debian's ``redis-sentinel``
    when installed, else ``redis-server --sentinel`` (the same program). ``down_after_ms``
    and ``failover_timeout_ms`` as in sentinel.conf (None: Sentinel's defaults, 30 s and
    3 min); a quorum of 1, so this sentinel alone may fail the primary over."""

    primary_port: int = 0
    down_after_ms: int | None = None
    failover_timeout_ms: int | None = None
    service = "mymaster"
    family = "redis-sentinel"

    def command(self) -> list[str]:
        assert self.workdir is not None
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites its file: a copy of its own
        lines = [
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.workdir}",
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 1",
        ]  # fmt: skip
        if self.down_after_ms is not None:
            lines.append(f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}")
        if self.failover_timeout_ms is not None:
            lines.append(f"sentinel failover-timeout {self.service} {self.failover_timeout_ms}")
        conf.write_text("\n".join(lines) + "\n")
        if shutil.which("redis-sentinel"):
            return ["redis-sentinel", str(conf)]
        return ["redis-server", str(conf), "--sentinel"]

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def primary(self) -> int:
        """The port of the primary this sentinel names now."""
        with self.client() as client:
            _, port = client.sentinel_get_master_addr_by_name(self.service)
        return int(port)

    def knows_replica(self, port: int) -> bool:
        """Whether it lists the replica on ``port`` as one it could promote (up, in sync)."""
        with self.client() as client:
            replicas = client.sentinel_slaves(self.service)
        return any(
            int(r["port"]) == port
            and not ({"s_down", "disconnected"} & set(r["flags"].split(",")))
            and r.get("master-link-status") == "ok"
            for r in replicas
        )


@dataclass
class ReplicatedRedis:
    """A primary, its replica and a Sentinel with short timings (``down_after_ms``): what a
    Redis run highly available is, on loopback ports. start() returns once the replica is in
    sync and the sentinel knows it, so that a primary killed then is failed over to it. The
    replica's link to the primary goes through ``link``, which can make it lag
    (``LagRelay.hold``)."""

    down_after_ms: int = 1000
    # also how long Sentinel leaves a replica pointed at another address than the primary's
    # (``link``'s) before it points it at the primary itself (+fix-slave-config)
    failover_timeout_ms: int = 60_000
    primary: RedisServer = field(default_factory=RedisServer)
    link: LagRelay = field(init=False)
    replica: RedisReplica = field(init=False)
    sentinel: RedisSentinel = field(init=False)
    ready_within_s = 20.0

    def __post_init__(self) -> None:
        self.link = LagRelay(self.primary.port)
        self.replica = RedisReplica(primary_port=self.link.port)
        self.sentinel = RedisSentinel(
            primary_port=self.primary.port, down_after_ms=self.down_after_ms,
            failover_timeout_ms=self.failover_timeout_ms,
        )  # fmt: skip

    @property
    def hosts(self) -> list[str]:
        return [f"127.0.0.1:{self.sentinel.port}"]

    def start(self) -> None:
        try:
            self.primary.start()
            self.link.start()
            self.replica.start()
            self.sentinel.start()
            deadline = time.monotonic() + self.ready_within_s
            while not self.sentinel.knows_replica(self.replica.port):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no replica in sync; see {self.sentinel.log_path}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.primary):
            server.stop()
        self.link.cut()

    def kill_primary(self) -> None:
        """SIGKILL the primary: what ``link`` held back the replica never gets."""
        self.primary.kill()
        self.link.cut()


@dataclass
class RedisClusterNode(RedisServer):
    """A redis-server with cluster mode on, its nodes.conf in its own temporary directory.
    The bus port is picked free too: the default (port + 10000) may be taken, or past 65535."""

    bus_port: int = field(default_factory=free_port)
    family = "redis-cluster"

    def command(self) -> list[str]:
        assert self.workdir is not None
        return [
            *super().command(),
            *("--cluster-enabled", "yes", "--cluster-port", str(self.bus_port)),
            *("--cluster-config-file", str(self.workdir / "nodes.conf")),
            *("--cluster-node-timeout", "5000"),
        ]

    def client(self) -> redis.Redis:
        """A plain (not cluster-aware) client of this node alone: what it holds, its stats."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)


@dataclass
class RedisClusterNodes:
    """A real Redis Cluster of ``size`` primaries (no replicas) on loopback ports.

    start() forms it as ``redis-cli --cluster create`` does, through redis-py: each node
    takes an even share of the 16384 slots and its own config epoch, meets the first, and
    start() returns once every node answers ``cluster_state:ok`` and sees every shard.
    stop() stops every node and removes their directories, whatever state they are in."""

    size: int = 3
    nodes: list[RedisClusterNode] = field(default_factory=list)
    ready_within_s = 20.0

    @property
    def url(self) -> str:
        """The first node's URL: a cluster client finds the others through it."""
        return self.nodes[0].url

    def start(self) -> None:
        self.nodes = [RedisClusterNode() for _ in range(self.size)]
        try:
            for node in self.nodes:
                node.start()
            self._form()
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def owner(self, key: str) -> RedisClusterNode:
        """The primary that holds ``key``'s slot, as the cluster itself says (CLUSTER SLOTS)."""
        slot = key_slot(key.encode())
        with self.nodes[0].client() as client:
            for start, end, primary, *_ in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(primary[1]))
        raise LookupError(f"slot {slot} of {key!r} is not served")

    def reset(self) -> None:
        """Every primary as just formed: no keys, no functions, its statistics (the
        commands and errors INFO counts) back to zero."""
        for node in self.nodes:
            with node.client() as client:
                client.flushall()
                client.function_flush()
                client.config_resetstat()

    def _form(self) -> None:
        share = -(-16384 // self.size)  # ceil: the last node takes the rest
        first = self.nodes[0]
        for i, node in enumerate(self.nodes):
            with node.client() as client:
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", i + 1)
                last = min(16383, (i + 1) * share - 1)
                client.execute_command("CLUSTER ADDSLOTSRANGE", i * share, last)
                if node is not first:
                    client.execute_command("CLUSTER MEET", "127.0.0.1", first.port, first.bus_port)

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + self.ready_within_s
        while not all(self._ok(node) for node in self.nodes):
            if time.monotonic() > deadline:
                logs = ", ".join(str(n.log_path) for n in self.nodes)
                raise TimeoutError(f"cluster not ok in {self.ready_within_s} s; see {logs}")
            time.sleep(0.2)

    def _ok(self, node: RedisClusterNode) -> bool:
        with node.client() as client:
            info = client.cluster("INFO")
            slots = client.execute_command("CLUSTER SLOTS")
        ports = {int(primary[1]) for _, _, primary, *_ in slots}
        return bool(
            info["cluster_state"] == "ok"
            and int(info["cluster_known_nodes"]) == self.size
            and ports == {n.port for n in self.nodes}
        )


@contextlib.contextmanager
def running_replicated_redis(**timings: int) -> Iterator[ReplicatedRedis]:
    """A primary, its replica and a sentinel (``ReplicatedRedis``), stopped whatever happens."""
    replicated = ReplicatedRedis(**timings)
    try:
        replicated.start()
        yield replicated
    finally:
        replicated.stop()


@contextlib.contextmanager
def running_redis_cluster(size: int = 3) -> Iterator[RedisClusterNodes]:
    """A formed Redis Cluster, stopped whatever happens."""
    cluster = RedisClusterNodes(size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def need_redis_server() -> None:
    """Skip without Debian's redis-server (``make tools`` installs it); under CI, fail."""
    need_tool("redis-server")


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A started redis-server, stopped whatever happens."""
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


async def fcalls(client: aioredis.Redis) -> int:
    """FCALLs the server has run so far (``INFO commandstats``)."""
    stats = await client.info("commandstats")
    return int(stats.get("cmdstat_fcall", {}).get("calls", 0))


async def queued_in_redis(redis_url: str, pool: str = "sim") -> int:
    """How many requests wait in the pool's shared line (its ``meta`` hash)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        return int(await client.hget(f"sfq:{{{pool}}}:meta", "queued") or 0)
    finally:
        await client.aclose()


async def queued_is(redis_url: str, n: int) -> bool:
    return await queued_in_redis(redis_url) == n
