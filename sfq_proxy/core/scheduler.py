"""One pool's dispatch decisions: strict band, then SFQ, then placement. No I/O, no clock.

Like httpcore's connection pool, it only changes state and *returns* what to do (which
tickets go to which backends); the async shell in ``state/pool.py`` carries it out,
and passes the time in. The scenario lab's simulator drives this same class in virtual time
(``lab/simulator.py``), with any of the ordering policies of ``queues.py`` as its queue.

Three limits act here and are never mixed up: the fair queue sets each flow's *share*,
``max_in_flight`` caps an org's or a class's *concurrency* (a capped flow is made
ineligible and keeps its place), and a provider pool's token buckets pace the *rate*, which
the provider's own feedback (``throttle.py``) may pause or slow.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .fair_queue import MAX_COST, FairQueue, check_actual, check_cost, check_size, check_weight
from .flows import flow_id, org_and_class
from .limits import Rate
from .placement import Backend, Placement, Reason
from .queues import DispatchQueue
from .throttle import Throttle

NO_CAP = 1 << 62


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place in line. ``payload`` is whatever the shell needs to resume it.

    Its numbers are checked when it is made (ValueError), so a ticket that exists can be
    queued, charged and paced without any operation failing half-way.
    """

    org: str
    cls: str
    cost: float
    weight: float = 1.0
    tokens: float = 0.0  # estimated tokens, for a provider pool's tokens-per-minute pacing
    priority: bool = False  # in the strict band: FIFO before every SFQ flow, never charged
    # its class's size buckets (docs/design.md §3): its bucket (``size_bucket`` of its cost)
    # and how often it may be overtaken inside its flow; None: the flow is a FIFO
    bucket: int = 0
    max_overtaken: int | None = None
    payload: Any = None
    backend: Backend | None = field(default=None, repr=False)
    dispatches: int = 0  # how many times it was sent (a retry is sent again, charged again)
    # where it would rather go: its affinity key (a digest, never text of the request), and
    # why its last dispatch went where it did (docs/design.md §5, Affinity)
    affinity: str | None = None
    placed: Reason = "fallback"
    # at its last dispatch from the fair queue: its flow's meter (its start tag) and the
    # virtual time just before; None in the strict band, which is never charged. Read, not
    # used: /admin/state shows them so the order can be explained from the meters alone.
    start_tag: float | None = None
    virtual_time: float | None = None
    # the bytes of its body the process holds while it waits: what it costs the process's
    # queue memory besides a request's fixed part (``queue_memory.py``)
    size: int = 0
    # when it last joined a line, on the pool's clock: read, not used, so that the admin
    # page's history can tell how long each dispatch waited (``observability/history.py``)
    queued_at: float = 0.0
    # the flow's name in the fair queue; its order breaks ties between equal meters
    flow: str = field(init=False)

    def __post_init__(self) -> None:
        check_cost(self.cost)
        check_weight(self.weight)
        tokens = self.tokens
        if isinstance(tokens, bool) or not (0 <= tokens <= MAX_COST):  # NaN fails too
            raise ValueError(f"tokens must be a number in [0, {MAX_COST:g}], got {tokens!r}")
        if self.max_overtaken is not None:
            check_size(self.bucket, self.max_overtaken)
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be a non-negative integer, got {self.size!r}")
        self.flow = flow_id(self.org, self.cls)


class Scheduler:
    """Dispatch one request at a time while a healthy backend has a free slot.

    The next request is the oldest of the strict band whose class is under its cap, else
    the fairest eligible flow's next one (its head, or as its size buckets say). It waits
    for a slot (or for the pool's rate) rather than letting another overtake it: the order
    is always the one the meters explain.
    """

    def __init__(
        self,
        placement: Placement,
        *,
        org_caps: Mapping[str, int] | None = None,
        class_caps: Mapping[str, int] | None = None,
        rate: Rate | None = None,
        queue: DispatchQueue[Ticket] | None = None,
        throttle: Throttle | None = None,
    ) -> None:
        """``queue`` orders the flows: the proxy's ``FairQueue`` (SFQ) unless another
        implementation of ``DispatchQueue`` is given (the lab's baselines). ``throttle``
        (a provider's own 429s and rate-limit headers) may hold every dispatch back."""
        self.placement = placement
        self.queue: DispatchQueue[Ticket] = FairQueue() if queue is None else queue
        self.band: deque[Ticket] = deque()
        self.running = 0
        self.wake_at: float | None = None  # when the rate allows the next dispatch
        self._rate = rate
        self.throttle = throttle
        self._org_caps = dict(org_caps or {})
        self._class_caps = dict(class_caps or {})
        self.flow_running: Counter[str] = Counter()  # dispatched and not finished, per flow
        self._org_running: Counter[str] = Counter()
        self._class_running: Counter[str] = Counter()
        # ("org" | "class", name) of each cap → the flows it applies to that may be queued
        self._capped_flows: dict[tuple[str, str], set[str]] = {}
        # engine dispatch (docs/design.md §5): each class's engine ceiling, and placement
        # asks the backends' gates; None: static slots alone, at no cost per request
        self.ceilings: Mapping[str, float] | None = None

    def set_limits(
        self, org_caps: Mapping[str, int], class_caps: Mapping[str, int], rate: Rate | None
    ) -> None:
        """A config reload: new caps and rate; queued flows keep their meters and places."""
        self._org_caps, self._class_caps = dict(org_caps), dict(class_caps)
        self._rate = rate
        self._capped_flows.clear()
        for view in self.queue.flows():
            org, cls = org_and_class(view.flow)
            for cap in self._caps_of(Ticket(org=org, cls=cls, cost=1.0)):
                self._capped_flows.setdefault(cap, set()).add(view.flow)
            self.queue.set_eligible(view.flow, self._under_caps(org, cls))

    @property
    def rate(self) -> Rate | None:
        """The provider pool's pacing buckets, if its rate is set."""
        return self._rate

    def submit(self, ticket: Ticket, now: float, *, front: bool = False) -> list[Ticket]:
        """Queue ``ticket`` (at its flow's head if ``front``); returns what got dispatched."""
        if ticket.priority:  # the band is a FIFO: size buckets order fair-queued flows only
            (self.band.appendleft if front else self.band.append)(ticket)
        elif ticket.max_overtaken is None:
            self.queue.push(ticket.flow, ticket, ticket.cost, ticket.weight, front=front)
            self._track(ticket)
        else:
            self.queue.push(
                ticket.flow, ticket, ticket.cost, ticket.weight, front=front,
                bucket=ticket.bucket, max_overtaken=ticket.max_overtaken,
            )  # fmt: skip
            self._track(ticket)
        return self._dispatch(now)

    def cancel(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out, uncharged; False if it was not queued."""
        if not ticket.priority:
            return self.queue.remove(ticket.flow, ticket)
        if ticket in self.band:
            self.band.remove(ticket)
            return True
        return False

    def finish(self, ticket: Ticket, now: float, actual: float | None = None) -> list[Ticket]:
        """A dispatched ticket is done (or failed): free its slot, true its flow's charge up
        to the ``actual`` cost the backend reported (None: the estimate stands), and
        dispatch more."""
        backend = ticket.backend
        if backend is None:
            raise RuntimeError("finish() of a ticket that holds no slot")
        if actual is not None:  # before anything changes
            check_actual(actual)
        ticket.backend = None
        self.placement.release(backend)
        if backend.gate is not None:
            backend.gate.completed(now)
        self.running -= 1
        self.flow_running[ticket.flow] -= 1
        if not self.flow_running[ticket.flow]:
            del self.flow_running[ticket.flow]
        self._org_running[ticket.org] -= 1
        self._class_running[ticket.cls] -= 1
        self._refresh(ticket)
        if not ticket.priority:  # after its caps: a flow they release rejoins at max(S, v)
            self.queue.settle(ticket.flow, ticket.cost, actual)  # and its refund still counts
        return self._dispatch(now)

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch what capacity allows now (a backend came back, the rate refilled)."""
        return self._dispatch(now)

    def refund(self, tokens: float, now: float) -> None:
        """Give back the pacing tokens of a dispatch the upstream refused without generating."""
        if self._rate is not None:
            self._rate.give_back(tokens, now)

    def queued(self) -> int:
        return len(self.queue) + len(self.band)

    def waiting(self, ticket: Ticket) -> int:
        """How many requests wait ahead of ``ticket`` in its own line (its flow, or its
        class in the band): what ``max_queue_len`` caps."""
        if ticket.priority:
            return sum(t.cls == ticket.cls for t in self.band)
        return self.queue.backlog(ticket.flow)

    def _dispatch(self, now: float) -> list[Ticket]:
        """Dispatch while a ticket and a slot are there: each one is decided (what, where,
        whether the rate allows it) before any state changes, so nothing raises half-way."""
        self.wake_at = None
        dispatched = []
        while (ticket := self._band_next() or _item(self.queue.peek())) is not None:
            if self.ceilings is None:
                placed = self.placement.place(ticket.affinity)
            else:
                ceiling = self.ceilings.get(ticket.cls, 1.0)
                placed = self.placement.place_gated(ticket.affinity, now, ceiling)
            if placed is None:
                break
            backend, reason = placed
            wait = self._rate.wait(ticket.tokens, now) if self._rate is not None else 0.0
            if self.throttle is not None:
                wait = max(wait, self.throttle.wait(now))
            if wait > 0:
                self.wake_at = now + wait
                break
            self.placement.acquire(backend)  # the one step that checks: it goes first
            if backend.gate is not None:
                backend.gate.dispatched(now)
            if self._rate is not None:
                self._rate.take(ticket.tokens, now)
            if self.throttle is not None:
                self.throttle.dispatched(ticket.tokens, now, self._rate)
            if ticket.priority:
                self.band.remove(ticket)
            else:
                ticket.start_tag = self.queue.meter(ticket.flow)
                ticket.virtual_time = self.queue.virtual_time
                self.queue.pop()
            ticket.backend, ticket.placed = backend, reason
            ticket.dispatches += 1
            self.running += 1
            self.flow_running[ticket.flow] += 1
            self._org_running[ticket.org] += 1
            self._class_running[ticket.cls] += 1
            self._refresh(ticket)
            dispatched.append(ticket)
        return dispatched

    def _band_next(self) -> Ticket | None:
        """The oldest band ticket whose class is under its cap."""
        for ticket in self.band:
            if self._class_running[ticket.cls] < self._class_caps.get(ticket.cls, NO_CAP):
                return ticket
        return None

    def _track(self, ticket: Ticket) -> None:
        """Remember a capped org's or class's flow, and skip it now if it is at its cap."""
        for cap in self._caps_of(ticket):
            self._capped_flows.setdefault(cap, set()).add(ticket.flow)
        if not self._under_caps(ticket.org, ticket.cls):
            self.queue.set_eligible(ticket.flow, False)

    def _refresh(self, ticket: Ticket) -> None:
        """After ``ticket``'s org or class gained or lost a running request."""
        for cap in self._caps_of(ticket):
            flows = self._capped_flows.get(cap, set())
            for flow in list(flows):
                org, cls = org_and_class(flow)
                self.queue.set_eligible(flow, self._under_caps(org, cls))
                if not self.queue.backlog(flow) and self.queue.is_eligible(flow):
                    flows.discard(flow)  # re-tracked when it queues again

    def _caps_of(self, ticket: Ticket) -> list[tuple[str, str]]:
        caps = [("org", ticket.org)] if ticket.org in self._org_caps else []
        return caps + ([("class", ticket.cls)] if ticket.cls in self._class_caps else [])

    def _under_caps(self, org: str, cls: str) -> bool:
        org_ok = self._org_running[org] < self._org_caps.get(org, NO_CAP)
        return org_ok and self._class_running[cls] < self._class_caps.get(cls, NO_CAP)


def _item(peeked: tuple[str, Ticket] | None) -> Ticket | None:
    return None if peeked is None else peeked[1]
