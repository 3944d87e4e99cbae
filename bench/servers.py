"""The processes harness.py starts around the proxy: a paced backend, a bare pass-through,
and sfq-proxy with features switched off or profiled.

    python bench/servers.py paced PORT [--events 200] [--pause-ms 1]
    python bench/servers.py passthrough [--processes N] [--upstream] PORT BACKEND_URL [...]
    python bench/servers.py serve MODULE serve --config FILE [...]

``paced``: nginx sends a stored stream in one burst, so a proxy relays it in a few large
chunks; a model server writes one event per token. This server does that with as little
CPU of its own as it can (a raw asyncio protocol on uvloop, every byte built before it
starts: ~12-18 µs per event), so that what a proxy in front of it spends per event can be
measured: it answers any POST with a 200 stream of ``--events`` chat-completion chunks, a
usage chunk and ``[DONE]``, each written and drained on its own, ``--pause-ms`` apart;
``GET /health`` gets a 200. Keep-alive; the request's body is read and ignored.

``passthrough``: the floor, a bare aiohttp + uvloop relay with nothing sfq-proxy does: it
forwards POSTs to the backends in turn over pooled keep-alive connections and relays the
answer as it arrives. No auth, no parsing, no queue, no metrics, no log. ``--processes N``
forks N processes sharing the port (SO_REUSEPORT, as ``sfq-proxy serve --workers N``): what
the machine gives a second process when nothing is shared (state/redis_client.py).
``--upstream`` sends with sfq-proxy's own connections (``sfq_proxy/http/upstream.py``)
instead of aiohttp's ``ClientSession``: the floor on the client the proxy uses.

``serve``: runs MODULE (``sfq_proxy.cli``) as ``python -m MODULE serve …`` would, after
replacing by nothing the features named in ``$SFQ_BENCH_OFF`` (harness.FEATURES; in this
process only: broken on purpose, it measures, it never serves — no metrics, no access line,
a usage event left in the stream), and, with ``$SFQ_BENCH_PROFILE`` set, running cProfile
from a SIGUSR1 to a SIGUSR2, which writes the profile there (pstats).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import itertools
import os
import runpy
import signal
import sys
from typing import Any

import aiohttp
import uvloop
from aiohttp import web
from harness import FEATURES, OFF_ENV, PROFILE_ENV, stream

# --- paced ----------------------------------------------------------------------------------

HEADERS = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"


def events(count: int) -> list[bytes]:
    """harness.stream's events, each an HTTP chunk ready to write; the last ends the body."""
    lines = [line.encode() + b"\n\n" for line in stream("bench-paced", count).split("\n\n")]
    out = [b"%x\r\n%s\r\n" % (len(line), line) for line in lines[:-1]]  # the last is empty
    out[-1] += b"0\r\n\r\n"
    return out


class Paced(asyncio.Protocol):
    def __init__(self, stream: list[bytes], pause_s: float) -> None:
        self.stream, self.pause_s = stream, pause_s
        self.buffer = b""
        self.busy: asyncio.Task[None] | None = None
        self.drained = asyncio.Event()
        self.drained.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.drained.clear()

    def resume_writing(self) -> None:
        self.drained.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy is not None:
            self.busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.busy is None or self.busy.done():
            self.busy = asyncio.ensure_future(self.serve())

    async def serve(self) -> None:
        """Answer each whole request in the buffer, in order (keep-alive)."""
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(self.buffer) < end + 4 + length:
                return  # the rest of the body has not come yet
            self.buffer = self.buffer[end + 4 + length :]
            if head.startswith(b"get"):
                self.transport.write(HEALTH)
                continue
            self.transport.write(HEADERS)
            for piece in self.stream:
                self.transport.write(piece)
                await self.drained.wait()
                await asyncio.sleep(self.pause_s)


async def paced(port: int, count: int, pause_ms: float) -> None:
    stream = events(count)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Paced(stream, pause_ms / 1000), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


# --- passthrough ----------------------------------------------------------------------------


def passthrough_app(backends: list[str], upstream: bool = False) -> web.Application:
    turn = itertools.cycle(backends)
    app = web.Application()
    if upstream:
        app.router.add_post("/{tail:.*}", _with_upstreams(turn))
        return app

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with app["session"].post(next(turn) + request.path, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/{tail:.*}", forward)
    return app


def _with_upstreams(turn: itertools.cycle[str]):  # type: ignore[no-untyped-def]
    from sfq_proxy.http.upstream import Upstreams

    upstreams = Upstreams()
    headers = {"Content-Type": "application/json"}

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        up = await upstreams.post(next(turn) + request.path, body, headers, 10.0)
        try:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.headers.get("Content-Type", "text/plain").split(";")[0]
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            up.release()

    return forward


def passthrough(port: int, backends: list[str], processes: int, upstream: bool) -> None:
    children = []
    for _ in range(processes - 1):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    try:
        web.run_app(
            passthrough_app(backends, upstream), host="127.0.0.1", port=port, print=None,
            access_log=None, reuse_port=processes > 1, loop=uvloop.new_event_loop(),
        )  # fmt: skip
    finally:  # the first process, stopped, stops the others
        for pid in children:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


# --- serve, features off or profiled --------------------------------------------------------


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


class _PassThrough:
    """A usage stripper that strips nothing."""

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def close(self) -> bytes:
        return b""


# feature of harness.FEATURES: [(module, attribute path, what replaces it)]
REPLACE: dict[str, list[tuple[str, str, object]]] = {
    "access_log": [("sfq_proxy.observability.access_log", "AccessRecord.emit", _nothing)],
    "metrics": [("sfq_proxy.observability.metrics", f"Metrics.{name}", _nothing)
                for name in ("seen", "count", "observe", "first_byte", "placed")],
    "calibration": [("sfq_proxy.core.cost", "CostModel.observe", _nothing)],
    "answer_counting": [("sfq_proxy.http.handler", "_count_answer", _nothing)],
    "settling": [("sfq_proxy.http.handler", "_settle", _nothing)],
    "ratelimit_headers": [("sfq_proxy.core.limits", "ratelimit_headers", lambda *_: {})],
    "usage_stripper": [("sfq_proxy.http.relay", "_UsageStripper", _PassThrough)],
    "error_event": [("sfq_proxy.http.handler", "error_event", lambda _: False)],
}  # fmt: skip
assert set(REPLACE) == set(FEATURES)


def serve(module: str, argv: list[str]) -> None:
    """``python -m module argv``, with $SFQ_BENCH_OFF's features replaced and
    $SFQ_BENCH_PROFILE's profile."""
    for feature in filter(None, os.environ.get(OFF_ENV, "").split(",")):
        for name, path, replacement in REPLACE[feature]:
            owner: Any = importlib.import_module(name)
            *parents, attribute = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            setattr(owner, attribute, replacement)
    if out := os.environ.get(PROFILE_ENV):
        profile = cProfile.Profile()

        def stop(*_: object) -> None:
            profile.disable()
            profile.dump_stats(out + ".part")
            os.replace(out + ".part", out)  # whole once it is there

        signal.signal(signal.SIGUSR1, lambda *_: profile.enable())
        signal.signal(signal.SIGUSR2, stop)
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="server", required=True)
    p = sub.add_parser("paced", help="a backend writing each SSE event on its own, paced")
    p.add_argument("port", type=int)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--pause-ms", type=float, default=1.0)
    p = sub.add_parser("passthrough", help="the bare aiohttp + uvloop relay")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("--upstream", action="store_true", help="on sfq-proxy's upstream client")
    p.add_argument("port", type=int)
    p.add_argument("backends", nargs="+")
    p = sub.add_parser("serve", help="sfq-proxy's CLI, features off or profiled")
    p.add_argument("module")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.server == "paced":
        uvloop.run(paced(args.port, args.events, args.pause_ms))
    elif args.server == "passthrough":
        passthrough(args.port, args.backends, args.processes, args.upstream)
    else:
        serve(args.module, args.argv)


if __name__ == "__main__":
    main()
