"""Run the proxy: listen, and on SIGTERM/SIGINT drain, then close (docs/design.md §8,
Lifecycle).

The drain is the proxy's own, not aiohttp's. ``AppRunner.cleanup`` closes the listening
socket and the idle connections, runs the app's ``on_shutdown`` and then gives each request
still running its ``shutdown_timeout`` to finish, cancels it, and gives it the same time
again: twice the timeout in all (and a timeout of 0 waits for ever), with no answer for
what it cancels. Here ``on_shutdown`` is the drain (``Proxy.shutting_down``): what waits in
line is answered 503, what runs has until ``drain_timeout_s`` and is then ended with an
answer (a stream's error event, a 503). aiohttp's own wait, ``CLOSE_S`` twice, only closes
what is left (a client that does not read its last bytes): the process exits within
``drain_timeout_s`` + ``EXIT_WITHIN_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ..config import Config, ConfigError
from ..http.app import build_app
from ..http.connections import Guard, Runner
from ..http.drain import CUT_GRACE_S
from ..http.proxy import HAND_BACK_S, PROXY, TASKS_END_S, Proxy
from ..observability import access_log, logs
from ..state.redis_client import CLOSE_S as REDIS_CLOSE_S

log = logging.getLogger(__name__)
CLOSE_S = 0.05  # after the drain, aiohttp closes what still writes (a client not reading)
# the bound on the process's exit after drain_timeout_s: the requests cut at that deadline
# writing their end (CUT_GRACE_S), aiohttp's close, the background loops' end (TASKS_END_S),
# the last calls to the stores
# (HAND_BACK_S: the leases, the usage, the keys' last use) and closing Redis's
# connections, and 0.2 s for the rest (the backends' session, the calibration file, the
# interpreter's exit: 0.04–0.08 s measured)
EXIT_WITHIN_S = 1.0
assert CUT_GRACE_S + 2 * CLOSE_S + TASKS_END_S + HAND_BACK_S + REDIS_CLOSE_S <= EXIT_WITHIN_S - 0.2


@contextlib.asynccontextmanager
async def running(
    config: Config, *, reuse_port: bool = False, **app_options: Any
) -> AsyncIterator[web.AppRunner]:
    """The proxy listening on ``config.listen`` until the block exits, then drained
    (``Proxy.shutting_down``) and closed."""
    app = build_app(config, **app_options)
    runner = Runner(  # aiohttp's, its connections capped and their heads read in time
        app,
        Guard(app[PROXY]),
        shutdown_timeout=CLOSE_S,  # after the drain: see the module's docstring
        handler_cancellation=True,  # a client that leaves cancels its handler: queue exit, abort
        access_log=None,
        auto_decompress=False,  # compressed bodies reach the handler as sent, and are refused
    )
    await runner.setup()
    try:
        # a deep accept backlog: a burst of new clients waits to be admitted, not refused;
        # several workers each listen on the port, and the kernel spreads connections
        await web.TCPSite(
            runner, config.listen.host, config.listen.port, backlog=1024, reuse_port=reuse_port
        ).start()
        log.info("listening on %s", bound_url(runner))
        yield runner
    finally:
        await runner.cleanup()  # the drain, then the close


def _reload(proxy: Proxy) -> None:
    """SIGHUP: reload the config file; a bad one is logged and changes nothing."""
    try:
        proxy.reload_from_file()
    except ConfigError as err:
        log.warning("reload refused, nothing changed:\n%s", err)


def bound_url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


def stop_signal() -> asyncio.Event:
    """Set on the first SIGTERM or SIGINT from now on (no longer their default action, which
    ends the process at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT."""
    await stop_signal().wait()


def run(main: Callable[[], Any]) -> None:
    """``asyncio.run`` on uvloop when it is installed, with the process's logs redacted."""
    logs.configure()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


GC_THRESHOLDS = (20_000, 10, 10)
"""The collector's first threshold above what requests in flight hold at once (~200 tracked
objects each: 64 of them hold ~12,000). At CPython's 700 those objects alone set off a young
collection every 13–24 requests, and promote what is in flight to the older generations, whose
collections follow: 36 µs of every request's CPU at 16 connections, 100 µs at 64 (8 %), in
pauses of the event loop of 1–6 ms each. Garbage in cycles still goes, at a larger count."""


def announce(line: str, **fields: str) -> None:
    """``line`` to stdout in one write, as text or JSON (``logs.announcement``, with
    ``fields``): under ``PYTHONUNBUFFERED`` ``print`` writes the text and its newline
    apart, and workers sharing the pipe interleave them."""
    sys.stdout.write(logs.announcement(line, **fields) + "\n")
    sys.stdout.flush()


async def serve(config: Config, config_path: Path | None = None, *, worker: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then drain; a ``worker`` shares its port with others."""
    access_log.configure()
    # before the start: a worker started again joins the shared state during it, and a
    # SIGTERM then (a rolling stop) must drain it once started, not kill it
    stop = stop_signal()
    async with running(config, config_path=config_path, reuse_port=worker) as runner:
        # What start-up made (modules, config, app: ~50k objects) lives as long as the
        # process: out of the collector's sight, a full collection takes ~0 ms, not ~30 ms
        # of a stalled event loop.
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        url = bound_url(runner)
        announce(f"sfq-proxy listening on {url}", url=url)
        proxy = runner.app[PROXY]
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload, proxy)
        await stop.wait()
        announce("sfq-proxy draining…")
