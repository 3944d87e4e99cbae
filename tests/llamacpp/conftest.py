"""Real llama.cpp servers for tests/llamacpp: run only once `make llamacpp` has built them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llamacpp_backend import LlamaCppServer, is_ready
from server_process import running


@pytest.fixture(scope="session")
def llamacpp_servers() -> Iterator[list[LlamaCppServer]]:
    """Two llama-cpp-python servers for the session, with the server's defaults (a request
    arriving during a stream ends that stream). Skips when the build is missing: compiling
    llama.cpp takes minutes, so a plain `pytest` does not do it on demand."""
    if not is_ready():
        pytest.skip("llama-cpp-python not built: run `make llamacpp`")
    with running([LlamaCppServer(), LlamaCppServer()]) as servers:
        yield list(servers)
