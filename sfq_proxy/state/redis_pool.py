"""A pool whose dispatch decisions are made in Redis: one fairness domain for every process
and replica that shares it (docs/shared-state.md).

It is the in-memory :class:`Pool` with the scheduler's calls replaced by ``RedisDispatch``
calls: the handler waits in line, holds a slot and gives it back as before. Health and
probes stay per process; a provider pool's rate is paced in Redis, and what this process's
``Throttle`` concludes from its provider's answers (a pause, a lower rate factor) is pushed
there, so every replica holds off. Two loops keep it going: the heartbeat, which renews this
process's leases (and reaps those of dead processes), and the inbox, which brings the grants
that another process's call made for this one's requests; when pacing held a ticket back, a
timer pumps the pool once it allows the next dispatch.

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
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Coroutine, Mapping
from enum import Enum
from typing import Any

from redis.exceptions import RedisError

from ..config import Config
from ..core.calibration import Calibration
from ..core.cost import CostModel
from ..core.errors import ApiError, Expiry
from ..core.fair_queue import FlowView
from ..core.placement import Backend, share
from ..core.queue_memory import evicted
from ..core.scheduler import Ticket
from .pool import Clock, Dispatch, Memory, Pool, pool_limits, shutting_down
from .redis_dispatch import (
    Fenced,
    Grants,
    NotAdmitted,
    QueueFull,
    RedisDispatch,
    SharedTicket,
)
from .redis_functions import shielded
from .redis_limits import Intake

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1.0  # what a client is told while the shared state cannot be reached
INBOX_WAIT_S = 1.0  # how long one read of the inbox blocks (a connection of its own)


_Task = asyncio.Task[Any] | None


class Mode(Enum):
    SHARED = "shared"
    HOLDING = "holding"
    LOCAL = "local"
    SETTLING = "settling"


class _Moved(Exception):
    """A waiting request changes line: Redis was lost, or is back."""


class SharedPool(Pool):
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
        self._ids = itertools.count(1)
        # ticket id → the ticket, its future, and the task of its request (which a lost
        # lease ends)
        self._waiting: dict[str, tuple[Ticket, asyncio.Future[Backend], _Task]] = {}
        self._held: dict[Ticket, tuple[str, _Task]] = {}  # → lease, task
        # the org admissions that tickets' submits carry (``carry``), with their arguments
        self._carried: dict[Ticket, tuple[Intake, tuple[str, ...]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._renewed = 0.0  # when Redis last took this process's heartbeat (monotonic)
        self.reachable = False  # whether Redis answered the last heartbeat
        self._joined = False  # registered as a holder, and not fenced since
        # leases whose hand-back failed, with their requests' actual costs: tried again
        self._unreturned: dict[str, float | None] = {}
        self._stop = asyncio.Event()
        self._view: tuple[float, list[FlowView]] = (0.0, [])  # as of the last heartbeat
        self.mode = Mode.SHARED
        self._settled_at = 0.0  # when settling ends (monotonic)
        self._timers: list[asyncio.TimerHandle] = []  # of _lose: to end the excess, go local
        # the local scheduler: what waits in it (in arrival order), what it dispatched
        self._queued_here: dict[Ticket, _Task] = {}
        self._local: dict[Ticket, _Task] = {}
        # adopt's list on its way to Redis: nothing may start here, whatever mode or reload
        # comes meanwhile, since Redis may take the list and decide from then on
        self._adopting = False
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

    # -- what the handler calls -------------------------------------------------------------

    def ready(self) -> bool:
        """And its shared state answered the last heartbeat, or the pool goes on without it
        (``when_unreachable: local``): else requests are refused (503), so a load balancer
        had better send them elsewhere."""
        return (self.reachable or self.mode is not Mode.SHARED) and super().ready()

    def waiting(self, ticket: Ticket) -> int:
        """In Redis the line is counted in the same step as the submit (``acquire``)."""
        return 0 if self.mode is Mode.SHARED else super().waiting(ticket)

    def carry(self, ticket: Ticket, intake: Intake) -> bool:
        """In Redis, on one server: its submit decides it (one round trip instead of two).
        Not when the ticket would take someone's place in the queue memory: a request that
        its org's limits then refuse must not have evicted anyone."""
        carried = intake.carried()
        if not carried or self.mode is not Mode.SHARED or not self.memory.fits(ticket.size):
            return False
        self._carried[ticket] = (intake, carried)
        return True

    async def acquire(self, ticket: Ticket, **options: Any) -> Backend:
        try:
            return await super().acquire(ticket, **options)
        finally:
            self._carried.pop(ticket, None)  # decided, or never to be

    async def _queue(
        self, ticket: Ticket, expires_at: float | None, expiry: Expiry, front: bool
    ) -> Backend:
        """In line in Redis, or in this process's own while Redis is lost; a request that
        waits when the mode changes moves to the other line (its deadline goes with it).
        Its body waits in this process either way: the process's queue memory counts it
        (``Pool.acquire``)."""
        while True:
            try:
                if self.mode is Mode.SHARED:
                    return await self._acquire_shared(ticket, expires_at, expiry, front)
                return await self._acquire_here(ticket, expires_at, expiry, front)
            except _Moved:
                continue

    async def _acquire_here(
        self, ticket: Ticket, expires_at: float | None, expiry: Expiry, front: bool
    ) -> Backend:
        carried = self._carried.pop(ticket, None)
        if carried is not None:  # Redis was lost before it was submitted: decided on its own
            await carried[0].decide()
        self._queued_here[ticket] = asyncio.current_task()
        try:
            backend = await super()._queue(ticket, expires_at, expiry, front)
        finally:
            self._queued_here.pop(ticket, None)
        return backend

    async def _acquire_shared(
        self, ticket: Ticket, expires_at: float | None, expiry: Expiry, front: bool
    ) -> Backend:
        ticket_id = f"{self.dispatch.holder}.{next(self._ids)}"
        ticket.payload = ticket_id  # what ``evict`` finds it by
        future: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        self._waiting[ticket_id] = (ticket, future, asyncio.current_task())
        submitted = asyncio.ensure_future(self._submit(ticket_id, ticket, front))
        try:
            await shielded(submitted)
            if expires_at is None:
                backend = await future
            else:
                async with asyncio.timeout(max(0.0, expires_at - self.clock())):
                    backend = await future
        except TimeoutError:
            if await shielded(self._cancel(ticket_id)) or not future.done():
                raise expiry.error() from None
            backend = future.result()  # dispatched in the very instant its deadline passed
        except _Moved:  # Redis was lost: what it still holds of the ticket goes at adopt
            self._waiting.pop(ticket_id, None)
            if future.done():  # moved by _lose while its own submit failed too: seen
                future.exception()
            raise
        except BaseException:  # refused, or its client left: out of line, or its slot freed
            if ticket in self._held:  # granted in the instant it left
                self.release(ticket)
            elif ticket_id in self._waiting:  # else not in Redis's line, or taken out already
                self._later(self._cancel_after(submitted, ticket_id))
            raise
        return backend

    def evict(self, ticket: Ticket) -> None:
        """Out of the line it waits in (Redis's, or this process's own), answered 429
        ``queue_full``; a grant already on its way is handed back (nobody waits for it)."""
        if ticket in self._queued_here:
            super().evict(ticket)
            return
        ticket_id = ticket.payload
        waiting = self._waiting.pop(ticket_id, None) if isinstance(ticket_id, str) else None
        if waiting is None:
            return
        future = waiting[1]
        if not future.done():
            future.set_exception(evicted())
        self._later(self._cancel(ticket_id))

    def release(self, ticket: Ticket, *, refund: bool = False, actual: float | None = None) -> None:
        """Hand the lease back, in the background: the handler does not wait on Redis. A
        lease that Redis reclaimed meanwhile frees nothing (it is fenced)."""
        held = self._held.pop(ticket, None)
        self._stop_running(ticket, refund=refund, actual=actual)
        if held is not None:
            self._later(self._finish(held[0], ticket.tokens if refund else None, actual))
            if self.mode is Mode.LOCAL:  # a slot Redis granted is this process's to fill
                self.pump()

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

    def pump(self) -> None:
        if self.mode is Mode.SHARED:
            self._later(self._call(self.dispatch.pump(self._down())))
        else:
            super().pump()

    def reconfigure(self, config: Config, cost: CostModel) -> None:
        super().reconfigure(config, cost)
        self._config = config
        alone = self.mode is Mode.LOCAL  # a reload while Redis is lost keeps the split
        self._set_shares(local=alone)
        self._set_rate(local=alone)
        self._later(self._call(self._configure()))

    def observe_answer(self, status: int, headers: Mapping[str, str], sent_at: float) -> str | None:
        """And what the ``Throttle`` concluded holds every replica's dispatch of the pool:
        pushed to Redis in the background, never in the way of the answer."""
        reason = super().observe_answer(status, headers, sent_at)
        if reason is not None:
            now, throttle = self.clock(), self.throttle
            pause_s = max(0.0, throttle.paused_until - now)
            call = self.dispatch.throttle(pause_s, throttle.factor(now), throttle.recover_per_s)
            self._later(self._call(call))
        return reason

    def virtual_time(self) -> float:
        return self._view[0]

    def flow_views(self) -> list[FlowView]:
        """The pool's flows as Redis held them at the last heartbeat (the whole pool)."""
        return self._view[1]

    def flow_running(self) -> Mapping[str, int]:
        """This process's share: the requests it runs, per flow."""
        return Counter(ticket.flow for ticket in self._held)

    def state(self) -> dict[str, Any]:
        """``/admin/state``: the pool's flows as Redis held them at the last heartbeat, and
        this process's share of it (what it queued, what it runs, its holder)."""
        return {
            **super().state(),
            "queued": len(self._waiting),
            "running": len(self._held),
            "shared": {
                "holder": self.dispatch.holder,
                "joined": self._joined,
                "mode": self.mode.value,
            },
        }

    # -- the loops ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Register this process, the pool's backends and caps; a RedisError here means the
        proxy cannot start."""
        await self.dispatch.heartbeat(self._ttl, self._down(), new=True)
        self._renewed, self.reachable, self._joined = time.monotonic(), True, True
        self._grant(await self._configure())

    def loops(self) -> list[Coroutine[Any, Any, None]]:
        """What runs as long as the proxy does: the heartbeat and the inbox."""
        return [self.heartbeat_forever(), self.inbox_forever()]

    async def heartbeat_forever(self) -> None:
        """Renew the leases every third of their TTL. When Redis gave them back (this process
        was paused or cut off past the TTL, or Redis lost its data), or could not be told for
        a whole TTL, end what they covered: others may hold those slots now. Then join
        again, as a new holder, as soon as Redis answers. With ``when_unreachable: local``,
        Redis lost (or forgetting this process while it was not away) starts the modes of
        the module's docstring instead."""
        while not await self._stopped_within(self._ttl / 3):
            try:
                await self._beat()
            except Fenced:
                if self._fallback and time.monotonic() - self._renewed < self._ttl:
                    self._lose("Redis forgot this process's state")  # restarted empty
                else:
                    self._fence("Redis no longer holds its leases")
            except RedisError as err:
                self.reachable = False
                log.warning("pool %s: heartbeat to Redis failed: %s", self.name, err)
                if self._fallback:
                    self._lose("Redis unreachable")
                elif self._joined and time.monotonic() - self._renewed >= self._ttl:
                    self._fence("Redis was unreachable for the lease TTL")

    async def _beat(self) -> None:
        if self.mode in (Mode.HOLDING, Mode.LOCAL):
            await self._adopt()
        elif self._joined:
            self._grant(await self.dispatch.heartbeat(self._ttl, self._down()))
            self._renewed, self.reachable = time.monotonic(), True
            self._view = await self.dispatch.view()
            unreturned, self._unreturned = self._unreturned, {}
            for lease, actual in unreturned.items():
                await self._finish(lease, actual=actual)
            if self.mode is Mode.SETTLING and time.monotonic() >= self._settled_at:
                self._resume()
        else:
            await self.start()
            log.warning("pool %s: joined the shared state again", self.name)

    async def inbox_forever(self) -> None:
        """Until the drain: then nothing of this process waits in Redis any more."""
        while not (self._stop.is_set() or self.draining):
            try:
                self._grant(await self.dispatch.inbox(INBOX_WAIT_S))
            except RedisError as err:
                log.warning("pool %s: reading grants from Redis failed: %s", self.name, err)
                await self._stopped_within(RETRY_AFTER_S)

    def stop(self) -> None:
        """End the loops at their next step: they are never cancelled in the middle of a
        Redis call (see ``shielded``); the inbox's blocking read ends within INBOX_WAIT_S."""
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        if self._timer is not None:  # a pump that pacing asked for
            self._timer.cancel()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def leave(self) -> None:
        """At shutdown: give up the place in line of every request still waiting, so that
        no slot goes to a process on its way out; they are told 503 with Retry-After, and a
        client retries on a replica that stays. Running requests finish (the drain)."""
        await super().leave()  # and those in this process's own line, Redis being lost
        waiting, self._waiting = self._waiting, {}
        for ticket_id, (_, future, _) in waiting.items():
            if not future.done():
                future.set_exception(shutting_down(self.name))
            self._later(self._cancel(ticket_id))

    async def drain(self) -> None:
        """Wait for the leases being handed back (at shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def quit(self) -> None:
        """The last call: Redis forgets this process, and gives back whatever it still held
        there (a lease granted as it left, or one whose hand-back failed), to the others at
        once rather than after the lease TTL."""
        if self._joined:
            self._joined = False
            self._grant(await self.dispatch.quit(self._down()))

    # -- internals ----------------------------------------------------------------------------

    async def _cancel_after(self, submitted: asyncio.Future[None], ticket_id: str) -> None:
        """Cancel once the submit has landed: a cancel that overtook it would find nothing."""
        with contextlib.suppress(BaseException):
            await submitted
        await self._cancel(ticket_id)

    async def _submit(self, ticket_id: str, ticket: Ticket, front: bool) -> None:
        """Queue the ticket, and carry out what the call dispatched (this ticket's grant or
        others'), even when the request that asked has left meanwhile."""
        shared = SharedTicket(
            ticket.org, ticket.cls, ticket.cost, ticket.weight, ticket.tokens, ticket.priority,
            ticket.affinity, bucket=ticket.bucket, max_overtaken=ticket.max_overtaken,
        )  # fmt: skip
        cls = self._config.classes.get(ticket.cls)
        cap = cls.max_queue_len if cls is not None else None
        carried = self._carried.pop(ticket, None)
        intake, admit = carried if carried is not None else (None, ())
        try:
            grants = await self.dispatch.submit(
                ticket_id, shared, front=front, down=self._down(), max_ahead=cap, admit=admit
            )
        except NotAdmitted as refused:
            self._waiting.pop(ticket_id, None)  # not queued: nothing to cancel
            assert intake is not None
            intake.settle(refused.reply)  # raises its 409 or 429
            raise
        except QueueFull as full:
            self._waiting.pop(ticket_id, None)
            if intake is not None and full.admitted is not None:
                intake.settle(full.admitted)  # admitted: refunded as it leaves
            raise ApiError(
                429, f"The queue of flow {ticket.flow} is full (max_queue_len {cap}).",
                code="queue_full", retry_after=1.0,
            ) from None  # fmt: skip
        except RedisError as err:
            log.warning("pool %s: submit to Redis failed: %s", self.name, err)
            if self._fallback:
                self._lose("Redis unreachable")
                if carried is not None:  # decided where it waits now
                    self._carried[ticket] = carried
                raise _Moved from err
            raise _unavailable(self.name) from err
        except Fenced as err:  # reclaimed: the heartbeat joins again, or ends what ran
            log.warning("pool %s: submit to Redis failed: %s", self.name, err)
            raise _unavailable(self.name) from err
        self._grant(grants)
        if intake is not None:
            assert grants.admitted is not None
            intake.settle(grants.admitted)

    async def _cancel(self, ticket_id: str) -> bool:
        """Take the ticket out of line; False when a grant is on its way (it is then handed
        back by ``_grant``, since nobody waits for it)."""
        self._waiting.pop(ticket_id, None)
        try:
            return await self.dispatch.cancel(ticket_id)
        except (RedisError, Fenced) as err:  # reaped with this holder, if it comes to that
            log.warning("pool %s: cancel in Redis failed: %s", self.name, err)
            return True

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
        backends = [(b.name, b.slots) for b in self.placement.backends]
        placement = self.placement
        return await self.dispatch.configure(
            backends, org_caps, class_caps, self._down(), rate, placement.load_factor,
            placement.slack,
        )  # fmt: skip

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
        client left, its deadline passed) is handed back at once. When pacing held a ticket
        back, pump the pool once it allows."""
        if grants.wake_s is not None:
            self._wake_in(grants.wake_s)
        for grant in grants:
            waiting = self._waiting.pop(grant.ticket, None)
            backend = next((b for b in self.placement.backends if b.name == grant.backend), None)
            if waiting is None or waiting[1].done() or backend is None:
                self._later(self._finish(grant.lease))
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
                future.set_exception(_unavailable(self.name))
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
                future.set_exception(_Moved())
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
                ticket.payload.set_exception(_Moved())
        self.pump()

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


def _unavailable(pool: str) -> ApiError:
    return ApiError(
        503, f"Pool '{pool}' cannot reach its shared state; retry shortly.",
        code="state_unavailable", retry_after=RETRY_AFTER_S,
    )  # fmt: skip


__all__ = ["SharedPool"]
