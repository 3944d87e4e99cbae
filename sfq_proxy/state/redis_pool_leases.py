"""What a shared pool holds in Redis, and what becomes of it when Redis is lost: the leases
of the requests this process runs (how a grant becomes one, how it goes back, how Redis
taking them all back ends what they covered), and the modes a pool goes through with
``when_unreachable: local`` (docs/shared-state.md).

``LeasedPool`` is the lower half of ``SharedPool`` (``redis_pool.py``), which adds the line
in Redis, what the handler calls and the loops; it is never made on its own. It is a base
class rather than an object the pool holds because losing Redis and getting it back act on
the pool's own requests (what waits moves from one line to the other, what runs beyond the
share ends, what ran alone is leased again): a helper would reach into all of that state.
Below ``SharedPool``, it needs nothing of it and imports nothing above it.

With ``when_unreachable: local`` a process that loses Redis goes through four modes:

- ``shared``: every decision in Redis;
- ``holding``: Redis did not answer; requests wait in the process's own line, nothing new
  starts (a blip costs a wait, never a slot decided twice);
- ``local``: Redis has not answered for a lease TTL, so every replica's leases have lapsed:
  the process's own scheduler dispatches, on its share of each backend's slots (an even
  split among the replicas alive at the last heartbeat: they add up to the slots) and of
  the pool's rate;
- ``settling``: Redis answers again and holds a lease for everything the process runs;
  nothing new starts for one TTL, the time the other replicas take to register theirs, so
  no decision made in Redis counts without them. Then the waiting requests move to Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from enum import Enum
from typing import Any

from redis.exceptions import RedisError

from ..config import Config
from ..core.calibration import Calibration
from ..core.errors import ApiError
from ..core.placement import Backend, share
from ..core.scheduler import Ticket
from .pool import Clock, Dispatch, Memory, Pool, pool_limits
from .redis_dispatch import Fenced, Grants, RedisDispatch, SharedBackend

# the pool's logger (``redis_pool``): what it says of its leases and modes, under one name
log = logging.getLogger(f"{__package__}.redis_pool")
RETRY_AFTER_S = 1.0  # what a client is told while the shared state cannot be reached


_Task = asyncio.Task[Any] | None


class Mode(Enum):
    SHARED = "shared"
    HOLDING = "holding"
    LOCAL = "local"
    SETTLING = "settling"


class Moved(Exception):
    """A waiting request changes line: Redis was lost, or is back."""


class LeasedPool(Pool):
    def __init__(
        self,
        name: str,
        config: Config,
        clock: Clock,
        calibration: Calibration | None,
        dispatch: RedisDispatch,
        memory: Memory | None = None,
    ) -> None:
        super().__init__(name, config, clock, calibration, memory)
        self.dispatch = dispatch
        self._config = config
        # ticket id → the ticket, its future, and the task of its request (which a lost
        # lease ends)
        self._waiting: dict[str, tuple[Ticket, asyncio.Future[Backend], _Task]] = {}
        self._held: dict[Ticket, tuple[str, _Task]] = {}  # → lease, task
        self._background: set[asyncio.Task[None]] = set()
        self._renewed = 0.0  # when Redis last took this process's heartbeat (monotonic)
        self.reachable = False  # whether Redis answered the last heartbeat
        self._joined = False  # registered as a holder, and not fenced since
        # leases whose hand-back failed, with their requests' actual costs: tried again
        self._unreturned: dict[str, float | None] = {}
        self.mode = Mode.SHARED
        self._settled_at = 0.0  # when settling ends (monotonic)
        self._timers: list[asyncio.TimerHandle] = []  # of _lose: to end the excess, go local
        # the local scheduler: what waits in it (in arrival order), what it dispatched
        self._queued_here: dict[Ticket, _Task] = {}
        self._local: dict[Ticket, _Task] = {}
        # adopt's list on its way to Redis: nothing may start here, whatever mode or reload
        # comes meanwhile, since Redis may take the list and decide from then on
        self._adopting = False
        self._published: list[SharedBackend] = []  # the backends as last told to Redis
        self._publishing = False  # a call telling them is on its way (``_publish``)
        self._set_shares()

    @property
    def _fallback(self) -> bool:
        state = self._config.state
        return state is not None and state.when_unreachable == "local"

    @property
    def _ttl(self) -> float:
        state = self._config.state
        assert state is not None  # a shared pool exists only with a shared state
        return state.lease_ttl_s

    # -- leases: granted, handed back, lost ---------------------------------------------------

    def _stop_running(
        self, ticket: Ticket, *, refund: bool = False, actual: float | None = None
    ) -> None:
        """The accounting of a request that no longer runs here."""
        if ticket in self._local:
            del self._local[ticket]
            super().release(ticket, refund=refund, actual=actual)  # the local scheduler's
        elif ticket.backend is not None:
            ticket.backend.in_flight = max(0, ticket.backend.in_flight - 1)
            ticket.backend = None

    async def _finish(
        self, lease: str, refund: float | None = None, actual: float | None = None
    ) -> None:
        """Hand a lease back (``refund``: its tokens go back to the pool's rate; ``actual``:
        what its request cost, for the true-up); one that cannot be (Redis unreachable) is
        tried again at each heartbeat, else the heartbeat would keep its slot taken for as
        long as it beats."""
        try:
            finished = self.dispatch.finish(lease, self._down(), refund=refund, actual=actual)
            self._grant(await finished)
        except RedisError as err:
            log.warning("pool %s: a lease could not be handed back yet: %s", self.name, err)
            self._unreturned[lease] = actual
        except Fenced:  # Redis gave it back with the others: the heartbeat will find out
            pass

    async def _configure(self) -> Grants:
        org_caps, class_caps, rate = pool_limits(self._config, self.spec)
        backends, placement = self._shared_backends(), self.placement
        grants = await self.dispatch.configure(
            backends, org_caps, class_caps, self._down(), rate, placement.load_factor,
            placement.slack,
        )  # fmt: skip
        self._published = backends
        return grants

    def _shared_backends(self) -> list[SharedBackend]:
        """The backends and their slots as Redis places on them. In engine dispatch, what
        the gate lets the replicas hold together, and each class (``EngineGate.leases``,
        ``class_leases``): the leases in Redis count every replica's dispatches, which no
        one gate sees, so the gate bounds them rather than judging each dispatch."""
        now, ceilings = self.clock(), self.scheduler.ceilings
        listed: list[SharedBackend] = []
        for backend in self.placement.backends:
            gate = backend.gate
            if gate is None or ceilings is None:
                listed.append((backend.name, backend.slots))
                continue
            if not gate.fresh(now):  # what a replica that sees the engine told stands
                listed.append((backend.name, gate.leases(now), {}, True))
                continue
            slots = gate.leases(now)
            limits = {}
            for cls, ceiling in sorted(ceilings.items()):
                limit = gate.class_leases(now, ceiling)
                if limit is not None and limit < slots:
                    limits[cls] = limit
            listed.append((backend.name, slots, limits) if limits else (backend.name, slots))
        return listed

    def after_reading(self) -> None:
        """In Redis, a reading changes what the backends may hold (``_shared_backends``):
        told to Redis when it does (which dispatches what it opens), not otherwise; by one
        call at a time, the newest list, so none older lands after it."""
        if self.mode is not Mode.SHARED:
            super().after_reading()
        elif not self._publishing and self._shared_backends() != self._published:
            self._publishing = True
            self._later(self._publish())

    async def _publish(self) -> None:
        """Tell Redis the backends until what it was told is the newest (a failed call is
        tried again at the next reading)."""
        try:
            while (backends := self._shared_backends()) != self._published:
                grants = await self.dispatch.set_backends(backends, self._down())
                self._published = backends
                self._grant(grants)
        except (RedisError, Fenced) as err:
            log.warning("pool %s: telling Redis the engines' limits failed: %s", self.name, err)
        finally:
            self._publishing = False

    async def _call(self, work: Awaitable[Grants | None]) -> None:
        """A call whose failure only delays: the grants it made are carried out; if Redis is
        unreachable, the heartbeat deals with it."""
        try:
            grants = await work
        except (RedisError, Fenced) as err:
            log.warning("pool %s: a call to Redis failed: %s", self.name, err)
            return
        if grants is not None:
            self._grant(grants)

    def _grant(self, grants: Grants) -> None:
        """Wake the requests given a slot; a grant that nobody waits for any more (its
        client left, its deadline passed) is handed back at once, unless its request runs:
        the inbox gave it twice (a failover lost its read, docs/shared-state.md). One on a
        backend this process does not know (another replica's config lists it, during a
        rollout) is handed back and its request answered 503. When pacing held a ticket
        back, pump the pool once it allows."""
        if grants.wake_s is not None:
            self._wake_in(grants.wake_s)
        for grant in grants:
            waiting = self._waiting.pop(grant.ticket, None)
            backend = next((b for b in self.placement.backends if b.name == grant.backend), None)
            if waiting is None or waiting[1].done() or backend is None:
                if all(lease != grant.lease for lease, _ in self._held.values()):
                    self._later(self._finish(grant.lease))
                if waiting is not None and not waiting[1].done():  # a backend it does not know
                    waiting[1].set_exception(unknown_backend(self.name))
                continue
            ticket, future, task = waiting
            backend.in_flight += 1  # this process's share, for its metrics and state
            ticket.backend, ticket.placed = backend, grant.reason
            ticket.dispatches += 1
            self._held[ticket] = (grant.lease, task)
            self.memory.leave(self._line(ticket), ticket)  # it waits no more
            self.recent.append(Dispatch.of(ticket, backend.name, self.clock(), tagged=False))
            future.set_result(backend)

    def _wake_in(self, delay_s: float) -> None:
        """One pump, at the earliest wake asked for (the in-memory pool's timer): it
        dispatches every holder's tickets, the others' to their inboxes."""
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            if self._timer.when() <= loop.time() + delay_s:
                return
            self._timer.cancel()
        self._timer = loop.call_later(delay_s, self._on_timer)

    def _fence(self, why: str) -> None:
        """This process's leases are gone: fail what waits, and stop what runs, so that no
        backend serves more than its slots once Redis has given them to others."""
        log.error("pool %s: shared state lost (%s): ending its requests", self.name, why)
        self._joined = False
        self._unreturned.clear()  # reclaimed with the rest
        waiting, self._waiting = self._waiting, {}
        for _, future, _ in waiting.values():
            if not future.done():
                future.set_exception(unavailable(self.name))
        held, self._held = self._held, {}
        for ticket, (_, task) in held.items():
            self._stop_running(ticket)
            if task is not None:
                task.cancel("its slot lease was lost")

    # -- Redis lost and back (when_unreachable: local) -----------------------------------------

    def _lose(self, why: str) -> None:
        """Stop deciding in Redis: what waits there moves to this process's own line. Times
        count from the last heartbeat Redis took, as do the leases: every replica's last
        one came within a heartbeat (a third of the TTL) of the others'. At two thirds of
        the TTL it ends what it runs beyond its share; at four thirds it schedules alone:
        so each replica's excess has ended before any replica starts on its share."""
        if self.mode is not Mode.SHARED:
            return
        log.error("pool %s: shared state lost (%s): requests wait here", self.name, why)
        self.mode, self.reachable = Mode.HOLDING, False
        waiting, self._waiting = self._waiting, {}
        for _, future, _ in waiting.values():  # in the order they queued
            if not future.done():
                future.set_exception(Moved())
        since = time.monotonic() - self._renewed
        later = asyncio.get_running_loop().call_later
        self._timers = [
            later(max(0.0, self._ttl * 2 / 3 - since), self._end_excess),
            later(max(0.0, self._ttl * 4 / 3 - since), self._go_local),
        ]

    def _end_excess(self) -> None:
        """End what runs here beyond this process's share (Redis granted it more), the
        newest first; each frees its slot as it ends. ``fail_closed`` would end it all."""
        for backend, part in zip(self.placement.backends, self._shares(), strict=True):
            running = [t for t in self._held if t.backend is backend]
            for ticket in running[part:]:
                _, task = self._held[ticket]
                if task is not None:
                    task.cancel("beyond this process's share of the backend")

    def _go_local(self) -> None:
        """Schedule alone, on this process's share of each backend and of the rate."""
        self.mode = Mode.LOCAL
        self._set_shares(local=True)
        self._set_rate(local=True)
        if self._timer is not None:  # Redis's pacing asked for it: the scheduler sets its own
            self._timer.cancel()
            self._timer = None
        log.error(
            "pool %s: Redis unreachable for the lease TTL: scheduling alone on %s", self.name,
            ", ".join(f"{b.name} {b.limit}/{b.slots}" for b in self.placement.backends),
        )  # fmt: skip
        super().pump()

    async def _adopt(self) -> None:
        """Redis answers again: lease what runs here, in place of what Redis held of this
        process; then settle for a TTL, unless nothing could have been decided alone."""
        was_local = self.mode is Mode.LOCAL
        self._adopting = True
        self._set_shares()  # nothing starts here while the list is on its way
        tickets = dict.fromkeys([*self._held, *self._local])
        running = [(t, t.backend.name) for t in tickets if t.backend is not None]
        try:
            leases, calm_s = await self.dispatch.adopt(
                self._ttl, [(backend, t.org, t.cls) for t, backend in running]
            )
            self._grant(await self._configure())  # a Redis that restarted knows no backend
        except BaseException:
            self._adopting = False
            self._back_alone()
            raise
        self._adopting = False
        self._set_rate(local=False)
        self._renewed, self.reachable, self._joined = time.monotonic(), True, True
        for timer in self._timers:
            timer.cancel()
        self._unreturned.clear()  # adopt handed back all of this process's old leases
        for (ticket, _), lease in zip(running, leases, strict=True):
            if ticket in self._held or ticket in self._local:
                task = self._local.get(ticket) or self._held.get(ticket, ("", None))[1]
                self._held[ticket] = (lease, task)
            else:  # it ended while the call was on its way
                self._later(self._finish(lease))
        if was_local or calm_s < self._ttl:
            self.mode, self._settled_at = Mode.SETTLING, time.monotonic() + self._ttl
            log.warning("pool %s: Redis is back: settling for %.3g s", self.name, self._ttl)
        else:
            self._resume()

    def _back_alone(self) -> None:
        """Redis did not take the list: in local mode (which may have begun while the call
        was on its way), the shares come back, and the local scheduler is pumped. Whatever
        asked for a dispatch meanwhile (the pacing timer, a request that ended and freed
        its slot, a new one) found no share, so it dispatched nothing and asked for no
        later pump: without this one, the line would wait for good."""
        alone = self.mode is Mode.LOCAL
        self._set_shares(local=alone)
        if alone:
            super().pump()

    def _resume(self) -> None:
        """Decide in Redis again: what waits here moves there, in the order it came."""
        log.warning("pool %s: scheduling in the shared state again", self.name)
        self.mode = Mode.SHARED
        for ticket in list(self._queued_here):
            if self.scheduler.cancel(ticket):
                ticket.payload.set_exception(Moved())
        self.pump()  # ``SharedPool.pump``: in Redis now

    def _ranked(self) -> list[str]:
        """The holders alive at the last heartbeat, this process among them."""
        me, holders = self.dispatch.holder, self.dispatch.holders
        return holders if me in holders else sorted([*holders, me])

    def _shares(self) -> list[int]:
        """This process's share of each backend: an even split among the holders alive at
        the last heartbeat."""
        ranked = self._ranked()
        rank = ranked.index(self.dispatch.holder)
        return [share(b.slots, i, len(ranked), rank) for i, b in enumerate(self.placement.backends)]

    def _set_shares(self, *, local: bool = False) -> None:
        """What this process's own scheduler may fill: its shares when ``local`` (and no
        adopt is on its way: a reload or the step to local mode meanwhile waits for its
        answer), else nothing at all."""
        alone = local and not self._adopting
        shares = self._shares() if alone else [0] * len(self.placement.backends)
        for backend, part in zip(self.placement.backends, shares, strict=True):
            backend.share = part

    def _set_rate(self, *, local: bool) -> None:
        """The local scheduler's pacing: when ``local``, this process's part of the pool's
        rate (split as the slots are); else the whole rate, which it does not use."""
        parts = len(self._ranked()) if local else 1
        self.scheduler.set_limits(*pool_limits(self._config, self.spec, parts))

    def _start(self, tickets: list[Ticket]) -> None:
        """The local scheduler dispatched these: they run under this process's share."""
        for ticket in tickets:
            self._local[ticket] = self._queued_here.get(ticket)
        super()._start(tickets)

    def _down(self) -> list[str]:
        return [b.name for b in self.placement.backends if not b.healthy]

    def _later(self, work: Awaitable[object]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def unavailable(pool: str) -> ApiError:
    return ApiError(
        503, f"Pool '{pool}' cannot reach its shared state; retry shortly.",
        code="state_unavailable", retry_after=RETRY_AFTER_S,
    )  # fmt: skip


def unknown_backend(pool: str) -> ApiError:
    return ApiError(
        503, f"Pool '{pool}' was given a backend this replica does not know (the replicas' "
        "configs differ); retry shortly.", code="backend_unknown", retry_after=RETRY_AFTER_S,
    )  # fmt: skip


__all__ = ["RETRY_AFTER_S", "LeasedPool", "Mode", "Moved", "unavailable"]
