"""What every handler shares at run time: config, pools, admission, metrics, the
connections to the backends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from redis.exceptions import RedisError

from ..config import Config, ConfigError, ResolvedKey, load_config
from ..core.admission import Admission
from ..core.calibration import Calibration
from ..core.cost import CostModel
from ..core.errors import ApiError
from ..core.flows import Authenticator
from ..core.keys import KeyRecord, clashes, in_force
from ..core.queue_memory import QueueMemory
from ..observability import logs
from ..observability.history import PoolHistory, sample_forever
from ..observability.metrics import Metrics
from ..observability.worker_metrics import WorkerGroup
from ..state import calibration_file, key_store
from ..state.backends import State, open_state
from ..state.engine_scrape import scrape_forever
from ..state.pool import Memory, Pool
from ..state.redis_calibration import CalibrationSync
from ..state.redis_limits import SharedLimits
from ..state.usage_store import UsageBook
from .drain import CUT_GRACE_S, Drain
from .upstream import KEEPALIVE_S, Upstreams

if TYPE_CHECKING:  # imported when tracing is on (``_tracing``): OpenTelemetry is not light
    from ..observability.tracing import Tracing

Clock = Callable[[], float]
log = logging.getLogger(__name__)
# at shutdown, once the requests have ended: how long the shared state's last calls (the
# leases handed back, the calibration pushed) may take, within the drain's bound of
# drain_timeout_s + 1 s (server.py): a Redis that does not answer gets the leases back when
# their TTL passes
HAND_BACK_S = 0.35
# how long the background loops (health probes, heartbeats, saves) may take to end once
# cancelled: at once, unless a library swallowed the cancellation; the exit does not wait more
TASKS_END_S = 0.05
# at shutdown, beside the last calls to Redis and within their HAND_BACK_S: how long the last
# spans may take to reach the collector (one that does not answer in time loses them)
SPANS_FLUSH_S = 0.3


@dataclass
class Proxy:
    """The running proxy; ``/admin/state`` is its repr."""

    config: Config
    pools: dict[str, Pool]
    auth: Authenticator
    admission: Admission
    metrics: Metrics
    clock: Clock
    storage: State  # where the pools' lines and slots, the keys and the usage live
    wall: Clock = time.time  # Unix time: key expiry, usage periods, budgets; tests replace it
    calibration: Calibration | None = None
    limits: SharedLimits | None = None  # the org buckets and Idempotency-Keys, with Redis
    calibration_sync: CalibrationSync | None = None  # calibration shared, with Redis
    config_path: Path | None = None  # what SIGHUP and POST /admin/reload read again
    session: aiohttp.ClientSession | None = None  # the health probes'
    upstreams: Upstreams = field(default_factory=Upstreams)  # the relay's (upstream.py)
    drain: Drain = field(default_factory=Drain)  # the inference handlers, and the drain
    memory: Memory | None = None  # what waits in every pool's line, bounded
    keys: key_store.KeyStore | None = None  # the admin API's keys; None: that API is off
    usage: UsageBook | None = None  # usage you can bill from, and budgets
    tracing: Tracing | None = None  # the requests' spans (docs/tracing.md); None: off
    history: dict[str, PoolHistory] = field(default_factory=dict)  # the admin page's charts
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    def from_config(
        cls,
        config: Config,
        clock: Clock,
        config_path: Path | None = None,
        wall: Clock = time.time,
    ) -> Proxy:
        _hide_secrets(config)
        storage = open_state(config)
        calibration, sync = storage.calibration(calibration_file.loaded(config.calibration))
        memory: Memory = QueueMemory(config.limits.queue_memory_bytes)
        pools = {name: storage.pool(name, clock, calibration, memory) for name in config.pools}
        keys = storage.key_store()
        if keys is not None and (clash := clashes(config, keys.records.values())):
            raise clash
        proxy = cls(
            config=config,
            pools=pools,
            auth=Authenticator(config.resolved_keys()),
            admission=Admission(config),
            metrics=Metrics(pools, config.metrics.max_labelled_orgs, calibration),
            clock=clock,
            wall=wall,
            calibration=calibration,
            limits=storage.limits(),
            calibration_sync=sync,
            config_path=config_path,
            memory=memory,
            keys=keys,
            storage=storage,
            tracing=_tracing(config),
            history={name: PoolHistory() for name in pools},
        )
        proxy.usage = UsageBook(config, storage.usage_store(wall), wall)
        proxy.metrics.budget_levels = proxy.usage.levels
        if keys is not None:
            keys.on_change = proxy.use_store_keys
            proxy.use_store_keys()
        return proxy

    def reload(self, config: Config) -> list[str]:
        """Apply ``config`` at once, or raise ConfigError and change nothing.

        Keys, weights, limits, backends and cost settings change; meters, the virtual
        time, queued and running requests stay. Returns warnings about what cannot change.
        """
        if set(config.pools) != set(self.config.pools):
            raise ConfigError([("pools", "pools cannot be added or removed by a reload")])
        costs = {  # built first: a tokenizer that will not load fails before any change
            name: CostModel(
                spec.cost, f"pools.{name}.cost", pool=name, calibration=self.calibration
            )
            for name, spec in config.pools.items()
        }
        _hide_secrets(config)
        warnings = []
        if config.listen != self.config.listen:
            warnings.append("listen cannot change by a reload: restart to use the new address")
        if config.state != self.config.state:
            warnings.append("state cannot change by a reload: restart to use it")
        if config.usage.file != self.config.usage.file:
            warnings.append("usage.file cannot change by a reload: restart to use it")
        if config.state and config.usage.retention_days != self.config.usage.retention_days:
            warnings.append("usage.retention_days on Redis changes at the next restart")
        if config.key_store_file != self.config.key_store_file:
            warnings.append("key_store_file cannot change by a reload: restart to use it")
        if config.tracing != self.config.tracing:
            warnings.append("tracing cannot change by a reload: restart to use it")
        if self.keys is not None and (clash := clashes(config, self.keys.records.values())):
            raise clash
        self.config = config
        keys = self._store_keys()
        self.auth.reconfigure(config.resolved_keys(), [key for _, key in keys])
        self.admission.reconfigure(config)
        if self.usage is not None:
            self.usage.reconfigure(config, [record for record, _ in keys])
        if self.limits is not None:
            self.limits.config = config
        for name, pool in self.pools.items():
            pool.reconfigure(config, costs[name])
        for warning in warnings:
            log.warning("reload: %s", warning)
        log.warning("configuration reloaded")
        return warnings

    def use_store_keys(self) -> None:
        """The store's keys changed (or were read): the next request sees them, and is
        held to their budgets (a revoked key's go with it)."""
        keys = self._store_keys()
        self.auth.manage([key for _, key in keys])
        if self.usage is not None:
            self.usage.reconfigure(self.config, [record for record, _ in keys])

    def _store_keys(self) -> list[tuple[KeyRecord, ResolvedKey]]:
        """The store's keys in force. One whose alias a key of this process's file is
        named (a config that reached some of the replicas on a Redis only) is refused here,
        and the log says why: it would share that key's usage and budgets."""
        records = () if self.keys is None else self.keys.records.values()
        if (clash := clashes(self.config, records)) is not None:
            text = str(clash).replace("\n", "; ")
            log.warning("key store: keys refused here, named like keys of the file: %s", text)
        return in_force(records, self.config)

    async def save_last_used(self) -> None:
        """Write when the store's keys were last used (never per request: here, every
        ``LAST_USED_SAVE_S`` and at shutdown); a store that cannot be written keeps them
        in memory until the next try."""
        if self.keys is None:
            return
        try:
            await self.keys.save_last_used(key_store.usage_times(self.keys, self.auth.last_used))
        except (ApiError, RedisError) as err:
            log.warning("cannot save when keys were last used: %s", err)

    async def _save_last_used_forever(self) -> None:
        while True:
            await asyncio.sleep(key_store.LAST_USED_SAVE_S)
            await self.save_last_used()

    def reload_from_file(self) -> list[str]:
        """SIGHUP and POST /admin/reload: read the config file again and apply it."""
        if self.config_path is None:
            raise ConfigError([("", "the proxy was started without a config file")])
        try:
            config = load_config(self.config_path)
        except OSError as err:
            raise ConfigError([("", f"cannot read {self.config_path}: {err.strerror}")]) from err
        return self.reload(config)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """The connections to the backends (the relay's, the probes' and the engine
        scrapes'), the health probes, the engines' readings (engine dispatch), and the
        calibration saved periodically and at shutdown (and shared, with Redis)."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        # no cookie jar: a backend's cookie must not ride on other orgs' requests
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        await self.storage.start()  # refuses to start without its Redis
        if self.calibration_sync is not None:
            await self.calibration_sync.start()
        if self.keys is not None:  # Redis's keys read before the first request
            await self.keys.start()
        self._tasks = [
            asyncio.create_task(p.probe_forever(self.session)) for p in self.pools.values()
        ]
        self._tasks += [  # engine dispatch's readings, beside the probes
            asyncio.create_task(scrape_forever(p, self.session)) for p in self.pools.values()
        ]
        loops = [asyncio.create_task(loop) for loop in self.storage.loops()]
        self._tasks += [asyncio.create_task(loop) for loop in self.storage.background()]
        if self.config.calibration.state_file:
            self._tasks.append(asyncio.create_task(self._save_calibration_forever()))
        if self.keys is not None:
            self._tasks.append(asyncio.create_task(self.keys.follow()))
            self._tasks.append(asyncio.create_task(self._save_last_used_forever()))
        if self.usage is not None:  # what was used before, for budgets
            await self.usage.flush()
            self._tasks.append(asyncio.create_task(self.usage.flush_forever()))
            self._tasks.append(asyncio.create_task(self.usage.prune_forever()))
        self._tasks.append(asyncio.create_task(sample_forever(self.pools, self.history, self.wall)))
        if isinstance(self.metrics.group, WorkerGroup):  # its counts for its siblings' scrapes
            self._tasks.append(asyncio.create_task(self.metrics.group.write_forever()))
        yield
        # the drain is over (server.py): every request has ended, what remains is bounded
        for task in self._tasks:
            task.cancel()
        _, stuck = await asyncio.wait(self._tasks, timeout=TASKS_END_S)
        for task in stuck:  # a library swallowed the cancellation (redis/redis-py#2028)
            log.warning("a background task did not end when cancelled, left behind: %s", task)
        stops = [self.storage.stop(loops), self.save_last_used()]
        if self.usage is not None:  # every request has ended: the last usage is final
            stops.append(self.usage.close())
        if self.calibration_sync is not None:  # while its Redis client is open
            stops.append(self.calibration_sync.stop())
        if self.tracing is not None:  # every request has ended: its span is queued
            stops.append(self._flush_spans(self.tracing))
        try:
            async with asyncio.timeout(HAND_BACK_S):
                await asyncio.gather(*stops)
        except TimeoutError:
            log.warning(
                "shared state: Redis did not take the last calls within %g s: this process's "
                "leases go back when their TTL passes", HAND_BACK_S,
            )  # fmt: skip
        await self.storage.close()
        await self.session.close()
        self.upstreams.close()
        self.save_calibration()

    @staticmethod
    async def _flush_spans(tracing: Tracing) -> None:
        flushed = asyncio.wrap_future(tracing.close())
        if not (await asyncio.wait([flushed], timeout=SPANS_FLUSH_S))[0]:
            log.warning(
                "tracing: the collector did not take the last spans within %g s", SPANS_FLUSH_S
            )

    async def shutting_down(self, app: web.Application) -> None:
        """The drain (aiohttp's ``on_shutdown``: the listening socket and the idle
        connections are closed already; docs/design.md §8, Lifecycle). Requests waiting in
        line leave it with 503 ``shutting_down`` and ``Retry-After`` (their clients retry,
        on another replica if there is one), and none joins; the calibration is saved;
        running requests have until ``drain_timeout_s``, then are ended (a stream with an
        error event, an answer not yet started with a 503). Returns when all have ended, at
        most ``CUT_GRACE_S`` after that deadline."""
        if self.drain.draining:
            return
        loop = asyncio.get_running_loop()
        timeout = self.config.drain_timeout_s
        deadline = loop.time() + timeout
        log.info("draining: in-flight requests have up to %g s", timeout)
        self.drain.begin()
        for pool in self.pools.values():
            await pool.leave()
        self.save_calibration()  # before anything is cut: a SIGKILL later loses nothing
        if await self.drain.finished(deadline - loop.time()):
            return
        log.warning("drain_timeout_s passed: ending %d running requests", self.drain.cut())
        if not await self.drain.finished(CUT_GRACE_S):
            log.warning("%d requests did not end at once: closing them", len(self.drain))

    def save_calibration(self) -> None:
        path = self.config.calibration.state_file
        if path and self.calibration is not None:
            try:
                calibration_file.save(self.calibration, Path(path))
            except OSError as err:  # a full disk must not take the proxy down
                log.warning("cannot save calibration to %s: %s", path, err)

    async def _save_calibration_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.calibration.save_interval_s)
            self.save_calibration()

    def state(self) -> dict[str, Any]:
        """``/admin/state``: each pool's, with its flows' costs from the metrics."""
        return {
            name: {**pool.state(), "costs": self.metrics.costs(name)}
            for name, pool in self.pools.items()
        }


def _tracing(config: Config) -> Tracing | None:
    """The process's tracer (its exporting thread started), when the config's ``tracing`` is
    on; the OpenTelemetry packages are imported then, and only then."""
    spec = config.tracing_on()
    if spec is None:
        return None
    from ..observability.tracing import Tracing

    return Tracing(spec, config.tracing_headers())


def _hide_secrets(config: Config) -> None:
    """The secrets the proxy sends as they are, the upstream keys and the collector's header
    values (``tracing.headers_env``), follow no pattern the redaction knows: no log shows
    them (a collector's refusal can quote its token, and the exporter logs it)."""
    logs.hide(*(key for pool in config.pools if (key := config.upstream_key(pool))))
    logs.hide(*config.tracing_headers().values())


PROXY = web.AppKey("proxy", Proxy)
