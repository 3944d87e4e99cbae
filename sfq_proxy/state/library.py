"""The Redis function libraries shipped with the package (``*.lua``), called by name and
loaded where Redis does not have them: a new Redis, or one restarted without its data
(functions live with the data). ``FUNCTION LOAD`` goes to every primary of a cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from typing import Any

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


DISPATCH = Library("dispatch.lua", "sfq_dispatch")
ADMISSION = Library("admission.lua", "sfq_admit")
