"""One pool at run time: the async shell around its scheduler, and its health probes.

The scheduler decides; this module only turns its decisions into resolved futures and
its health rules into probes, so every ordering decision stays in sans-I/O code.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import aiohttp

from ..config import Config, PoolSpec
from ..core.calibration import Calibration, InputModel
from ..core.cost import CostModel
from ..core.errors import ApiError, Expiry
from ..core.fair_queue import FlowView
from ..core.flows import org_and_class
from ..core.limits import Rate
from ..core.placement import Backend, Placement
from ..core.queue_memory import QueueMemory, evicted
from ..core.scheduler import Scheduler, Ticket
from ..core.throttle import Throttle
from .engine_scrape import engine_state, equip

if TYPE_CHECKING:
    from .redis_limits import Intake

log = logging.getLogger(__name__)

Clock = Callable[[], float]
RECENT_DISPATCHES = 1000  # how many of the last dispatches /admin/state shows, oldest first
SERVED_WINDOW_S = 300.0  # /admin/state's share of each flow: the cost served in this window
QUEUE_DEADLINE = Expiry(504, "Deadline passed in the queue.")  # a bound with no answer of its own


class Holder(Protocol):
    """Where the items of a flow of the queue memory are, which evicts them: a pool, for its
    waiting tickets; ``body.READERS``, for the bodies being read."""

    def evict(self, item: Any, /) -> None: ...


# the process's queue memory: waiting tickets by flow, the pool's name and the flow's id,
# and the pool (where an evicted ticket waits); and the bodies being read, by org
# (``("", org, body.READERS)``)
Memory = QueueMemory[tuple[str, str, Holder], Hashable]


def pool_limits(
    config: Config, spec: PoolSpec, parts: int = 1
) -> tuple[dict[str, int], dict[str, int], Rate | None]:
    """The pool's concurrency caps per org and per class, and its provider rate, if any (one
    of ``parts`` even shares of it: a replica alone while the shared state is lost)."""
    org_caps = {o: s.max_in_flight for o, s in config.orgs.items() if s.max_in_flight}
    class_caps = {c: s.max_in_flight for c, s in config.classes.items() if s.max_in_flight}
    rate = spec.rate
    # a provider's rate paces dispatch, so queued work waits instead of meeting its 429s;
    # providers enforce per-minute limits over seconds, so the burst is one second's worth
    paced = None
    if rate is not None:
        rpm, tpm = rate.requests_per_minute, rate.tokens_per_minute
        paced = Rate.of(rpm and rpm / parts, tpm and tpm / parts, burst_s=1.0)
    return org_caps, class_caps, paced


class Dispatch(NamedTuple):
    """One dispatch, as ``/admin/state`` shows it: what explains the order from the meters
    alone (the eligible flow with the smallest start tag went; ``v`` moved up to that tag and
    the flow's meter on to ``start_tag + cost / weight``). The tags are None where this
    process's fair queue did not decide: the strict band, and a shared pool's grants."""

    flow: str
    backend: str
    cost: float
    weight: float
    start_tag: float | None
    virtual_time: float | None  # just before the dispatch
    at: float  # the pool's clock
    waited: float  # in line, since it joined it (the admin page's wait quantiles)

    @classmethod
    def of(cls, ticket: Ticket, backend: str, at: float, *, tagged: bool = True) -> Dispatch:
        start, v = (ticket.start_tag, ticket.virtual_time) if tagged else (None, None)
        waited = at - ticket.queued_at
        return cls(ticket.flow, backend, ticket.cost, ticket.weight, start, v, at, waited)

    def view(self, now: float) -> dict[str, Any]:
        """Its entry in ``recent_dispatches``; ``age_s``: how long ago, on the pool's clock."""
        start = self.start_tag
        finish = None if start is None else start + self.cost / self.weight
        return {
            "flow": self.flow, "backend": self.backend, "cost": self.cost,
            "weight": self.weight, "start_tag": start, "finish_tag": finish,
            "v": self.virtual_time, "age_s": now - self.at,
        }  # fmt: skip


class Pool:
    def __init__(
        self,
        name: str,
        config: Config,
        clock: Clock,
        calibration: Calibration | None = None,
        memory: Memory | None = None,
    ) -> None:
        """``memory``: the process's queue memory, which every pool shares (a pool made
        alone counts its own)."""
        self.name = name
        self.config = config  # the flows' weights, for /admin/state
        self.spec = spec = config.pools[name]
        self.clock = clock
        self.placement = Placement(
            spec.backends,
            failures_to_down=spec.health.consecutive_failures,
            load_factor=spec.affinity.load_factor if spec.affinity else None,
            slack=spec.affinity.slack if spec.affinity else 0,
        )
        org_caps, class_caps, rate = pool_limits(config, spec)
        self.throttle = Throttle()  # the provider's own 429s and rate-limit headers
        self.scheduler = Scheduler(
            self.placement,
            org_caps=org_caps,
            class_caps=class_caps,
            rate=rate,
            throttle=self.throttle,
        )
        equip(self)  # engine dispatch: the backends' gates (engine_scrape.py)
        # engine dispatch: set when a request ends, so that its engine is read again at once
        # (the room it left is not in the last reading)
        self.ended = asyncio.Event()
        self.calibration = calibration
        self.cost = CostModel(spec.cost, f"pools.{name}.cost", pool=name, calibration=calibration)
        self.upstream_key = config.upstream_key(name)
        self.recent: deque[Dispatch] = deque(maxlen=RECENT_DISPATCHES)  # one append each
        self._timer: asyncio.TimerHandle | None = None
        self._revivals: dict[Backend, asyncio.TimerHandle] = {}  # passive: end of cooldowns
        limit = config.limits.queue_memory_bytes
        self.memory: Memory = QueueMemory(limit) if memory is None else memory
        self.draining = False  # the drain began: nothing joins a line any more
        self._retrying: set[Ticket] = set()  # waiting again: not in the queue memory

    def reconfigure(self, config: Config, cost: CostModel) -> None:
        """A config reload; ``cost`` was built beforehand, so a bad tokenizer changes nothing.

        Meters, the virtual time and queued requests stay; queued flows take their new
        weights at their next charge.
        """
        self.config = config
        self.spec = config.pools[self.name]
        self.placement.update(self.spec.backends)
        self.placement.failures_to_down = self.spec.health.consecutive_failures
        affinity = self.spec.affinity
        self.placement.load_factor = affinity.load_factor if affinity else None
        self.placement.slack = affinity.slack if affinity else 0
        self.scheduler.set_limits(*pool_limits(config, self.spec))
        equip(self)
        self.memory.limit = config.limits.queue_memory_bytes  # newcomers see it; none leaves
        for view in self.scheduler.queue.flows():
            org, cls = org_and_class(view.flow)
            if cls in config.classes:
                self.scheduler.queue.set_weight(view.flow, config.flow_weight(org, cls))
        self.cost = cost
        self.upstream_key = config.upstream_key(self.name)
        if self.spec.health.mode == "passive":  # no probe will bring these back
            for backend in self.placement.backends:
                if not backend.healthy:
                    self._revive_later(backend)
        self.pump()

    async def acquire(
        self,
        ticket: Ticket,
        *,
        expires_at: float | None = None,
        expiry: Expiry = QUEUE_DEADLINE,
        front: bool = False,
    ) -> Backend:
        """Wait in line until ``ticket`` is given a backend slot.

        At ``expires_at`` (on this pool's clock) a ticket still waiting leaves the queue
        uncharged and ``expiry``'s error is raised. If the waiting task is cancelled (its
        client went away) the ticket leaves uncharged too, or, if it was dispatched in that
        same instant, frees its slot. ``front`` queues a retry at the head of its flow.

        A request's first wait is counted in the process's queue memory (design.md §6,
        Queue memory): when that is full, the request is refused (429 ``queue_full``), or,
        its flow not being among the largest, takes the place of the newest requests of
        the largest, each answered 429 ``queue_full``. A retry is not counted again: the
        requests running, and so those retried, are bounded by the slots. While the proxy
        drains nothing joins a line (503 ``shutting_down``).
        """
        if self.draining:
            raise shutting_down(self.name)
        ticket.queued_at = self.clock()
        if front:
            self._retrying.add(ticket)
            try:
                return await self._queue(ticket, expires_at, expiry, front)
            finally:
                self._retrying.discard(ticket)
        for (_, _, pool), victim in self.memory.enter(self._line(ticket), ticket, ticket.size):
            pool.evict(victim)
        try:
            return await self._queue(ticket, expires_at, expiry, front)
        finally:
            self.memory.leave(self._line(ticket), ticket)

    def _line(self, ticket: Ticket) -> tuple[str, str, Pool]:
        """``ticket``'s flow in the process's queue memory."""
        return self.name, ticket.flow, self

    async def _queue(
        self, ticket: Ticket, expires_at: float | None, expiry: Expiry, front: bool
    ) -> Backend:
        """In this pool's own line, until dispatched, out of time, evicted or cancelled."""
        future: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        ticket.payload = future
        self._run(self.scheduler.submit(ticket, self.clock(), front=front))
        if future.done():  # dispatched at once: the common case when the pool is not full
            return future.result()
        try:
            if expires_at is None:
                return await future
            async with asyncio.timeout(max(0.0, expires_at - self.clock())):
                return await future
        except TimeoutError:
            if self.scheduler.cancel(ticket) or ticket.backend is None:
                raise expiry.error() from None
            return ticket.backend  # dispatched in the very instant its deadline passed
        except asyncio.CancelledError:
            if not self.scheduler.cancel(ticket) and ticket.backend is not None:
                self.release(ticket)
            raise

    def evict(self, ticket: Ticket) -> None:
        """The process's queue memory is full and a smaller flow's request came: ``ticket``,
        the newest of the largest flow, leaves the line uncharged and is answered 429
        ``queue_full``."""
        if self.scheduler.cancel(ticket):
            ticket.payload.set_exception(evicted())

    async def leave(self) -> None:
        """The drain begins: every request still waiting in line is answered 503
        ``shutting_down`` with ``Retry-After`` (its client retries, on another replica if
        there is one), and none joins a line any more. Running requests go on."""
        self.draining = True
        waiting = [
            t for (_, _, pool), t in self.memory.items() if pool is self and isinstance(t, Ticket)
        ]
        for ticket in [*waiting, *self._retrying]:
            if self.scheduler.cancel(ticket):  # in this pool's own line (not Redis's)
                ticket.payload.set_exception(shutting_down(self.name))

    def ready(self) -> bool:
        """Whether the pool can take requests (``/readyz``): a backend of it is healthy."""
        return self.placement.any_healthy()

    def waiting(self, ticket: Ticket) -> int:
        """How many requests wait ahead of ``ticket`` in its own line (``max_queue_len``)."""
        return self.scheduler.waiting(ticket)

    def carry(self, ticket: Ticket, intake: Intake) -> bool:
        """Whether ``ticket``'s wait in line decides ``intake`` too, in the same step (a
        shared pool's); else the handler decides it first."""
        return False

    def pump(self) -> None:
        """Dispatch what capacity allows now: a backend came back, or the config changed."""
        self._run(self.scheduler.pump(self.clock()))

    def after_reading(self) -> None:
        """An engine's reading arrived (engine dispatch): it may open a gate, or a failure
        turn one stale, so try to dispatch."""
        self.pump()

    def release(self, ticket: Ticket, *, refund: bool = False, actual: float | None = None) -> None:
        """The request holding a slot is over (done, failed or cancelled); ``refund`` when
        the upstream generated nothing, so the pool's pacing gives its tokens back;
        ``actual``: what the backend reports it cost, its flow's charge trued up to it (None:
        the estimate stands)."""
        now = self.clock()
        if refund:
            self.scheduler.refund(ticket.tokens, now)
        self._run(self.scheduler.finish(ticket, now, actual))
        if self.scheduler.ceilings is not None:  # engine dispatch
            self.ended.set()

    def report_failure(self, backend: Backend) -> None:
        """A failed probe, connection failure or 5xx: ``health.consecutive_failures`` in a row
        take the backend out for a cooldown."""
        health = self.spec.health
        if self.placement.record_failure(backend, self.clock() + health.cooldown_s):
            log.warning(
                "pool %s: backend %s marked down after %d failure(s) in a row",
                self.name, backend.name, backend.failures,
            )  # fmt: skip
        if not backend.healthy and health.mode == "passive":
            self._revive_later(backend)

    def observe_answer(self, status: int, headers: Mapping[str, str], sent_at: float) -> str | None:
        """An upstream answer's status and headers, as soon as they arrive: a 429 or a
        provider's exhausted rate limit holds the pool's dispatch (see ``core/throttle.py``);
        the pool's next dispatch attempt arms the timer that ends the hold. Returns why
        dispatch is now held, if it is."""
        now = self.clock()
        try:
            reason = self.throttle.observe(status, headers, sent_at, now)
        except Exception:  # a bug must not cost the answer (its connection is still open)
            log.exception("pool %s: the upstream's rate-limit headers were not read", self.name)
            return None
        if reason is not None:
            log.info(
                "pool %s: provider rate limit (%s): dispatch held for %.3f s, rate factor %.3g",
                self.name, reason, self.throttle.wait(now), self.throttle.factor(now),
            )  # fmt: skip
        return reason

    def report_success(self, backend: Backend) -> None:
        """A good probe or an answer that is not a failure: the failure streak ends."""
        self.placement.record_success(backend)

    def _revive_later(self, backend: Backend) -> None:
        """Passive health: bring ``backend`` back when its cooldown is over (at once if it is
        over already, as for a backend new in a reloaded file)."""
        if backend in self._revivals:
            return
        delay = backend.down_until - self.clock()
        if delay <= 0:
            self._revive(backend)
        else:
            loop = asyncio.get_running_loop()
            self._revivals[backend] = loop.call_later(delay, self._revive, backend)

    def _revive(self, backend: Backend) -> None:
        self._revivals.pop(backend, None)
        if self.spec.health.mode != "passive":  # a reload made the pool active: probes decide
            return
        if self.placement.mark_up(backend, self.clock()):
            log.warning("pool %s: backend %s is back (cooldown over)", self.name, backend.name)
            self.pump()
        elif not backend.healthy:  # failed again meanwhile: the cooldown was pushed back
            self._revive_later(backend)

    async def probe_forever(self, session: aiohttp.ClientSession) -> None:
        """Active health: probe every backend each interval. A passive pool sends nothing,
        but keeps the loop, so that a reload may make it active."""
        while True:
            health = self.spec.health
            if health.mode == "active":
                await asyncio.gather(*(self._probe(session, b) for b in self.placement.backends))
            await asyncio.sleep(health.interval_s)

    async def _probe(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        health = self.spec.health
        url = backend.base + health.path  # the server's root (or prefix), not its /v1
        limit = aiohttp.ClientTimeout(total=health.timeout_s)
        headers = {}
        if health.send_key and self.upstream_key:
            headers["Authorization"] = f"Bearer {self.upstream_key}"
        try:
            async with session.request(health.method, url, headers=headers, timeout=limit) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if not ok:
            self.report_failure(backend)
            return
        self.report_success(backend)
        if self.placement.mark_up(backend, self.clock()):
            log.warning("pool %s: backend %s is back", self.name, backend.name)
            self.pump()

    def virtual_time(self) -> float:
        return self.scheduler.queue.virtual_time

    def queued(self) -> int:
        """How many requests wait in this pool's line."""
        return self.scheduler.queued()

    def flow_views(self) -> list[FlowView]:
        """Every flow the fair queue tracks, in flow-id order (metrics, ``/admin/state``)."""
        return self.scheduler.queue.flows()

    def flow_running(self) -> Mapping[str, int]:
        """Requests dispatched and not finished, per flow."""
        return self.scheduler.flow_running

    def state(self) -> dict[str, Any]:
        """This pool in ``/admin/state``: what the operator needs to see who waits, and why.

        ``recent_dispatches`` (oldest first) and ``served_recent`` (each flow's share of the
        cost dispatched in the last ``window_s``, among those dispatches) are this process's
        own: with the shared state, other replicas dispatch too.
        """
        now = self.clock()
        return {
            "virtual_time": self.virtual_time(),
            "queued": self.queued(),
            "running": self.scheduler.running,
            "flows": [
                {
                    "flow": v.flow,
                    "weight": self._weight(v.flow),
                    "meter": v.meter,
                    "lag": v.lag,
                    "queued": v.backlog,
                    "eligible": v.eligible,
                }
                for v in self.flow_views()
            ],
            "backends": [
                {
                    "name": b.name,
                    "url": b.url,
                    "slots": b.slots,
                    "in_flight": b.in_flight,
                    "healthy": b.healthy,
                    "failures": b.failures,
                    "engine": engine_state(b, now),
                }
                for b in self.placement.backends
            ],
            "recent_dispatches": [d.view(now) for d in self.recent],
            "served_recent": {"window_s": SERVED_WINDOW_S, "shares": self._served(now)},
            "provider_feedback": self.throttle.state(self.clock(), self.scheduler.rate),
            "calibration": self._calibration_state(),
        }

    def _weight(self, flow: str) -> float | None:
        """The flow's configured weight; None for a class a reload removed."""
        org, cls = org_and_class(flow)
        return self.config.flow_weight(org, cls) if cls in self.config.classes else None

    def _served(self, now: float) -> dict[str, float]:
        """Each flow's share of the cost this process dispatched in the last
        ``SERVED_WINDOW_S`` (at most the last ``RECENT_DISPATCHES`` dispatches)."""
        served: dict[str, float] = {}
        for dispatch in reversed(self.recent):
            if now - dispatch.at > SERVED_WINDOW_S:
                break
            served[dispatch.flow] = served.get(dispatch.flow, 0.0) + dispatch.cost
        total = sum(served.values())
        return {flow: cost / total for flow, cost in sorted(served.items())}

    def _calibration_state(self) -> dict[str, Any]:
        """What calibration learned of this pool; the input model as its estimates use it,
        from this pool's configured one."""
        if self.calibration is None:
            return {}
        spec = self.cost.spec
        prior = {self.name: InputModel(spec.tokens_per_message, spec.chars_per_token)}
        learned: dict[str, Any] = self.calibration.snapshot(prior).get(self.name, {})
        return learned

    def _run(self, tickets: list[Ticket]) -> None:
        """Carry out the scheduler's decisions: wake the dispatched, and come back when the
        pool's rate will allow the next dispatch."""
        self._start(tickets)
        wake_at = self.scheduler.wake_at
        if wake_at is not None and self._timer is None:
            delay = max(0.0, wake_at - self.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.pump()

    def _start(self, tickets: list[Ticket]) -> None:
        """Wake the requests that were just dispatched."""
        for ticket in tickets:
            assert ticket.backend is not None
            self.recent.append(Dispatch.of(ticket, ticket.backend.name, self.clock()))
            self.memory.leave(self._line(ticket), ticket)  # it waits no more
            future = ticket.payload
            if future.done():  # cancelled in the instant it was dispatched: give the slot back
                self.release(ticket)
            else:
                future.set_result(ticket.backend)


def shutting_down(pool: str) -> ApiError:
    """What a request still waiting when the drain begins is answered (and one that comes
    during the drain)."""
    return ApiError(
        503, f"This proxy is shutting down; retry the request for pool '{pool}'.",
        code="shutting_down", retry_after=1.0,
    )  # fmt: skip
