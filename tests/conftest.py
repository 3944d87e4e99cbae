"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from hypothesis import settings
from proxy_lab import AccessLines, Lab
from redis_server import RedisServer, need_redis_server, running_redis
from server_process import running
from vllm_backend import VllmServer, need_vllm

from sfq_proxy.observability import access_log as access_log_sink

# No timing assertions, hypothesis's per-example deadline included: shared machines stall.
settings.register_profile("sfq", deadline=None)
settings.load_profile("sfq")


@pytest.fixture
async def lab() -> AsyncIterator[Lab]:
    """Simulated backends and proxies, all stopped when the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        yield Lab(stack)


@pytest.fixture
def access_log() -> Iterator[AccessLines]:
    """The proxy's access lines, parsed: ``await access_log()`` once the requests are done."""
    buffer = io.StringIO()
    access_log_sink.configure(buffer, fmt="json")

    async def lines() -> list[dict]:
        await asyncio.sleep(0)  # lines leave when the loop turns
        return [json.loads(line) for line in buffer.getvalue().splitlines()]

    yield lines
    access_log_sink.configure(None)


@pytest.fixture(scope="session")
def vllm_servers() -> Iterator[list[VllmServer]]:
    """Two real vLLM servers for the whole session; skipped (under CI, failed) until
    `make vllm` has installed vLLM and built the model."""
    need_vllm()
    with running([VllmServer(), VllmServer()]) as servers:
        yield list(servers)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server for the whole session (Debian's package, from `make tools`)."""
    need_redis_server()
    with running_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied: every test starts from no keys."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.flushall()
    return redis_server.url
