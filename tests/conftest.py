"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest
from e2e import Lab
from hypothesis import settings
from vllm_backend import VllmServer

# No timing assertions, hypothesis's per-example deadline included: shared machines stall.
settings.register_profile("sfq", deadline=None)
settings.load_profile("sfq")


@pytest.fixture
async def lab() -> AsyncIterator[Lab]:
    """Simulated backends and proxies, all stopped when the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        yield Lab(stack)


@pytest.fixture(scope="session")
def vllm_servers() -> Iterator[list[VllmServer]]:
    """Two real vLLM servers for the whole session (installed and built on first use)."""
    servers = [VllmServer(), VllmServer()]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()
