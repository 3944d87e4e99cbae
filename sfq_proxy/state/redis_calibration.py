"""Calibration shared by every process and replica with ``state: redis`` (docs/shared-state.md):
whichever of them learned it, all charge the same estimate for the same request.

Redis holds one document at ``KEY``: the decayed sums in ``Calibration.to_json``'s format.
Each process prices with a :class:`SharedCalibration`, the document as it last read it (the
base) with what it has observed since (the delta) merged in, so that it sees its own
observations at once. Every ``SYNC_INTERVAL_S`` a :class:`CalibrationSync` merges the delta
into the document in an optimistic transaction (WATCH, GET, MULTI, SET, EXEC, again when
another replica wrote in between), adopts the result as the new base, and starts a new
delta. The merge of decayed sums is exact (``Calibration.merge``): no replica's observation
is lost or counted twice, and the document is what one process would hold that learned every
request, in the order their deltas reached Redis (but for orgs dropped by ``max_orgs``, and
rounding).

While Redis cannot be reached, the delta is kept (bounded as any calibration is) and pushed
by the first sync that succeeds. When Redis holds no document (a new deployment, or a Redis
restarted without its data), the base is written as it: the state file's content at start,
the last merged state after. Redis is the source; the state file is a local backup.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import RedisError

from ..core.calibration import Calibration
from .calibration_file import decode
from .redis_functions import shielded

__all__ = ["KEY", "SYNC_INTERVAL_S", "CalibrationSync", "SharedCalibration"]

log = logging.getLogger(__name__)

KEY = "sfq:{calibration}"  # one key, so one slot of a Redis Cluster
# How stale a replica's estimates may be (what the others observed), and what a process
# killed outright loses: a second of observations. Not the heartbeat (lease_ttl_s / 3):
# that is chosen for failure detection (0.17 to 100 s), and would move the whole document
# several times a second, or leave replicas apart for minutes. Calibration moves over
# thousands of requests (its half-life); a second is well within that, for one read of the
# document per process per second (WATCH, GET, EXEC), and its write when it changed it.
SYNC_INTERVAL_S = 1.0
# At shutdown, how long the last delta may take to reach Redis; past it, what the process
# learned since its last sync is in its state file only.
FINAL_SYNC_S = 2.0


@dataclass
class Delta:
    """What a process observed since its last sync, learned from nothing: what ``merge``
    takes. ``observations`` tells whether there is anything to push (and how much, in logs)."""

    learned: Calibration
    observations: int = 0


class SharedCalibration(Calibration):
    """The calibration that the pools, their cost models and the metrics hold with a shared
    state: the base merged with the delta, kept so in place (they hold this object).

    It learns each observation itself, which leaves it base ⊕ delta exactly (a sum is
    S·dⁿ⁺¹ + B·d + x either way), and its delta learns it too, for the next sync.
    """

    def __init__(self, **settings: Any) -> None:
        """``settings`` as for :class:`Calibration`: the base and the deltas are made with them."""
        super().__init__(**settings)
        self.settings = settings
        self.base = Calibration(**settings)  # as Redis held it at the last sync
        self.delta = Delta(Calibration(**settings))

    def observe(self, pool: str, org: str, **usage: Any) -> None:
        super().observe(pool, org, **usage)
        self.delta.learned.observe(pool, org, **usage)
        self.delta.observations += 1

    def take(self) -> Delta:
        """The delta, for a sync to push; a new one learns what comes meanwhile."""
        taken, self.delta = self.delta, Delta(Calibration(**self.settings))
        return taken

    def give_back(self, taken: Delta) -> None:
        """A sync could not push ``taken``: it comes before what was learned since."""
        taken.learned.merge(self.delta.learned)
        taken.observations += self.delta.observations
        self.delta = taken

    def adopt(self, base: Calibration) -> None:
        """``base`` is what Redis holds now (or, at start, the state file's content): estimates
        use it, with what this process observed since it was taken."""
        self.base = base
        self._pools.clear()
        self.merge(base)
        self.merge(self.delta.learned)


class CalibrationSync:
    """The loop that shares a process's :class:`SharedCalibration` through Redis."""

    def __init__(self, redis: Redis | RedisCluster, calibration: SharedCalibration) -> None:
        self._redis = redis
        self.calibration = calibration
        self._lock = asyncio.Lock()  # one sync at a time: an older merge is never adopted last
        self._stop = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None
        self._unreachable = False  # logged once an outage, not at every attempt

    async def start(self) -> None:
        """The first sync before the proxy serves, so that it prices with what the other
        replicas learned from its first request on; then one every ``SYNC_INTERVAL_S``."""
        await self.sync()
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """At shutdown: the loop ends at its next step (never in the middle of a transaction)
        after one last sync, which ``FINAL_SYNC_S`` bounds if Redis does not answer."""
        self._stop.set()
        if self._loop is None:
            return
        try:
            await asyncio.wait_for(self._loop, FINAL_SYNC_S)
        except TimeoutError:
            log.warning(
                "calibration: %d observations not pushed to Redis at shutdown (kept in the "
                "state file, if any)", self.calibration.delta.observations,
            )  # fmt: skip

    async def sync(self) -> None:
        """Push the delta into Redis's document and adopt the result. A delta that Redis did
        not take (unreachable, or cancelled at shutdown) is kept for the next sync."""
        async with self._lock:
            taken = self.calibration.take()
            try:
                merged = await shielded(self._merged_in_redis(taken))
            except BaseException as err:
                self.calibration.give_back(taken)
                if not isinstance(err, RedisError):
                    raise
                self._lost(err)
                return
            self._found(taken)
            self.calibration.adopt(merged)

    async def _run(self) -> None:
        while not await self._stopped_within(SYNC_INTERVAL_S):
            await self.sync()
        await self.sync()  # the last delta

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def _merged_in_redis(self, taken: Delta) -> Calibration:
        """Redis's document (else this process's base) ⊕ ``taken``, written back if that
        changes it (but never a first document of nothing learned, which would keep a
        replica's state file from seeding Redis); retried from the read whenever another
        replica wrote first."""

        async def read_merge_write(pipe: Pipeline | ClusterPipeline) -> Calibration:
            raw = await pipe.get(KEY)
            stored = self._decoded(raw)
            merged = Calibration(**self.calibration.settings)
            merged.merge(self.calibration.base if stored is None else stored)
            merged.merge(taken.learned)
            document = merged.to_json()
            encoded = json.dumps(document, allow_nan=False, separators=(",", ":")).encode()
            if encoded != raw and (raw is not None or document["pools"]):
                pipe.multi()
                pipe.set(KEY, encoded)
            return merged

        # redis-py types RedisCluster's ``func`` as a coroutine object; it is called as Redis's is
        transaction = self._redis.transaction(read_merge_write, KEY, value_from_callable=True)  # type: ignore[arg-type]
        merged: Calibration = await transaction
        return merged

    def _decoded(self, raw: str | bytes | None) -> Calibration | None:
        """The document Redis holds; one no version of the proxy could read (written by
        hand, or by a future format) is logged and replaced."""
        if raw is None:
            return None
        try:
            return decode(raw, **self.calibration.settings)
        except ValueError as exc:
            log.warning("calibration: unreadable document at %s in Redis (%s); replaced", KEY, exc)
            return None

    def _lost(self, err: RedisError) -> None:
        if not self._unreachable:
            log.warning(
                "calibration: Redis unreachable (%s); what this process learns is kept and "
                "pushed once it answers", err,
            )  # fmt: skip
        self._unreachable = True

    def _found(self, pushed: Delta) -> None:
        if self._unreachable:
            log.warning(
                "calibration: Redis answers again; %d observations pushed", pushed.observations
            )
        self._unreachable = False
