"""Where the state lives, chosen once at start from the config's ``state`` section.

``InProcess``: each pool's line and slots in this process (``pool.py``), the admin API's keys
in the file of ``key_store_file`` (``key_store.py``), usage in the SQLite file of
``usage.file`` or in memory (``usage_store.py``), the calibration in this process.
``OnRedis``: one fairness domain across processes and replicas: the lines and leases in
Redis's functions (``redis_pool.py``, ``redis_dispatch.py``), the org limits and
Idempotency-Keys (``redis_limits.py``), the calibration (``redis_calibration.py``), the keys
and the usage, all on one Redis (``redis_client.py`` connects).

The composition root (``http/proxy.py``) asks the one it was given for each part and never
which one it is: the choice is made here, once.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from ..config import Config, ConfigError
from ..core.calibration import Calibration
from .calibration_file import settings
from .key_store import POLL_MAX_S, FileKeyStore, KeyStore, RedisKeyStore
from .pool import Clock, Memory, Pool
from .redis_calibration import CalibrationSync, SharedCalibration
from .redis_client import calls, close, connect, holder_id, start, stop
from .redis_dispatch import RedisDispatch
from .redis_limits import SharedLimits
from .redis_pool import SharedPool
from .usage_store import DAY, MemoryStore, RedisStore, SqliteStore, Store

Loop = Coroutine[Any, Any, None]


class InProcess:
    """Everything in this process; the key store and the usage in files, if configured."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def calibration(self, loaded: Calibration) -> tuple[Calibration, CalibrationSync | None]:
        """The calibration requests are charged with, and what shares it (nothing here)."""
        return loaded, None

    def pool(self, name: str, clock: Clock, calibration: Calibration, memory: Memory) -> Pool:
        return Pool(name, self.config, clock, calibration, memory)

    def key_store(self) -> KeyStore | None:
        """The file of ``key_store_file``, else none (the key API then says how to turn it
        on). A damaged file is a config error."""
        path = self.config.key_store_file
        return None if path is None else FileKeyStore(Path(path))

    def usage_store(self, wall: Callable[[], float]) -> Store:
        if self.config.usage.file is None:
            return MemoryStore()
        try:
            return SqliteStore(Path(self.config.usage.file), wall)
        except (sqlite3.Error, OSError) as err:  # not a database, or not writable
            raise ConfigError([("usage.file", f"cannot use it as a SQLite file: {err}")]) from err

    def limits(self) -> SharedLimits | None:
        """The org limits every process shares (none: each process's own admission)."""
        return None

    async def start(self) -> None:
        """Nothing to join."""

    def loops(self) -> list[Loop]:
        """What runs until ``stop`` ends it."""
        return []

    def background(self) -> list[Loop]:
        """What runs until cancelled."""
        return []

    async def stop(self, loops: list[asyncio.Task[None]]) -> None:
        """Nothing to hand back."""

    async def close(self) -> None:
        """Nothing to close."""


class OnRedis:
    """Every part on the Redis of the config's ``state`` (it connects on first use; a proxy
    that cannot reach it does not start)."""

    def __init__(self, config: Config, redis: Redis | RedisCluster) -> None:
        self.config, self.redis, self.holder = config, redis, holder_id()
        self.calls = calls(config, redis)
        self.pools: list[SharedPool] = []
        self._limits: SharedLimits | None = None

    def calibration(self, loaded: Calibration) -> tuple[Calibration, CalibrationSync | None]:
        """What any replica learns, every replica charges: until Redis has a calibration,
        the state file's (``loaded``)."""
        shared = SharedCalibration(**settings(self.config.calibration))
        shared.adopt(loaded)
        return shared, CalibrationSync(self.redis, shared)

    def pool(self, name: str, clock: Clock, calibration: Calibration, memory: Memory) -> Pool:
        dispatch = RedisDispatch(self.redis, name, self.holder, self.calls)
        pool = SharedPool(name, self.config, clock, calibration, dispatch, memory)
        self.pools.append(pool)
        return pool

    def key_store(self) -> KeyStore | None:
        state = self.config.state
        assert state is not None
        return RedisKeyStore(self.redis, min(state.lease_ttl_s, POLL_MAX_S))

    def usage_store(self, wall: Callable[[], float]) -> Store:
        return RedisStore(self.redis, self.config.usage.retention_days * DAY)

    def limits(self) -> SharedLimits | None:
        self._limits = SharedLimits(self.calls, self.config, self._replicas)
        return self._limits

    def _replicas(self) -> int:
        """How many processes share the state: the most any pool saw at its last heartbeat."""
        return max((len(p.dispatch.holders) for p in self.pools), default=1)

    async def start(self) -> None:
        await start(self.config, self.pools)  # Redis unreachable: a config error

    def loops(self) -> list[Loop]:
        """Each pool's heartbeat and inbox (``stop`` ends them at their next step)."""
        return [loop for pool in self.pools for loop in pool.loops()]

    def background(self) -> list[Loop]:
        """The renewal of this process's part of the org limits."""
        state = self.config.state
        assert state is not None
        return [] if self._limits is None else [self._limits.renew_forever(state.heartbeat_s)]

    async def stop(self, loops: list[asyncio.Task[None]]) -> None:
        await stop(self.pools, loops)

    async def close(self) -> None:
        await close(self.pools)


State = InProcess | OnRedis


def open_state(config: Config) -> State:
    """Redis when the config's ``state`` names one (by URL or through Sentinel), else this
    process."""
    redis = connect(config)
    return InProcess(config) if redis is None else OnRedis(config, redis)
