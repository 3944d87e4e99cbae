"""The Redis function libraries shipped with the package (``*.lua``), called by name and
loaded where Redis does not have them: a new Redis, or one restarted without its data
(functions live with the data). ``FUNCTION LOAD`` goes to every primary of a cluster."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError


@dataclass(frozen=True)
class Library:
    filename: str
    function: str  # its entry point
    code: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        code = resources.files(__package__).joinpath(self.filename).read_text()
        object.__setattr__(self, "code", code)

    async def call(self, redis: Redis | RedisCluster, key: str, *args: Any) -> Any:
        """The function on ``key`` (every key it touches shares its hash tag)."""
        try:
            return await redis.fcall(self.function, 1, key, *args)
        except ResponseError as err:
            if "function not found" not in str(err).lower():
                raise
        await redis.function_load(self.code, replace=True)
        return await redis.fcall(self.function, 1, key, *args)


T = TypeVar("T")

DISPATCH = Library("dispatch.lua", "sfq_dispatch")
ADMISSION = Library("admission.lua", "sfq_admit")


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
