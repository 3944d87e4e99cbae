"""The real redis-server fixture: it answers, runs scripts, restarts empty on its port."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis_server import RedisServer

pytestmark = pytest.mark.redis


async def test_roundtrip_and_scripts(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.set("k", "v")
        assert await r.get("k") == b"v"
        # TIME answers two bulk strings (seconds, microseconds): bytes here, each an integer
        seconds, micros = await r.execute_command("EVAL", "return redis.call('TIME')", 0)
        assert int(seconds) > 1_600_000_000
        assert 0 <= int(micros) < 1_000_000
    finally:
        await r.aclose()


async def test_restart_pause_resume(redis_server: RedisServer, redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.set("k", "v")
    finally:
        await r.aclose()

    redis_server.restart()

    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.get("k") is None  # nothing persisted across the restart
        redis_server.pause()
        assert not redis_server.pings()
        redis_server.resume()
        assert await r.ping()
        await r.set("k", "w")
        assert await r.get("k") == b"w"
    finally:
        await r.aclose()
