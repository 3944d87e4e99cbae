"""Nothing a client sends is echoed or logged unbounded (issue 39): a 5 MB model name, an
8 KB header or path, through the real proxy. Each value the proxy quotes, in an error's
message or the access log, is cut to 256 characters and says so (``…(cut, 5242880
chars)``); each line of the operational log, to 512. aiohttp itself refuses a request line
or a header field over 8190 bytes, so those are tried at 8,000.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from proxy_lab import KEYS, MODEL, Lab, Served, proxy_config

from sfq_proxy.observability import access_log as access_log_sink
from sfq_proxy.observability import logs

BIG = 5 * 1024 * 1024  # a model name as large as the body allows
LONG = 8000  # a header, path or method as long as aiohttp lets through
CHAT = [{"role": "user", "content": "hi"}]
SMALL_BODY = 600  # bytes: an error's body, with one value quoted and cut
SMALL_LOGS = 10_000  # bytes: what five hostile requests may add to each log


@dataclass
class Logged:
    """What the proxy wrote to its access log and its operational log (every logger, at
    debug, as ``serve`` writes it: redacted, JSON or text)."""

    access: io.StringIO
    operational: io.StringIO

    def sizes(self) -> tuple[int, int]:
        access_log_sink.configure(None)  # flushes what is left
        return len(self.access.getvalue()), len(self.operational.getvalue())


@pytest.fixture(params=["json", "text"])
def logged(request: pytest.FixtureRequest) -> Iterator[Logged]:
    fmt = request.param
    access, operational = io.StringIO(), io.StringIO()
    access_log_sink.configure(access, fmt=fmt)
    handler = logging.StreamHandler(operational)
    handler.setFormatter(logs.RedactingFormatter(fmt))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield Logged(access, operational)
    root.removeHandler(handler)
    root.setLevel(level)
    access_log_sink.configure(None)


@pytest.fixture
async def served(lab: Lab) -> Served:
    sim = await lab.backend()
    extra = {"extra_paths": [{"path": "/v1/rerank", "cost": {"fixed": 50}}]}
    return await lab.proxy(proxy_config([sim.url], pool=extra))


async def _ask(
    lab: Lab, served: Served, method: str, path: str, body: Any = None, **headers: str
) -> tuple[int, bytes, dict[str, str]]:
    http = await lab.http()
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {KEYS['A']}", **headers}
    async with http.request(method, f"{served.url}{path}", data=data, headers=headers) as r:
        return r.status, await r.read(), dict(r.headers)


def _error(body: bytes) -> dict[str, Any]:
    error: dict[str, Any] = json.loads(body)["error"]
    return error


async def test_five_requests_for_a_5_mb_model_add_little_to_the_logs(
    lab: Lab, served: Served, logged: Logged
) -> None:
    for _ in range(5):
        status, body, _ = await _ask(
            lab, served, "POST", "/v1/chat/completions", {"model": "m" * BIG, "messages": CHAT}
        )
        assert status == 404
        assert len(body) <= SMALL_BODY
        error = _error(body)
        assert error["code"] == "model_not_found"
        assert f"'{'m' * 256}…(cut, {BIG} chars)'" in error["message"]
    access, operational = logged.sizes()
    assert access <= SMALL_LOGS
    assert operational <= SMALL_LOGS
    assert logged.access.getvalue().count(f"(cut, {BIG} chars)") == 5


async def test_a_5_mb_model_on_an_extra_path_is_not_echoed_whole(
    lab: Lab, served: Served, logged: Logged
) -> None:
    """Its 404 is written by the body's parser (core/inference_request.py), which cuts the
    name as every other quote does."""
    status, body, _ = await _ask(lab, served, "POST", "/v1/rerank", {"model": "m" * BIG})
    assert status == 404
    assert len(body) <= SMALL_BODY
    assert "…(cut, " in _error(body)["message"]
    access, operational = logged.sizes()
    assert access <= SMALL_LOGS
    assert operational <= SMALL_LOGS


async def test_a_5_mb_value_of_a_field_gets_a_400_that_names_the_field_only(
    lab: Lab, served: Served, logged: Logged
) -> None:
    for field in ("max_tokens", "stream", "messages"):
        chat = {"model": MODEL, "messages": CHAT, field: "x" * BIG}
        status, body, _ = await _ask(lab, served, "POST", "/v1/chat/completions", chat)
        assert status == 400
        assert len(body) <= SMALL_BODY
        assert f"'{field}'" in _error(body)["message"]
    access, operational = logged.sizes()
    assert access <= SMALL_LOGS
    assert operational <= SMALL_LOGS


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/v1/chat/completions", {"X-Workload-Class": "c" * LONG}, 403),
        ("POST", "/v1/chat/completions", {"X-Request-Id": "r" * LONG}, 200),
        ("GET", "/v1/models/" + "m" * LONG, {}, 404),
        ("POST", "/v1/" + "p" * LONG, {}, 404),
    ],
    ids=["class-header", "request-id", "model-path", "path"],
)
async def test_an_8_kb_header_or_path_is_cut_wherever_it_is_quoted(
    lab: Lab,
    served: Served,
    logged: Logged,
    method: str,
    path: str,
    headers: dict[str, str],
    status: int,
) -> None:
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    for _ in range(5):
        got, body, answer = await _ask(lab, served, method, path, chat, **headers)
        assert got == status
        assert len(body) <= (SMALL_BODY if status != 200 else 4096)
        assert len(answer.get("X-Request-Id", "")) <= 128
        if status != 200:
            assert "…(cut, 80" in _error(body)["message"]
    access, operational = logged.sizes()
    assert access <= SMALL_LOGS
    assert operational <= SMALL_LOGS


async def _raw(served: Served, request: bytes) -> bytes:
    """``request`` as it is, on a connection of its own; the answer, once the proxy closes."""
    host, port = served.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(request)
    answer = await reader.read()
    writer.close()
    return answer


@pytest.mark.parametrize(
    "sent",
    [
        b"M" * LONG + b" /healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # logged at debug
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: " + b"a\x01" * (LONG // 2) + b"\r\n\r\n",
    ],
    ids=["method", "header-value"],
)
async def test_what_aiohttp_cannot_parse_is_neither_echoed_nor_logged(
    served: Served, logged: Logged, sent: bytes
) -> None:
    """aiohttp refuses these itself; it used to log the exception with what it could not
    parse, as it was (a header's value written as ``b'a\\x01…'``: 8 KB sent, 20 KB logged,
    at error), and answer it in plain text. The proxy's own handler of its protocol errors
    (http/connections.py) answers a JSON 400 and logs the error's kind alone."""
    for _ in range(5):
        answer = await _raw(served, sent)
        assert answer.split(b" ", 2)[1] == b"400"
        assert len(answer) <= SMALL_BODY
        assert b"MMMMMMMM" not in answer
        assert b"a\x01a" not in answer
    access, operational = logged.sizes()
    assert access == 0
    assert operational <= SMALL_LOGS
    text = logged.operational.getvalue()
    assert "MMMMMMMM" not in text
    assert "a\\x01a" not in text
