"""The floor: a bare aiohttp + uvloop pass-through, with nothing sfq-proxy does.

    python bench/passthrough.py [--processes N] PORT BACKEND_URL [BACKEND_URL ...]

Forwards POSTs to the backends in turn over pooled keep-alive connections and relays the
answer as it arrives. No auth, no parsing, no queue, no metrics, no log. `--processes N`
forks N processes sharing the port (SO_REUSEPORT, as `sfq-proxy serve --workers N`): what
the machine gives a second process when nothing is shared (bench/shared_state.py).
"""

from __future__ import annotations

import itertools
import os
import signal
import sys

import aiohttp
import uvloop
from aiohttp import web


def make_app(backends: list[str]) -> web.Application:
    turn = itertools.cycle(backends)
    app = web.Application()

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


def main(argv: list[str]) -> None:
    processes = 1
    if argv[0] == "--processes":
        processes, argv = int(argv[1]), argv[2:]
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
            make_app(backends), host="127.0.0.1", port=int(port), print=None, access_log=None,
            reuse_port=processes > 1, loop=uvloop.new_event_loop(),
        )  # fmt: skip
    finally:  # the first process, stopped, stops the others
        for pid in children:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main(sys.argv[1:])
