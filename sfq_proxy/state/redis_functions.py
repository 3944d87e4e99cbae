"""The Redis function libraries shipped with the package (``*.lua``), called by name and
loaded where Redis does not have them: a new Redis, or one restarted without its data
(functions live with the data, per node: a cluster's primaries each have their own; a
replica gets its primary's, so one that Sentinel promotes has them).

On a cluster each call goes straight to the primary that owns its key's slot, and a
library is loaded on the primary that said it lacks it (tests/state/test_redis_cluster.py).
Behind Sentinel each call waits until a replica has its writes (``Replicated``)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, ResponseError, SlotNotCoveredError

from .redis_batcher import Call
from .redis_resp import Pipe

log = logging.getLogger(__name__)
# how long a call behind Sentinel waits for a replica to acknowledge its writes, and, when
# none did, how long calls then go on without waiting before one of them waits again
ACK_MS = 500
UNACKED_S = 5.0


class Replicated:
    """redis-py's client of a primary that Sentinel fails over to its replica. Replication
    is asynchronous: a primary that dies takes with it the writes its replica had not
    received, and a lease granted, handed back or queued there would be lost to the new
    primary (a slot counted free while its request runs, or taken for as long as its holder
    lives; a request waiting for good). So each call is followed, on its connection, by
    ``WAIT 1 ACK_MS``, and its reply is acted on once a replica holds its writes: Sentinel
    promotes the replica with the most data (of those of equal ``replica-priority``), so a
    failover loses none of them.

    A replica that has not acknowledged within ``ACK_MS`` (none connected, or lagging
    further) does not stop the proxy: the call's reply is used, said once in the log, and
    calls go on without waiting. Every ``UNACKED_S`` one call, the probe, waits again, and
    the others go on without waiting until a probe is acknowledged: a wait holds its pooled
    connection up to ``ACK_MS``, and every call in flight waiting would exhaust the pool at
    a busy proxy's rate. Writes made then can be lost by a failover (docs/shared-state.md,
    Failover)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._unacked_until = 0.0  # monotonic; 0: acknowledged; before it, calls do not wait
        self._probing = False  # a call waits to learn whether a replica acknowledges again

    async def fcall(self, function: str, key: str, *args: Any) -> Any:
        probe = self._unacked_until > 0
        if probe and (self._probing or time.monotonic() < self._unacked_until):
            return await self.redis.fcall(function, 1, key, *args)
        if probe:
            self._probing = True
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.fcall(function, 1, key, *args)
                pipe.execute_command("WAIT", 1, ACK_MS)
                reply, acked = await pipe.execute()
        finally:
            if probe:
                self._probing = False
        if acked < 1:
            if not self._unacked_until:
                log.warning("no replica acknowledged a write within %d ms: going on", ACK_MS)
            self._unacked_until = time.monotonic() + UNACKED_S
        elif self._unacked_until:
            self._unacked_until = 0.0
            log.warning("a replica acknowledges writes again")
        return reply

    async def function_load(self, code: str, replace: bool) -> Any:
        return await self.redis.function_load(code, replace=replace)


# where function calls go: a pipe to one server (the fast path), or redis-py's client (behind
# Sentinel, waiting for a replica)
Caller = Redis | RedisCluster | Pipe | Replicated


@dataclass(frozen=True)
class Library:
    """A library made of the package's ``filenames``, in order (the first names it), and its
    entry point ``function``; both are named after the code's digest (``sfq_<digest>``,
    ``sfq_dispatch_<digest>``): during a rolling update two versions of the proxy share a
    Redis, and each calls the code it ships. With one name, the first call of the new
    version to load its library would swap the code under the old one's running calls."""

    filenames: tuple[str, ...]
    function: str  # its entry point, as a file registers it; its digest is added
    code: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        code = "\n".join(
            resources.files(__package__).joinpath(name).read_text() for name in self.filenames
        )
        version = hashlib.sha1(code.encode()).hexdigest()[:10]
        header, _, body = code.partition("\n")
        if not header.startswith("#!lua name=") or _registered(self.function) not in body:
            raise ValueError(f"{self.filenames}: no library name or no {self.function}")
        body = _REGISTERED.sub(lambda m: _registered(f"{m[1]}_{version}"), body)
        object.__setattr__(self, "code", f"{header}_{version}\n{body}")
        object.__setattr__(self, "function", f"{self.function}_{version}")

    async def call(self, redis: Caller, key: str, *args: Any) -> Any:
        """The function on ``key`` (every key it touches shares its hash tag)."""
        try:
            return await _fcall(redis, self.function, key, *args)
        except ResponseError as err:
            if "function not found" not in str(err).lower():
                raise
        if isinstance(redis, RedisCluster):  # the node that lacks it, not redis-py's choice
            await redis.execute_command(
                "FUNCTION LOAD", "REPLACE", self.code, target_nodes=await _owner(redis, key)
            )
        elif isinstance(redis, Pipe):
            await redis.execute("FUNCTION", "LOAD", "REPLACE", self.code)
        else:
            await redis.function_load(self.code, replace=True)
        return await _fcall(redis, self.function, key, *args)

    async def call_all(
        self, redis: Caller, key: str, calls: Sequence[Call], *common: Any
    ) -> list[Any]:
        """The replies to ``calls`` (each an operation and its arguments; ``common``: the
        arguments every operation takes first), made in one call: on its own, or several as
        the function's ``batch`` operation (each call's number of arguments, then the call)."""
        if len(calls) == 1:
            op, *args = calls[0]
            return [await self.call(redis, key, op, *common, *args)]
        batch: list[Any] = []
        for call in calls:
            batch += (len(call), *call)
        return list(await self.call(redis, key, "batch", *common, *batch))


async def _fcall(redis: Caller, function: str, key: str, *args: Any) -> Any:
    """FCALL on one key. redis-py's cluster client finds FCALL's keys by asking a node
    (COMMAND GETKEYS: FCALL's keys are movable) before each call: a round trip more, always
    to the same node. The key is known here, so the call goes to its slot's primary."""
    if isinstance(redis, Pipe):  # first: isinstance of RedisCluster (a Protocol) costs 2 µs
        return await redis.execute("FCALL", function, 1, key, *args)
    if isinstance(redis, Replicated):
        return await redis.fcall(function, key, *args)
    if isinstance(redis, RedisCluster):
        node = await _owner(redis, key)
        return await redis.execute_command("FCALL", function, 1, key, *args, target_nodes=node)
    return await redis.fcall(function, 1, key, *args)


async def _owner(redis: RedisCluster, key: str) -> ClusterNode:
    """The primary serving ``key``'s slot, as the client last learnt it (a MOVED reply
    teaches it the new one; the call that got it follows it)."""
    await redis.initialize()  # after a connection error the client asks for the slots again
    try:
        node = redis.get_node_from_key(key)
    except SlotNotCoveredError as err:  # not a RedisError: callers would not see it as one
        await redis.aclose()  # as redis-py does: the next call asks for the slots again
        raise ClusterDownError(str(err)) from err
    assert node is not None  # None only when a replica is asked for
    return node


def _registered(function: str) -> str:
    return f"redis.register_function('{function}',"


_REGISTERED = re.compile(r"redis\.register_function\('(\w+)',")

T = TypeVar("T")

# one library, two entry points: a pool's submit may decide its org's admission too
FILES = ("admission.lua", "dispatch.lua")
DISPATCH = Library(FILES, "sfq_dispatch")
ADMISSION = Library(FILES, "sfq_admit")


async def shielded(call: Awaitable[T]) -> T:
    """``call`` run to its end even if the caller is cancelled (a client that leaves).

    A Redis call cancelled between its request and its reply leaves its connection to be
    torn down under the connection pool's lock; under load that wedged the pool (a
    cancelled read that never returned, and every later call waiting behind it). Run as a
    task of its own, the call ends as calls do, by its reply or its socket timeout; its
    outcome is then read by nobody, but its errors are logged by ``asyncio`` no more."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(_retrieved)
    return await asyncio.shield(task)


def _retrieved(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # seen: a caller that left does not want it
