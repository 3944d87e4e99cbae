"""Keep-alive HTTP/1.1 connections to the backends, for the relay's one kind of request.

The relay sends one kind of request: a POST of bytes it holds, to a URL it knows, with a
few headers. aiohttp's ``ClientSession`` builds that request from parts on every call (a
URL parsed, headers merged into a multidict, a payload object, a connector's bookkeeping,
timers, a response object): about 250 µs of CPU a request on this project's bench machine,
as much as the rest of a bare pass-through. Here the request line and ``Host`` are built
once per URL and the rest written in one go. What reads the answer is aiohttp's own
client protocol, ``ResponseHandler``: its C parser, its ``StreamReader`` with flow control,
and its errors (``ClientPayloadError`` for a broken body, ``ServerDisconnectedError``…),
so the relay handles an answer as it handled aiohttp's.

A connection goes back to its backend's idle ones only when its answer was read to the
end and nothing says to close it (``Connection: close``, HTTP/1.0, bytes beyond the
answer, an error); one idle longer than ``keepalive_s`` is closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache, partial

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDictProxy
from yarl import URL

KEEPALIVE_S = 60.0  # idle connections kept this long (the health probes' session too)
_READ_BUFSIZE = 2**16  # aiohttp's default: what a read may hold before reading pauses

_Address = tuple[str, int, bool]  # host, port, TLS


@dataclass(frozen=True, slots=True)
class _Target:
    address: _Address
    head: bytes  # the request line and Host


@lru_cache(maxsize=1024)
def _target(url: str) -> _Target:
    """What a URL's requests start with (its backend's base and a route: few of them)."""
    parsed = URL(url)
    host, port = parsed.raw_host, parsed.port
    if parsed.scheme not in ("http", "https") or not host or port is None:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    shown = f"[{host}]" if ":" in host else host
    if parsed.explicit_port is not None:
        shown = f"{shown}:{port}"
    line = f"POST {parsed.raw_path_qs} HTTP/1.1\r\nHost: {shown}\r\n"
    return _Target((host, port, parsed.scheme == "https"), line.encode("ascii"))


def _header(name: str, value: str) -> str:
    """One header line; the names are the proxy's own, the values checked (a client's
    trace context and request id are checked before, a config's key at load: this is the
    last guard against a line break that would let a value write its own headers)."""
    if "\r" in value or "\n" in value:
        raise ValueError(f"the value of {name!r} would break the request's framing")
    return f"{name}: {value}\r\n"


class Answer:
    """A backend's answer as its headers came, its body still to read from ``content``."""

    def __init__(
        self,
        owner: Upstreams,
        address: _Address,
        connection: ResponseHandler,
        status: int,
        headers: CIMultiDictProxy[str],
        content: aiohttp.StreamReader,
    ) -> None:
        self._owner, self._address = owner, address
        self._connection: ResponseHandler | None = connection  # None once given back
        self.status, self.headers, self.content = status, headers, content

    async def read(self) -> bytes:
        """The whole body."""
        return await self.content.read()

    def close(self) -> None:
        """Close the connection at once: its backend stops the work (vLLM aborts)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def release(self) -> None:
        """Done with: the connection is kept for the next request if it can be."""
        connection, self._connection = self._connection, None
        if connection is not None:
            self._owner.give_back(self._address, connection)


class Upstreams:
    """The proxy's connections to every backend, idle ones kept per host, port and TLS."""

    def __init__(self, keepalive_s: float = KEEPALIVE_S) -> None:
        self._keepalive_s = keepalive_s
        self._idle: dict[_Address, deque[tuple[ResponseHandler, float]]] = {}
        self._tls: ssl.SSLContext | None = None  # made when a first https backend is used

    async def post(
        self, url: str, body: bytes, headers: Mapping[str, str], connect_s: float
    ) -> Answer:
        """POST ``body`` to ``url``; return once the answer's headers are in (an
        informational answer, 100 or 103, is skipped). Raises ``aiohttp.ClientError``s:
        refused, connect timeout (``connect_s``), reset, or not HTTP."""
        target = _target(url)
        head = "".join([_header(name, value) for name, value in headers.items()])
        head += f"Content-Length: {len(body)}\r\n\r\n"
        connection = self._idle_connection(target.address)
        if connection is None:
            connection = await self._connect(target.address, connect_s)
        try:
            connection.set_response_params(
                read_until_eof=True, auto_decompress=False, read_bufsize=_READ_BUFSIZE
            )
            assert connection.transport is not None
            connection.transport.writelines((target.head, head.encode(), body))
            message, content = await connection.read()
            while 100 <= message.code < 200 and message.code != 101:
                message, content = await connection.read()
        except HttpProcessingError as exc:
            connection.close()
            raise aiohttp.ClientConnectionError(f"not an HTTP answer: {exc.message}") from None
        except BaseException:
            connection.close()
            raise
        return Answer(self, target.address, connection, message.code, message.headers, content)

    def give_back(self, address: _Address, connection: ResponseHandler) -> None:
        """Keep ``connection`` for ``address``'s next request, if it can serve one."""
        if connection.should_close or not connection.is_connected():
            connection.close()
            return
        now = asyncio.get_running_loop().time()
        idle = self._idle.setdefault(address, deque())
        idle.append((connection, now))
        while now - idle[0][1] > self._keepalive_s:
            idle.popleft()[0].close()

    def close(self) -> None:
        """Close every idle connection (those in use are closed by their requests)."""
        for idle in self._idle.values():
            while idle:
                idle.pop()[0].close()

    def _idle_connection(self, address: _Address) -> ResponseHandler | None:
        """The most recently used idle connection that is still open and fresh."""
        idle = self._idle.get(address)
        now = asyncio.get_running_loop().time()
        while idle:
            connection, since = idle.pop()
            fresh = now - since <= self._keepalive_s
            if fresh and connection.is_connected() and not connection.should_close:
                return connection
            connection.close()
        return None

    async def _connect(self, address: _Address, connect_s: float) -> ResponseHandler:
        host, port, tls = address
        loop = asyncio.get_running_loop()
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        try:
            async with asyncio.timeout(connect_s):
                _, connection = await loop.create_connection(
                    partial(ResponseHandler, loop), host, port, ssl=self._tls if tls else None
                )
        except TimeoutError:
            raise aiohttp.ConnectionTimeoutError(
                f"Connection timeout to {host}:{port} after {connect_s:g} s"
            ) from None
        except OSError as exc:  # refused, unreachable, a name that does not resolve, TLS
            raise aiohttp.ClientConnectionError(f"Cannot connect to {host}:{port}: {exc}") from exc
        return connection
