"""The proxy's client connections: within their caps, each request's head read in time, and
aiohttp's own protocol errors answered as OpenAI-style JSON (docs/design.md §6, Slow
senders and Errors).

aiohttp's ``RequestHandler`` is the protocol of each connection: it parses the requests and
runs their handlers. :class:`Connection` is that protocol with three things more:

- at accept, the process's :class:`~sfq_proxy.core.senders.Connections` admit it (the
  connections idle the longest giving way) or refuse it: closed at once;
- a timer from accept, or from the first byte of a later request on a kept-alive
  connection, to the end of its request's head: past ``limits.header_timeout_s`` the
  connection gets a 408 and is closed (one timer a connection; a head that comes in one
  piece, as most do, arms none on a kept-alive connection);
- ``handle_error``: what aiohttp answers for a request it cannot parse (a bad request line,
  a malformed header, one too long), its text echoing the offending line, a client's key
  with it, is a JSON 400 that repeats nothing of the request, and the log says only which
  kind of error it was.

Bodies are read within time and within the queue memory by the handler (``body.py``), which
knows whose they are.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import resource
import time
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from ..config import Config
from ..core.errors import ApiError
from ..core.senders import Connections, connection_caps
from ..state.redis_client import MAX_CONNECTIONS as REDIS_CONNECTIONS
from .error_response import error_response
from .proxy import Proxy

log = logging.getLogger(__name__)
# the file descriptors a process needs besides its clients' and its backends' (each backend's
# slots, and one for its health probe): stdio, the event loop's, the listening sockets, the
# usage database and its journal, the calibration and key files as they are saved, a
# tokenizer's files, the workers' metrics files, and the room for a burst of accepts that
# come in one turn of the loop before they are counted. Redis's: its pool's bound.
BASE_FDS = 128
# the default total's ceiling, whatever the open files allow: ~10 KiB a connection waiting
# for its head (aiohttp's protocol and parser, the transport), 160 MiB at most in all
CEILING = 16_384
WARN_EVERY_S = 60.0
_HEAD_LATE = ApiError(
    408, "The request's head did not arrive in time (limits.header_timeout_s).",
    code="request_timeout",
)  # fmt: skip
_BAD_REQUEST = {  # the kind of error, never its text: that holds the request's bytes
    LineTooLong: "A line of the request's head (its request line or a header) is too long.",
    BadHttpMethod: "The request's method is not valid.",
    BadStatusLine: "The request line is not valid HTTP/1.1.",
    InvalidURLError: "The request's target is not a valid URL.",
    InvalidHeader: "A header of the request is not valid.",
    PayloadEncodingError: "The request's body is not framed as its headers say.",
}


def _raw_answer(error: ApiError) -> bytes:
    """``error`` as a whole HTTP/1.1 answer that closes its connection, for the times there
    is no request to answer through aiohttp."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


HEAD_LATE = _raw_answer(_HEAD_LATE)


def fd_reserve(config: Config) -> int:
    """The open files a process of ``config`` keeps for everything but its clients."""
    # a backend's requests, and its probe (with engine dispatch, a scrape too)
    backends = sum(
        pool.slots_of(b) + 1 + pool.engine for pool in config.pools.values() for b in pool.backends
    )
    return BASE_FDS + backends + (REDIS_CONNECTIONS if config.state is not None else 0)


def fd_limit() -> int:
    """The process's limit of open files (``ulimit -n``, the soft one)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


def peer_of(peername: Any) -> str:
    """A connection's peer for its cap: its IPv4 address, or its IPv6 address's /64 (what
    one host is given); "" when there is none (a Unix socket)."""
    host = peername[0] if isinstance(peername, tuple) and peername else None
    if not isinstance(host, str):
        return ""
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class Guard:
    """What a process's connections share: their caps, as the live config and the open files
    set them (read again when a reload changes the config), and the connections open."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy
        self._config: Config | None = None
        self.connections: Connections[Connection] = Connections(1, 1)
        self.header_timeout_s = 10.0
        self._warned = -WARN_EVERY_S
        self._refresh()

    def _refresh(self) -> None:
        config = self._proxy.config
        if config is self._config:
            return
        self._config, limits = config, config.limits
        total, per_peer, warning = connection_caps(
            limits.max_connections, limits.max_connections_per_peer, fd_limit(),
            fd_reserve(config), CEILING,
        )  # fmt: skip
        self.connections.total, self.connections.per_peer = total, per_peer
        self.header_timeout_s = limits.header_timeout_s
        if warning is not None:
            log.warning("%s", warning)
        log.info("client connections: at most %d, %d per peer", total, per_peer)

    def open(self, conn: Connection, peer: str) -> list[Connection] | None:
        """``conn`` is accepted: the connections it makes close, or None to refuse it."""
        self._refresh()
        victims = self.connections.open(conn, peer)
        if victims is None and time.monotonic() - self._warned >= WARN_EVERY_S:
            self._warned = time.monotonic()
            connections = self.connections
            log.warning(
                "client connections at their cap, each serving a request: %d open (at most "
                "%d), %d of them from %s (at most %d); refusing new ones (limits.max_connections, "
                "limits.max_connections_per_peer)",
                len(connections), connections.total, connections.of(peer), peer or "?",
                connections.per_peer,
            )  # fmt: skip
        return victims


class Connection(RequestHandler):
    """One client connection: aiohttp's protocol, within the process's caps, its heads read
    in time, its protocol errors answered as JSON (the module's docstring)."""

    __slots__ = ("_guard", "_head_timer", "_peer", "_refused", "_serving")

    def __init__(self, manager: Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager.guard
        self._peer = ""
        self._head_timer: asyncio.TimerHandle | None = None
        self._serving = False  # a request's head is in: it is being served
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer = peer_of(transport.get_extra_info("peername"))
        victims = self._guard.open(self, self._peer)
        if victims is None:  # a cap, and every connection in the way serves a request
            self._refused = True
            transport.close()
            return
        for victim in victims:
            victim.force_close()
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._guard.connections.close(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._serving:  # a body, or a pipelined request
            return
        if self._messages:  # a request's head is in (or an error in it): it is served
            self._serving = True
            self._guard.connections.busy(self)
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif data and self._head_timer is None and self.transport is not None:
            self._arm()  # the first bytes of a later request, its head not whole

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if not request.content.is_eof():
            # answered before its body was whole (refused, or cut): what more comes of it is
            # dropped as it comes, not held, and the connection closes once aiohttp has
            # lingered for the answer to be read
            self.close()
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if not self._messages:  # nothing more to serve: idle, until a next request
                self._serving = False
                self._guard.connections.idle(self)

    def _arm(self) -> None:
        loop = self._loop
        self._head_timer = loop.call_at(loop.time() + self._guard.header_timeout_s, self._late)

    def _late(self) -> None:
        """The head did not come in time: a 408, and the connection is closed."""
        self._head_timer = None
        if self._serving or self.transport is None:
            return
        if not self._close:  # no answer of its own is being lingered over
            self.transport.write(HEAD_LATE)
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """An OpenAI-style JSON error for what aiohttp answers itself: a request it cannot
        parse (400), a handler that raised (500; the proxy's own answer their errors) or
        timed out (504). Nothing of the request is repeated, in the answer or the log."""
        if status == 400:
            kind = next((m for t, m in _BAD_REQUEST.items() if isinstance(exc, t)), None)
            log.debug("a request from %s was not valid HTTP: %s", self._peer, type(exc).__name__)
            error = ApiError(400, kind or "The request is not valid HTTP/1.1.")
        else:
            self.log_exception("Error handling request from %s", self._peer, exc_info=exc)
            error = ApiError(status, "The proxy failed to serve this request.")
        if request.writer.output_size > 0:  # aiohttp's rule: the answer had started
            raise ConnectionError("the answer had started: no error answer can follow")
        response = error_response(error)
        response.force_close()
        return response


class Server(web.Server):
    """aiohttp's server for the app, whose connections are :class:`Connection`\\ s."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        return Connection(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """``web.AppRunner``, serving through a :class:`Server` sharing ``guard``."""

    def __init__(self, app: web.Application, guard: Guard, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard = guard

    async def _make_server(self) -> web.Server:
        made = await super()._make_server()  # the app started and frozen, as aiohttp does it
        return Server(
            made.request_handler, request_factory=made.request_factory, guard=self._guard,
            **self._kwargs,
        )  # fmt: skip
