"""The hot path to Redis: one connection that carries every request's function calls,
pipelined (``Pipe``).

redis-py's asyncio client spends 150–200 µs of CPU on each call on this project's test
machine (its connection pool, its stream reader, a timeout per call), where the round trip
itself costs 40 µs; with two calls per request (a submit and a finish) that was most of what
the shared state added to a request. A pipe writes each call as it comes (the calls of one
loop turn leave in one write) and matches replies to calls by their order, which is how
Redis answers on one connection. Redis runs one call at a time anyway, so one connection
loses nothing, and a caller that gives up (a client that left) leaves no connection in a
doubtful state: its reply still arrives, in its turn, and is dropped.

Only what the proxy sends on its hot path goes here: ``FCALL`` (and ``FUNCTION LOAD``).
Blocking reads, transactions, Sentinel and Cluster stay with redis-py. Errors are redis-py's
exceptions, so callers handle one family.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from redis.exceptions import ConnectionError, ResponseError, TimeoutError


class _Incomplete(Exception):
    """The buffer ends inside a reply: wait for more bytes."""


class Pipe:
    """Calls to one Redis server over one pipelined connection, opened on first use and
    again after it is lost (every call in flight then fails with ``ConnectionError``)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        connect_timeout_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.address = (host, port)
        self._hello = _hello(db, username, password)
        self._tls = tls
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._link: _Link | None = None
        self._connecting: asyncio.Future[_Link] | None = None

    @classmethod
    def from_url(cls, url: str, **timeouts: float) -> Pipe | None:
        """A pipe for a ``redis://`` or ``rediss://`` URL (user, password and database
        from it); None for any other kind, which redis-py serves."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or parts.query:
            return None
        db = parts.path.strip("/") or "0"
        return cls(
            parts.hostname or "localhost",
            parts.port or 6379,
            db=int(db),
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            tls=ssl.create_default_context() if parts.scheme == "rediss" else None,
            **timeouts,
        )

    async def execute(self, *args: str | bytes | int | float) -> Any:
        """Send one command and wait for its reply (a ``ResponseError`` reply raises)."""
        link = self._link if self._link is not None and self._link.open else await self._open()
        return await link.send(_pack(args))

    async def aclose(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    async def _open(self) -> _Link:
        """One connect for every caller that finds the pipe closed."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(self._connected)
        return await asyncio.shield(self._connecting)

    def _connected(self, done: asyncio.Future[_Link]) -> None:
        self._connecting = None
        if not done.cancelled() and done.exception() is None:
            self._link = done.result()

    async def _connect(self) -> _Link:
        loop = asyncio.get_running_loop()
        host, port = self.address
        try:
            _, link = await asyncio.wait_for(
                loop.create_connection(lambda: _Link(self._timeout_s), host, port, ssl=self._tls),
                self._connect_timeout_s,
            )
        except (OSError, TimeoutError) as err:
            raise ConnectionError(f"Error connecting to {host}:{port}: {err}") from err
        try:
            for command in self._hello:  # written first: nothing else can come before them
                await link.send(command)
        except BaseException:
            link.close()
            raise
        return link


class _Link(asyncio.Protocol):
    """One open connection: calls written, and futures waiting for their replies in order."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._transport: asyncio.Transport | None = None
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._out: list[bytes] = []  # this loop turn's calls, written together
        self._in = bytearray()
        self._watch: asyncio.TimerHandle | None = None
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances, but have its methods
        self._transport, self.open = cast(asyncio.Transport, transport), True

    def send(self, command: bytes) -> asyncio.Future[Any]:
        if not self.open:
            raise ConnectionError("connection to Redis lost")
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._waiting.append((reply, loop.time() + self._timeout_s))
        if not self._out:
            loop.call_soon(self._flush)
        self._out.append(command)
        if self._watch is None:
            self._watch = loop.call_later(self._timeout_s, self._check)
        return reply

    def _flush(self) -> None:
        if self.open and self._transport is not None:
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _check(self) -> None:
        """The oldest call waits past its time: Redis stalls, and the connection goes."""
        self._watch = None
        if not self._waiting:
            return
        loop = asyncio.get_running_loop()
        due = self._waiting[0][1]
        if loop.time() >= due:
            self._fail(TimeoutError(f"Redis did not answer within {self._timeout_s:g} s"))
        else:
            self._watch = loop.call_at(due, self._check)

    def data_received(self, data: bytes) -> None:
        self._in += data
        at = 0
        while self._waiting:
            try:
                reply, at = _parse(self._in, at)
            except _Incomplete:
                break
            except ConnectionError as err:  # not Redis speaking: nothing after is trusted
                self._fail(err)
                return
            future, _ = self._waiting.popleft()
            if future.done():  # its caller left
                continue
            if isinstance(reply, ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)
        del self._in[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"connection to Redis lost: {exc or 'closed by Redis'}"))

    def close(self) -> None:
        self._fail(ConnectionError("connection to Redis closed"))

    def _fail(self, err: Exception) -> None:
        """Every call in flight gets ``err``; the next call opens a new connection."""
        self.open = False
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        while self._waiting:
            future, _ = self._waiting.popleft()
            if not future.done():
                future.set_exception(err)
        if self._transport is not None:
            self._transport.abort()


def _hello(db: int, username: str | None, password: str | None) -> list[bytes]:
    """What a new connection sends before any call: its credentials, its database."""
    commands = []
    if password is not None:
        auth = ("AUTH", username, password) if username else ("AUTH", password)
        commands.append(_pack(auth))
    if db:
        commands.append(_pack(("SELECT", db)))
    return commands


def _pack(args: tuple[str | bytes | int | float | None, ...]) -> bytes:
    """A command as RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, float):
            data = repr(arg).encode()
        else:
            data = str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _parse(buffer: bytearray, at: int) -> tuple[Any, int]:
    """One RESP2 reply from ``at``: the value (bulk strings as bytes, an error as a
    ``ResponseError`` value) and where the next one starts. Anything else is not Redis."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        raise _Incomplete
    kind, line, at = buffer[at], bytes(buffer[at + 1 : end]), end + 2
    if kind == 0x2B:  # + simple string
        return line, at
    if kind == 0x2D:  # - error
        return ResponseError(line.decode(errors="replace")), at
    if kind not in (0x3A, 0x24, 0x2A) or not line.lstrip(b"-").isdigit():
        raise ConnectionError(f"Redis sent no RESP reply: {bytes([kind]) + line[:40]!r}")
    number = int(line)
    if kind == 0x3A:  # : integer
        return number, at
    if number < 0:  # a null bulk string or array
        return None, at
    if kind == 0x24:  # $ bulk string
        if len(buffer) < at + number + 2:
            raise _Incomplete
        return bytes(buffer[at : at + number]), at + number + 2
    items = []  # * array
    for _ in range(number):
        item, at = _parse(buffer, at)
        items.append(item)
    return items, at
