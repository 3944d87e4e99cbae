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

What this process holds in Redis, its leases, and the four modes a pool goes through when
Redis is lost (``when_unreachable: local``) are in ``redis_pool_leases.py``, the base class
``LeasedPool``: this module is the line in Redis (a request's submit, its cancel), what the
handler calls, and the loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Coroutine, Mapping
from typing import Any

from redis.exceptions import RedisError

from ..config import Config
from ..core.calibration import Calibration
from ..core.cost import CostModel
from ..core.errors import ApiError, Expiry
from ..core.fair_queue import FlowView
from ..core.placement import Backend
from ..core.queue_memory import evicted
from ..core.scheduler import Ticket
from .pool import Clock, Memory, shutting_down
from .redis_dispatch import Fenced, NotAdmitted, QueueFull, RedisDispatch, SharedTicket
from .redis_functions import shielded
from .redis_limits import Intake
from .redis_pool_leases import RETRY_AFTER_S, LeasedPool, Mode, Moved, unavailable

log = logging.getLogger(__name__)
INBOX_WAIT_S = 1.0  # how long one read of the inbox blocks (a connection of its own)


class SharedPool(LeasedPool):
    def __init__(
        self,
        name: str,
        config: Config,
        clock: Clock,
        calibration: Calibration | None,
        dispatch: RedisDispatch,
        memory: Memory | None = None,
    ) -> None:
        super().__init__(name, config, clock, calibration, dispatch, memory)
        self._ids = itertools.count(1)
        # the org admissions that tickets' submits carry (``carry``), with their arguments
        self._carried: dict[Ticket, tuple[Intake, tuple[str, ...]]] = {}
        self._stop = asyncio.Event()
        # set by stop(), and by a call that found this process fenced: the heartbeat then
        # beats at once rather than a third of the TTL later
        self._wake = asyncio.Event()
        self._view: tuple[float, list[FlowView]] = (0.0, [])  # as of the last heartbeat

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
            except Moved:
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
        if not self._joined:  # fenced: joining again forgets whatever Redis still holds of
            raise unavailable(self.name)  # this holder, so a ticket queued now would wait for good
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
        except Moved:  # Redis was lost: what it still holds of the ticket goes at adopt
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

    def queued(self) -> int:
        """This process's requests waiting: in Redis's line or, while Redis is lost, its own."""
        return len(self._waiting) + super().queued()

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
        again, as a new holder, as soon as Redis answers (at once when it does; a submit
        that finds this process fenced beats at once too). With ``when_unreachable: local``,
        Redis lost (or forgetting this process while it was not away) starts the modes of
        ``redis_pool_leases``'s docstring instead."""
        wait = self._ttl / 3
        while not await self._stopped_within(wait, wakes=True):
            wait = self._ttl / 3
            self._wake.clear()
            try:
                await self._beat()
            except Fenced:
                if self._fallback and time.monotonic() - self._renewed < self._ttl:
                    self._lose("Redis forgot this process's state")  # restarted empty
                else:
                    self._fence("Redis no longer holds its leases")
                    wait = 0.0  # Redis answers: join again now, not a beat later
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
        self._wake.set()
        for timer in self._timers:
            timer.cancel()
        if self._timer is not None:  # a pump that pacing asked for
            self._timer.cancel()

    async def _stopped_within(self, seconds: float, wakes: bool = False) -> bool:
        """Whether the loops are to stop, after ``seconds`` or at the stop (or, ``wakes``,
        once woken: ``_wake``)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((self._wake if wakes else self._stop).wait(), seconds)
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

    # -- the line in Redis: a submit, a cancel ------------------------------------------------

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
                raise Moved from err
            raise unavailable(self.name) from err
        except Fenced as err:  # reclaimed: the heartbeat joins again, or ends what ran
            self._wake.set()  # now
            log.warning("pool %s: submit to Redis failed: %s", self.name, err)
            raise unavailable(self.name) from err
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


__all__ = ["Mode", "SharedPool"]
