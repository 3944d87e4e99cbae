"""The queue a ``Scheduler`` orders its flows with, and the baseline policies behind it.

``DispatchQueue`` is the one interface the scheduler takes. Start-time Fair Queueing is
``FairQueue`` itself (the proxy's default); the baselines the [FAIR-GPU] article measures it
against implement the same interface here, so the scenario lab runs each of them through
the proxy's own scheduler: a global FIFO, strict priority by class, round robin by request
count, and Deficit Round Robin. No I/O, no clock; everything is deterministic.

What every implementation guarantees (``tests/core/test_queues.py`` checks it over all five):

* each flow is a FIFO (``front`` puts a retry at its flow's head), unless ``FairQueue`` is
  given size buckets (``max_overtaken``: docs/design.md §3), which the baselines ignore;
  nothing is lost or duplicated; ``remove`` takes a queued item out uncharged;
* ``pop`` returns exactly what ``peek`` said, and ``peek`` changes nothing observable;
* an ineligible flow is never popped and keeps its queue and its place;
* a cost outside (0, MAX_COST] or a weight outside [MIN_WEIGHT, MAX_WEIGHT] raises
  ValueError before anything changes, as ``FairQueue`` does;
* the same operations give the same order.

For the baselines, ``meter(flow)`` is the flow's *normalised service*: the sum of
``cost / weight`` of its dispatches since the queue was last empty. It orders nothing (only
SFQ orders by it); it is there so ``/admin/state`` and the metrics read the same for every
policy. ``virtual_time`` is the largest meter a dispatch started from (SFQ's definition,
``v`` = start tag of the last dispatch, made monotone). Weights order only DRR (its
quantum is ``quantum × weight``); FIFO, strict priority and round robin accept
``set_weight`` and the ``weight`` of ``push`` for the meters alone.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from .fair_queue import FairQueue, FlowView, check_cost, check_weight

__all__ = [
    "DEFAULT_PRIORITY_ORDER",
    "QUEUE_NAMES",
    "DispatchQueue",
    "Drr",
    "Fifo",
    "RoundRobin",
    "StrictPriority",
    "make_queue",
]

T = TypeVar("T")


class DispatchQueue(Protocol[T]):
    """Flows of queued items with costs; which flow goes next is the implementation's rule."""

    def push(
        self,
        flow: str,
        item: T,
        cost: float,
        weight: float = 1.0,
        *,
        front: bool = False,
        bucket: int = 0,
        max_overtaken: int | None = None,
    ) -> None:
        """Queue ``item`` in ``flow`` (at its head if ``front``); ``weight`` becomes the flow's.
        ``bucket`` and ``max_overtaken``: the flow's size buckets, for a queue that has them."""
        ...

    def peek(self) -> tuple[str, T] | None:
        """What ``pop`` would return now, changing nothing that can be observed."""
        ...

    def pop(self) -> tuple[str, T] | None:
        """Dispatch the next item of an eligible flow (charging it), or None."""
        ...

    def remove(self, flow: str, item: T) -> bool:
        """Take a queued ``item`` out, uncharged; False if it was not queued."""
        ...

    def settle(self, flow: str, cost: float, actual: float | None = None) -> None:
        """A dispatched item of ``flow`` (of ``cost``) ended, having cost ``actual`` (None:
        unknown). Each ``pop`` is settled once."""
        ...

    def set_weight(self, flow: str, weight: float) -> None: ...

    def set_eligible(self, flow: str, ok: bool) -> None:
        """Skip ``flow`` in selection while not ``ok``; its queue (and place) stay."""
        ...

    def is_eligible(self, flow: str) -> bool: ...

    def backlog(self, flow: str) -> int: ...

    def meter(self, flow: str) -> float: ...

    def flows(self) -> list[FlowView]:
        """Every tracked flow, in flow-id order."""
        ...

    @property
    def virtual_time(self) -> float: ...

    def __len__(self) -> int: ...


@dataclass(slots=True)
class _Flow(Generic[T]):
    weight: float = 1.0
    queue: deque[tuple[T, float, int]] = field(default_factory=deque)  # (item, cost, seq)
    served: float = 0.0  # Σ cost / weight of its dispatches: the meter


class _Baseline(Generic[T]):
    """Bookkeeping shared by the baselines; a subclass says which flow goes next."""

    name = "baseline"

    def __init__(self) -> None:
        self._flows: dict[str, _Flow[T]] = {}
        self._ineligible: set[str] = set()
        self._queued = 0
        self._seq = 0  # arrival order over all flows
        self._front_seq = 0  # a retry pushed to the front sorts before every arrival
        self._v = 0.0

    # -- the operations ---------------------------------------------------------------------

    def push(
        self,
        flow: str,
        item: T,
        cost: float,
        weight: float = 1.0,
        *,
        front: bool = False,
        bucket: int = 0,  # size buckets: a baseline keeps every flow a FIFO
        max_overtaken: int | None = None,
    ) -> None:
        check_cost(cost)
        check_weight(weight)
        state = self._flows.get(flow)
        if state is None:
            state = self._flows[flow] = _Flow()
        state.weight = weight
        if front:
            self._front_seq -= 1
            state.queue.appendleft((item, cost, self._front_seq))
        else:
            self._seq += 1
            state.queue.append((item, cost, self._seq))
        self._queued += 1
        if len(state.queue) == 1:
            self._joined(flow)

    def peek(self) -> tuple[str, T] | None:
        flow = self._select()
        return None if flow is None else (flow, self._flows[flow].queue[0][0])

    def pop(self) -> tuple[str, T] | None:
        flow = self._select()
        if flow is None:
            return None
        state = self._flows[flow]
        item, cost, _ = state.queue.popleft()
        self._queued -= 1
        self._v = max(self._v, state.served)
        state.served += cost / state.weight
        self._served(flow, cost)
        if not state.queue:
            self._left(flow)
            self._after_drain()
        return flow, item

    def remove(self, flow: str, item: T) -> bool:
        state = self._flows.get(flow)
        if state is None:
            return False
        for index, (queued, _, _) in enumerate(state.queue):
            if queued is item or queued == item:
                del state.queue[index]
                break
        else:
            return False
        self._queued -= 1
        if not state.queue:
            self._left(flow)
            self._after_drain()
        return True

    def settle(self, flow: str, cost: float, actual: float | None = None) -> None:
        """A baseline orders by its own rule, never by meters: the true-up only makes the
        meter shown the flow's actual service (while the flow is known)."""
        check_cost(cost)
        state = self._flows.get(flow)
        if state is not None and actual is not None:
            state.served += (actual - cost) / state.weight

    def set_weight(self, flow: str, weight: float) -> None:
        check_weight(weight)
        state = self._flows.get(flow)
        if state is not None:
            state.weight = weight

    def set_eligible(self, flow: str, ok: bool) -> None:
        if ok:
            self._ineligible.discard(flow)
        else:
            self._ineligible.add(flow)

    # -- what can be read -------------------------------------------------------------------

    def is_eligible(self, flow: str) -> bool:
        return flow not in self._ineligible

    def backlog(self, flow: str) -> int:
        state = self._flows.get(flow)
        return 0 if state is None else len(state.queue)

    def meter(self, flow: str) -> float:
        state = self._flows.get(flow)
        return 0.0 if state is None else state.served

    @property
    def virtual_time(self) -> float:
        return self._v

    def flows(self) -> list[FlowView]:
        return [
            FlowView(
                flow=name,
                meter=state.served,
                lag=state.served - self._v,
                backlog=len(state.queue),
                eligible=name not in self._ineligible,
            )
            for name, state in sorted(self._flows.items())
        ]

    def __len__(self) -> int:
        return self._queued

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {len(self._flows)} flows, {self._queued} queued>"

    # -- what a policy decides --------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """The backlogged, eligible flows, in flow-id order."""
        return sorted(
            name
            for name, state in self._flows.items()
            if state.queue and name not in self._ineligible
        )

    def _select(self) -> str | None:
        """The flow whose head goes next; must change nothing."""
        raise NotImplementedError

    def _joined(self, flow: str) -> None:
        """``flow`` just became backlogged."""

    def _served(self, flow: str, cost: float) -> None:
        """``flow``'s head (of ``cost``) was just dispatched."""

    def _left(self, flow: str) -> None:
        """``flow`` just emptied (dispatched or removed)."""

    def _after_drain(self) -> None:
        """Nothing waits anywhere: forget the meters, as SFQ does after a global idle."""
        if not self._queued:
            self._flows.clear()


class Fifo(_Baseline[T]):
    """One line in arrival order across all flows: whoever came first is served first.

    An ineligible flow's requests are skipped (the next eligible one goes); a retry pushed
    with ``front`` goes before every request queued so far.
    """

    name = "fifo"

    def _select(self) -> str | None:
        best: tuple[int, str] | None = None
        for flow in self._candidates():
            key = (self._flows[flow].queue[0][2], flow)
            if best is None or key < best:
                best = key
        return None if best is None else best[1]


DEFAULT_PRIORITY_ORDER = ("system", "interactive", "batch")


def class_of(flow: str) -> str:
    """The class of a scheduler flow ``org/class`` (the whole name when it has no ``/``)."""
    return flow.rpartition("/")[2]


class StrictPriority(_Baseline[T]):
    """The highest class with an eligible request first (``order`` lists classes highest
    first; unlisted classes come last, together), FIFO by arrival within a class."""

    name = "priority"

    def __init__(
        self,
        order: Sequence[str] = DEFAULT_PRIORITY_ORDER,
        *,
        class_of: Callable[[str], str] = class_of,
    ) -> None:
        super().__init__()
        self._rank = {cls: i for i, cls in enumerate(order)}
        self._class_of = class_of

    def _select(self) -> str | None:
        best: tuple[int, int, str] | None = None
        unlisted = len(self._rank)
        for flow in self._candidates():
            rank = self._rank.get(self._class_of(flow), unlisted)
            key = (rank, self._flows[flow].queue[0][2], flow)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]


class _Ring(_Baseline[T]):
    """Backlogged flows in a ring, in the order they became backlogged; ``_cursor`` is the
    flow whose turn it is. A newly backlogged flow joins at the end of the round (just
    before the cursor); an ineligible flow is passed over and keeps its place."""

    def __init__(self) -> None:
        super().__init__()
        self._ring: list[str] = []
        self._cursor = 0
        self._credited = False  # the flow at the cursor already had its turn's credit

    def _joined(self, flow: str) -> None:
        self._ring.insert(self._cursor, flow)
        if len(self._ring) > 1:
            self._cursor += 1

    def _left(self, flow: str) -> None:
        index = self._ring.index(flow)
        del self._ring[index]
        if index < self._cursor:
            self._cursor -= 1
        elif index == self._cursor:
            self._credited = False
        if self._cursor >= len(self._ring):
            self._cursor = 0

    def _turns(self) -> list[tuple[int, str]]:
        """(offset from the cursor, flow) of the eligible backlogged flows, in turn order."""
        n = len(self._ring)
        out = []
        for offset in range(n):
            flow = self._ring[(self._cursor + offset) % n]
            if flow not in self._ineligible:
                out.append((offset, flow))
        return out


class RoundRobin(_Ring[T]):
    """One request per backlogged flow in turn, whatever it costs."""

    name = "rr"

    def _select(self) -> str | None:
        turns = self._turns()
        return turns[0][1] if turns else None

    def _served(self, flow: str, cost: float) -> None:
        # the next turn is the flow after this one (if it empties, _left keeps the index)
        index = self._ring.index(flow)
        self._cursor = index
        if self._flows[flow].queue:
            self._cursor = (index + 1) % len(self._ring)


class Drr(_Ring[T]):
    """Deficit Round Robin (Shreedhar & Varghese): each turn credits ``quantum × weight``;
    a flow sends heads while its credit covers them, then the turn passes; a flow that
    empties loses its credit. Ineligible flows are passed over uncredited.

    ``pop`` jumps straight to the outcome of however many rounds the loop of the paper
    would take, so a small quantum costs no time.
    """

    name = "drr"

    def __init__(self, quantum: float) -> None:
        if not (isinstance(quantum, int | float) and 0 < quantum < math.inf):
            raise ValueError("quantum must be a positive finite number")
        super().__init__()
        self._quantum = float(quantum)
        self._deficit: dict[str, float] = {}

    def _credits(self, flow: str, offset: int) -> int:
        """Credits ``flow`` needs before its head goes, counting this turn's if not yet had."""
        state = self._flows[flow]
        credit = self._quantum * state.weight
        deficit = self._deficit.get(flow, 0.0)
        cost = state.queue[0][1]
        had_credit = offset == 0 and self._credited
        if had_credit and deficit >= cost:
            return 0
        k = max(1, math.ceil((cost - deficit) / credit))
        while deficit + k * credit < cost:  # float rounding
            k += 1
        return k

    def _plan(self) -> tuple[str, int, int] | None:
        """(flow, its credits, position in visits from now) of the next dispatch."""
        n = len(self._ring)
        best: tuple[int, str, int] | None = None
        for offset, flow in self._turns():
            k = self._credits(flow, offset)
            # a flow that had this turn's credit gets its next one at its next turn
            position = k * n if offset == 0 and self._credited else (k - 1) * n + offset
            if best is None or position < best[0]:
                best = (position, flow, k)
        return None if best is None else (best[1], best[2], best[0])

    def _select(self) -> str | None:
        plan = self._plan()
        return None if plan is None else plan[0]

    def _served(self, flow: str, cost: float) -> None:
        plan = self._plan_before_pop
        assert plan is not None
        assert plan[0] == flow
        _, k, position = plan
        n = len(self._ring)
        for offset, other in self._turns():
            if other == flow:
                continue
            visits = 0 if position <= offset else -(-(position - offset) // n)
            if offset == 0 and self._credited and visits:
                visits -= 1  # this turn's credit was already given
            self._deficit[other] = self._deficit.get(other, 0.0) + visits * self._quantum * (
                self._flows[other].weight
            )
        credit = self._quantum * self._flows[flow].weight
        self._deficit[flow] = self._deficit.get(flow, 0.0) + k * credit - cost
        self._cursor = self._ring.index(flow)
        self._credited = True

    def pop(self) -> tuple[str, T] | None:
        self._plan_before_pop = self._plan()
        try:
            return super().pop()
        finally:
            self._plan_before_pop = None

    _plan_before_pop: tuple[str, int, int] | None = None

    def _left(self, flow: str) -> None:
        self._deficit.pop(flow, None)
        super()._left(flow)


QUEUE_NAMES = ("fifo", "priority", "rr", "drr", "sfq")


def make_queue(
    name: str,
    *,
    quantum: float = 1.0,
    priority_order: Sequence[str] = DEFAULT_PRIORITY_ORDER,
) -> DispatchQueue[T]:
    """A fresh, empty queue of policy ``name`` (one of ``QUEUE_NAMES``)."""
    if name == "fifo":
        return Fifo()
    if name == "priority":
        return StrictPriority(priority_order)
    if name == "rr":
        return RoundRobin()
    if name == "drr":
        return Drr(quantum)
    if name == "sfq":
        return FairQueue()
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(QUEUE_NAMES)}")
