"""The process's connection to the shared state, when ``state: {redis: ...}`` is set: made at
start (a proxy that cannot reach Redis does not start), closed at the end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import RedisError

from ..config import Config, ConfigError, without_credentials
from .redis_dispatch import Fenced
from .redis_functions import Caller, Replicated
from .redis_pool import SharedPool
from .redis_resp import Pipe

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 1.0
SOCKET_TIMEOUT_S = 5.0
# connections to Redis per process: each call holds one for a round trip, and each pool's
# inbox holds one for its blocking read
MAX_CONNECTIONS = 64
# behind Sentinel, and to each node of a cluster, a call cannot wait for a free connection
# (redis-py's Sentinel pool and its cluster nodes fail at once when all are busy: at 64 per
# node, a burst of 200 requests got 503 for most, tests/state/test_redis_cluster.py): a bound
# well above what a process has in flight
UNWAITED_CONNECTIONS = 1024
# at shutdown: how long the loops may take to end on their own (the heartbeat ends at its
# next step, within a call's round trip); an inbox read still blocked in Redis is cancelled
LOOPS_S = 0.1
CLOSE_S = 0.1  # and closing the connections


def connect(config: Config) -> Redis | RedisCluster | None:
    """A client for the configured Redis (it connects on first use), or None in memory."""
    state, url = config.state, config.redis_url()
    if state is None:
        return None
    # fail fast: a request waits on Redis only while Redis answers (a blocking read of the
    # grants inbox takes up to INBOX_WAIT_S, well inside the socket timeout)
    options = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": SOCKET_TIMEOUT_S}
    if state.sentinel is not None:  # the primary, as the sentinels name it at each connect
        sentinels = [_host_port(host) for host in state.sentinel.hosts]
        sentinel = Sentinel(
            sentinels,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
        )
        primary: Redis = sentinel.master_for(
            state.sentinel.service,
            password=config.redis_password(),
            max_connections=UNWAITED_CONNECTIONS,
            socket_connect_timeout=CONNECT_TIMEOUT_S,
            socket_timeout=SOCKET_TIMEOUT_S,
        )
        return primary
    if url is None:
        return None
    if state.cluster:  # through the URL's node the client learns the others, and their slots
        return RedisCluster.from_url(url, max_connections=UNWAITED_CONNECTIONS, **options)
    # a request waits for a free connection rather than failing when all are busy
    pool = BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=SOCKET_TIMEOUT_S, **options
    )
    return Redis(connection_pool=pool)


def calls(config: Config, redis: Redis | RedisCluster) -> Caller:
    """Where the hot path's function calls go: a ``Pipe`` to a single Redis named by its
    URL; behind Sentinel, redis-py's client, each call waiting for a replica to have its
    writes (``Replicated``); else (Cluster, a URL with options) redis-py's client."""
    url, state = config.redis_url(), config.state
    if state is not None and state.sentinel is not None and isinstance(redis, Redis):
        return Replicated(redis)
    if url is None or state is None or state.cluster:
        return redis
    pipe = Pipe.from_url(url, connect_timeout_s=CONNECT_TIMEOUT_S, timeout_s=SOCKET_TIMEOUT_S)
    return redis if pipe is None else pipe


def holder_id() -> str:
    """A proxy in Redis: readable by an operator (host and pid), unique across restarts."""
    return f"{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}"


async def start(config: Config, pools: list[SharedPool]) -> None:
    """Join every shared pool; Redis unreachable is a configuration error at start."""
    for pool in pools:
        try:
            await pool.start()
        except RedisError as err:
            where = _where(config)
            raise ConfigError([("state", f"cannot reach Redis at {where}: {err}")]) from err


async def stop(pools: list[SharedPool], loops: list[asyncio.Task[None]]) -> None:
    """At the end of the drain: end the pools' loops (the heartbeat at its next step; an
    inbox read still blocked is cancelled: after the drain began no grant is for this
    process), hand back the leases still being handed back, then quit each pool, which gives
    Redis back whatever this process still held there. Bounded by the caller."""
    for pool in pools:
        pool.stop()
    if loops:
        _, blocked = await asyncio.wait(loops, timeout=LOOPS_S)
        for task in blocked:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
    for pool in pools:
        await pool.drain()
        try:
            await pool.quit()
        except (RedisError, Fenced) as err:  # its leases go back when their TTL passes
            log.warning("pool %s: could not leave the shared state: %s", pool.name, err)


async def close(pools: list[SharedPool]) -> None:
    """Close the connections to Redis (last: the calibration's final sync uses them)."""
    # (a Replicated wraps the inbox's client: closed once, as that)
    calls = [p.dispatch.calls for p in pools if not isinstance(p.dispatch.calls, Replicated)]
    clients = {id(c): c for c in [*(p.dispatch.redis for p in pools), *calls]}
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CLOSE_S):
            await asyncio.gather(*(c.aclose() for c in clients.values()), return_exceptions=True)


def _where(config: Config) -> str:
    """Where the shared state was looked for, without a password."""
    state = config.state
    if state is not None and state.sentinel is not None:
        hosts = ", ".join(state.sentinel.hosts)
        return f"the primary of {state.sentinel.service} (sentinels {hosts})"
    return without_credentials(config.redis_url() or "")


def _host_port(host: str) -> tuple[str, int]:
    name, _, port = host.rpartition(":")
    return name, int(port)
