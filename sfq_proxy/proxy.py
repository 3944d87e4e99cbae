"""What every handler shares at run time: config, pools, admission, metrics, the session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from .accesslog import AccessRecord
from .admission import Admission
from .classify import Authenticator, Flow
from .config import Config
from .metrics import Metrics
from .pool import Pool

Clock = Callable[[], float]


@dataclass
class Proxy:
    """The running proxy; ``/admin/state`` is its repr."""

    config: Config
    pools: dict[str, Pool]
    auth: Authenticator
    admission: Admission
    metrics: Metrics
    clock: Clock
    session: aiohttp.ClientSession | None = None
    _probes: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Config, clock: Clock) -> Proxy:
        pools = {name: Pool(name, config, clock) for name in config.pools}
        return cls(
            config=config,
            pools=pools,
            auth=Authenticator(config.resolved_keys()),
            admission=Admission(config),
            metrics=Metrics(pools, config.metrics.max_labelled_orgs),
            clock=clock,
        )

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """One pooled keep-alive session to the backends, and the health probes."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self._probes = [
            asyncio.create_task(p.probe_forever(self.session)) for p in self.pools.values()
        ]
        yield
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await self.session.close()

    def state(self) -> dict[str, Any]:
        return {name: pool.state() for name, pool in self.pools.items()}


PROXY = web.AppKey("proxy", Proxy)
FLOW = web.RequestKey("flow", Flow)
RECORD = web.RequestKey("access_record", AccessRecord)
