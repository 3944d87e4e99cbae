"""The floor: a bare aiohttp + uvloop pass-through, with nothing sfq-proxy does.

    python bench/passthrough.py [--processes N] [--upstream] PORT BACKEND_URL [...]

Forwards POSTs to the backends in turn over pooled keep-alive connections and relays the
answer as it arrives. No auth, no parsing, no queue, no metrics, no log. `--processes N`
forks N processes sharing the port (SO_REUSEPORT, as `sfq-proxy serve --workers N`): what
the machine gives a second process when nothing is shared (bench/shared_state.py).
`--upstream` sends with sfq-proxy's own connections (`sfq_proxy/http/upstream.py`)
instead of aiohttp's `ClientSession`: the floor on the client the proxy uses.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web


def make_app(backends: list[str], upstream: bool = False) -> web.Application:
    turn = itertools.cycle(backends)
    app = web.Application()
    if upstream:
        app.router.add_post("/{tail:.*}", _with_upstreams(turn))
        return app

    async def session_ctx(app: web.Application):
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


def _with_upstreams(turn: itertools.cycle[str]):
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


def main(argv: list[str]) -> None:
    processes, upstream = 1, False
    if argv[0] == "--processes":
        processes, argv = int(argv[1]), argv[2:]
    if argv[0] == "--upstream":
        upstream, argv = True, argv[1:]
    port, *backends = argv
    children = []
    for _ in range(processes - 1):
        pid = os.fork()
        if pid == 0:
            children = []
            break
        children.append(pid)
    print(f"passthrough listening on http://127.0.0.1:{port}", flush=True)
    try:
        web.run_app(
            make_app(backends, upstream), host="127.0.0.1", port=int(port), print=None,
            access_log=None, reuse_port=processes > 1, loop=uvloop.new_event_loop(),
        )  # fmt: skip
    finally:  # the first process, stopped, stops the others
        for pid in children:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
