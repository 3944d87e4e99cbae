"""``Replicated`` (state/redis_functions.py) on a real Redis that has no replica: no write is
ever acknowledged. One call waits ``ACK_MS`` and finds it so; calls then go on without
waiting, and once ``UNACKED_S`` has passed a single call waits again (the probe), while
the others go on: a pooled connection held ``ACK_MS`` by every call in flight would
exhaust the pool at a busy proxy's rate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from sfq_proxy.state import redis_functions
from sfq_proxy.state.redis_functions import Replicated

ECHO = (
    "#!lua name=sfq_test_echo\n"
    "redis.register_function('sfq_test_echo', function(keys, args) return args[1] end)"
)
CALLS = 20


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    await client.function_load(ECHO, replace=True)
    yield client
    await client.aclose()


async def waits(redis: aioredis.Redis) -> int:
    """How many WAITs the server has run since its last CONFIG RESETSTAT."""
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


async def test_while_unacknowledged_one_call_probes_and_the_others_go_on(
    redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_functions, "UNACKED_S", 0.2)
    replicated = Replicated(redis)
    await redis.config_resetstat()
    assert await replicated.fcall("sfq_test_echo", "k", "first") == b"first"  # waited, unacked
    assert await waits(redis) == 1
    answered = await asyncio.gather(
        *(replicated.fcall("sfq_test_echo", "k", i) for i in range(CALLS))
    )
    assert answered == [str(i).encode() for i in range(CALLS)]
    assert await waits(redis) == 1  # within UNACKED_S: none waits

    await asyncio.sleep(0.25)  # UNACKED_S has passed: the next call probes
    done: list[int] = []

    async def call(i: int) -> None:
        assert await replicated.fcall("sfq_test_echo", "k", i) == str(i).encode()
        done.append(i)

    await asyncio.gather(*(call(i) for i in range(CALLS)))
    assert await waits(redis) == 2  # the probe's alone
    assert done[-1] == 0  # the first call probed; the others answered while it waited
    await replicated.fcall("sfq_test_echo", "k", "after")  # unacked again: no wait
    assert await waits(redis) == 2
