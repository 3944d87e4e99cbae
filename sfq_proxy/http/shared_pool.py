"""A pool whose dispatch decisions are made in Redis: one fairness domain for every process
and replica that shares it (docs/shared-state.md).

It is the in-memory :class:`Pool` with the scheduler's calls replaced by ``RedisDispatch``
calls: the handler waits in line, holds a slot and gives it back as before. Health, probes,
calibration and the provider's feedback stay per process. Two loops keep it going: the
heartbeat, which renews this process's leases (and reaps those of dead processes), and the
inbox, which brings the grants that another process's call made for this one's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any

from redis.exceptions import RedisError

from ..config import Config
from ..core.calibration import Calibration
from ..core.cost import CostModel
from ..core.errors import ApiError
from ..core.fair_queue import FlowView
from ..core.placement import Backend
from ..core.scheduler import Ticket
from ..state.library import shielded
from ..state.redis_dispatch import Fenced, Grant, QueueFull, RedisDispatch, SharedTicket
from .pool_runtime import Clock, Pool, pool_limits

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1.0  # what a client is told while the shared state cannot be reached
INBOX_WAIT_S = 1.0  # how long one read of the inbox blocks (a connection of its own)


class SharedPool(Pool):
    def __init__(
        self,
        name: str,
        config: Config,
        clock: Clock,
        calibration: Calibration | None,
        dispatch: RedisDispatch,
    ) -> None:
        super().__init__(name, config, clock, calibration)
        self.dispatch = dispatch
        self._config = config
        self._ids = itertools.count(1)
        self._waiting: dict[str, tuple[Ticket, asyncio.Future[Backend]]] = {}
        self._held: dict[Ticket, tuple[str, asyncio.Task[object] | None]] = {}  # → lease, task
        self._background: set[asyncio.Task[None]] = set()
        self._renewed = 0.0  # when Redis last took this process's heartbeat (monotonic)
        self.reachable = False  # whether Redis answered the last heartbeat
        self._joined = False  # registered as a holder, and not fenced since
        self._unreturned: set[str] = set()  # leases whose hand-back failed: tried again
        self._stop = asyncio.Event()
        self._view: tuple[float, list[FlowView]] = (0.0, [])  # as of the last heartbeat

    @property
    def _ttl(self) -> float:
        state = self._config.state
        assert state is not None  # a shared pool exists only with a shared state
        return state.lease_ttl_s

    # -- what the handler calls -------------------------------------------------------------

    def ready(self) -> bool:
        """And its shared state answered the last heartbeat: while it does not, requests
        are refused (503), so a load balancer had better send them elsewhere."""
        return self.reachable and super().ready()

    def waiting(self, ticket: Ticket) -> int:
        """0: the line is counted in Redis, in the same step as the submit (``acquire``)."""
        return 0

    async def acquire(
        self,
        ticket: Ticket,
        *,
        expires_at: float | None = None,
        expiry: ApiError | None = None,
        front: bool = False,
    ) -> Backend:
        ticket_id = f"{self.dispatch.holder}.{next(self._ids)}"
        future: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        self._waiting[ticket_id] = (ticket, future)
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
                raise expiry or ApiError(504, "Deadline passed in the queue.") from None
            backend = future.result()  # dispatched in the very instant its deadline passed
        except BaseException:  # refused, or its client left: out of line, or its slot freed
            if ticket in self._held:  # granted in the instant it left
                self.release(ticket)
            else:
                self._later(self._cancel_after(submitted, ticket_id))
            raise
        lease, _ = self._held[ticket]
        self._held[ticket] = (lease, asyncio.current_task())
        return backend

    def release(self, ticket: Ticket, *, refund: bool = False) -> None:
        """Hand the lease back, in the background: the handler does not wait on Redis. A
        lease that Redis reclaimed meanwhile frees nothing (it is fenced)."""
        held = self._held.pop(ticket, None)
        backend, ticket.backend = ticket.backend, None
        if held is None or backend is None:
            return
        backend.in_flight = max(0, backend.in_flight - 1)
        self._later(self._finish(held[0]))

    def pump(self) -> None:
        self._later(self._call(self.dispatch.pump(self._down())))

    def reconfigure(self, config: Config, cost: CostModel) -> None:
        super().reconfigure(config, cost)
        self._config = config
        self._later(self._call(self._configure()))

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
            "shared": {"holder": self.dispatch.holder, "joined": self._joined},
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
        again, as a new holder, as soon as Redis answers."""
        while not await self._stopped_within(self._ttl / 3):
            try:
                if self._joined:
                    self._grant(await self.dispatch.heartbeat(self._ttl, self._down()))
                    self._renewed, self.reachable = time.monotonic(), True
                    self._view = await self.dispatch.view()
                    unreturned, self._unreturned = self._unreturned, set()
                    for lease in unreturned:
                        await self._finish(lease)
                else:
                    await self.start()
                    log.warning("pool %s: joined the shared state again", self.name)
            except Fenced:
                self._fence("Redis no longer holds its leases")
            except RedisError as err:
                self.reachable = False
                log.warning("pool %s: heartbeat to Redis failed: %s", self.name, err)
                if self._joined and time.monotonic() - self._renewed >= self._ttl:
                    self._fence("Redis was unreachable for the lease TTL")

    async def inbox_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self._grant(await self.dispatch.inbox(INBOX_WAIT_S))
            except RedisError as err:
                log.warning("pool %s: reading grants from Redis failed: %s", self.name, err)
                await self._stopped_within(RETRY_AFTER_S)

    def stop(self) -> None:
        """End the loops at their next step: they are never cancelled in the middle of a
        Redis call (see ``shielded``); the inbox's blocking read ends within INBOX_WAIT_S."""
        self._stop.set()

    async def _stopped_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)
        return self._stop.is_set()

    async def leave(self) -> None:
        """At shutdown: give up the place in line of every request still waiting, so that
        no slot goes to a process on its way out; they are told 503 with Retry-After, and a
        client retries on a replica that stays. Running requests finish (the drain)."""
        waiting, self._waiting = self._waiting, {}
        for ticket_id, (_, future) in waiting.items():
            if not future.done():
                future.set_exception(_leaving(self.name))
            self._later(self._cancel(ticket_id))

    async def drain(self) -> None:
        """Wait for the leases being handed back (at shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

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
            ticket.org, ticket.cls, ticket.cost, ticket.weight, ticket.tokens, ticket.priority
        )
        cls = self._config.classes.get(ticket.cls)
        cap = cls.max_queue_len if cls is not None else None
        try:
            grants = await self.dispatch.submit(
                ticket_id, shared, front=front, down=self._down(), max_ahead=cap
            )
        except QueueFull:
            raise ApiError(
                429, f"The queue of flow {ticket.flow} is full ({cap}).", code="queue_full",
                retry_after=1.0,
            ) from None  # fmt: skip
        except (RedisError, Fenced) as err:
            log.warning("pool %s: submit to Redis failed: %s", self.name, err)
            raise _unavailable(self.name) from err
        self._grant(grants)

    async def _cancel(self, ticket_id: str) -> bool:
        """Take the ticket out of line; False when a grant is on its way (it is then handed
        back by ``_grant``, since nobody waits for it)."""
        self._waiting.pop(ticket_id, None)
        try:
            return await self.dispatch.cancel(ticket_id)
        except (RedisError, Fenced) as err:  # reaped with this holder, if it comes to that
            log.warning("pool %s: cancel in Redis failed: %s", self.name, err)
            return True

    async def _finish(self, lease: str) -> None:
        """Hand a lease back; one that cannot be (Redis unreachable) is tried again at each
        heartbeat, else the heartbeat would keep its slot taken for as long as it beats."""
        try:
            self._grant(await self.dispatch.finish(lease, self._down()))
        except RedisError as err:
            log.warning("pool %s: a lease could not be handed back yet: %s", self.name, err)
            self._unreturned.add(lease)
        except Fenced:  # Redis gave it back with the others: the heartbeat will find out
            pass

    async def _configure(self) -> list[Grant]:
        org_caps, class_caps, _ = pool_limits(self._config, self.spec)
        backends = [(b.name, b.slots) for b in self.placement.backends]
        return await self.dispatch.configure(backends, org_caps, class_caps, self._down())

    async def _call(self, work: Awaitable[list[Grant] | None]) -> None:
        """A call whose failure only delays: the grants it made are carried out; if Redis is
        unreachable, the heartbeat deals with it."""
        try:
            grants = await work
        except (RedisError, Fenced) as err:
            log.warning("pool %s: a call to Redis failed: %s", self.name, err)
            return
        self._grant(grants or [])

    def _grant(self, grants: list[Grant]) -> None:
        """Wake the requests given a slot; a grant that nobody waits for any more (its
        client left, its deadline passed) is handed back at once."""
        for grant in grants:
            waiting = self._waiting.pop(grant.ticket, None)
            backend = next((b for b in self.placement.backends if b.name == grant.backend), None)
            if waiting is None or waiting[1].done() or backend is None:
                self._later(self._finish(grant.lease))
                continue
            ticket, future = waiting
            backend.in_flight += 1  # this process's share, for its metrics and state
            ticket.backend = backend
            ticket.dispatches += 1
            self._held[ticket] = (grant.lease, None)
            self.recent.append((ticket.flow, backend.name))
            future.set_result(backend)

    def _fence(self, why: str) -> None:
        """This process's leases are gone: fail what waits, and stop what runs, so that no
        backend serves more than its slots once Redis has given them to others."""
        log.error("pool %s: shared state lost (%s): ending its requests", self.name, why)
        self._joined = False
        self._unreturned.clear()  # reclaimed with the rest
        waiting, self._waiting = self._waiting, {}
        for _, future in waiting.values():
            if not future.done():
                future.set_exception(_unavailable(self.name))
        held, self._held = self._held, {}
        for ticket, (_, task) in held.items():
            if ticket.backend is not None:
                ticket.backend.in_flight = max(0, ticket.backend.in_flight - 1)
                ticket.backend = None
            if task is not None:
                task.cancel("its slot lease was lost")

    def _down(self) -> list[str]:
        return [b.name for b in self.placement.backends if not b.healthy]

    def _later(self, work: Awaitable[object]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(work)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _leaving(pool: str) -> ApiError:
    return ApiError(
        503, f"This proxy is shutting down; retry the request for pool '{pool}'.",
        code="shutting_down", retry_after=1.0,
    )  # fmt: skip


def _unavailable(pool: str) -> ApiError:
    return ApiError(
        503, f"Pool '{pool}' cannot reach its shared state; retry shortly.",
        code="state_unavailable", retry_after=RETRY_AFTER_S,
    )  # fmt: skip


__all__ = ["SharedPool"]
