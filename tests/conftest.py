"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from e2e import Lab


@pytest.fixture
async def lab() -> AsyncIterator[Lab]:
    """Simulated backends and proxies, all stopped when the test ends."""
    async with contextlib.AsyncExitStack() as stack:
        yield Lab(stack)
