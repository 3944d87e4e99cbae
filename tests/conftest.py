"""Fixtures shared by the test modules."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Iterator

import pytest
from hypothesis import settings
from proxy_lab import AccessLines, Lab
from server_process import running
from vllm_backend import VllmServer

from sfq_proxy.http import access_log as access_log_sink

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
    access_log_sink.configure(buffer)

    async def lines() -> list[dict]:
        await asyncio.sleep(0)  # lines leave when the loop turns
        return [json.loads(line) for line in buffer.getvalue().splitlines()]

    yield lines
    access_log_sink.configure(None)


@pytest.fixture(scope="session")
def vllm_servers() -> Iterator[list[VllmServer]]:
    """Two real vLLM servers for the whole session (installed and built on first use)."""
    with running([VllmServer(), VllmServer()]) as servers:
        yield list(servers)
