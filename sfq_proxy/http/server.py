"""Run the proxy: listen, and on SIGTERM/SIGINT drain in-flight requests, then close."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ..config import Config, ConfigError
from . import access_log, logs
from .app import build_app
from .runtime import PROXY, Proxy

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running(
    config: Config, *, reuse_port: bool = False, **app_options: Any
) -> AsyncIterator[web.AppRunner]:
    """The proxy listening on ``config.listen`` until the block exits, then drained.

    On exit it stops accepting connections at once and gives in-flight requests (queued
    ones included) up to ``drain_timeout_s`` to finish before closing them.
    """
    runner = web.AppRunner(
        build_app(config, **app_options),
        shutdown_timeout=config.drain_timeout_s,
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
        try:
            yield runner
        finally:
            log.info("draining: in-flight requests have up to %g s", config.drain_timeout_s)
    finally:
        await runner.cleanup()


def _reload(proxy: Proxy) -> None:
    """SIGHUP: reload the config file; a bad one is logged and changes nothing."""
    try:
        proxy.reload_from_file()
    except ConfigError as err:
        log.warning("reload refused, nothing changed:\n%s", err)


def bound_url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


async def wait_for_signal() -> None:
    """Return on the first SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run(main: Callable[[], Any]) -> None:
    """``asyncio.run`` on uvloop when it is installed, with the process's logs redacted."""
    logs.configure()
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


async def serve(config: Config, config_path: Path | None = None, *, worker: bool = False) -> None:
    """Serve until SIGTERM/SIGINT, then drain; a ``worker`` shares its port with others."""
    access_log.configure()
    async with running(config, config_path=config_path, reuse_port=worker) as runner:
        # What start-up made (modules, config, app: ~50k objects) lives as long as the
        # process: out of the collector's sight, a full collection takes ~0 ms, not ~30 ms
        # of a stalled event loop.
        gc.freeze()
        print(f"sfq-proxy listening on {bound_url(runner)}", flush=True)
        proxy = runner.app[PROXY]
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload, proxy)
        await wait_for_signal()
        print("sfq-proxy draining…", flush=True)
