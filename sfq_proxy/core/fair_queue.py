"""Start-time Fair Queueing: the ordering core, with no I/O, no clock and no asyncio.

Everything that decides *which flow goes next* lives here and nowhere else (docs/design.md §3).
The caller owns time and sockets: it pushes requests as they arrive, pops one whenever a
backend slot is free, and tells the queue when a flow hits or leaves its in-flight cap.

Rules, from Goyal, Vin & Cheng (SIGCOMM 1996) as restated for LLM load balancers:

1. Arrival to an empty (or new) flow joins at ``S = max(S, v)``: no credit is banked while
   idle, and what a flow over-took just before leaving is remembered.
2. Dispatch picks the eligible backlogged flow with the smallest meter ``S`` (ties by flow
   id), sets ``v = max(v, S)`` and charges ``S += cost / weight``: the estimate, since the
   work is not known yet.
3. When the request ends, the charge is trued up to the work the backend reports,
   ``S += (actual − cost) / weight``, a debt and a refund alike. A refund may leave a
   waiting flow's ``S`` below ``v``: it goes first until it has caught up what it was
   overcharged (``v`` never goes back). An idle flow banks nothing: it rejoins at
   ``max(S, v)`` (rule 1). Without a report the estimate stands.
4. When nothing waits and nothing runs, ``v`` becomes the highest ``S`` of the busy period
   (a refund after it does not lower it; every flow rejoins at ``v`` then, so only the
   level moves): the next busy period starts level. A request in service belongs to the
   busy period: what it was charged (and may still owe) is not forgotten while it runs.

Inside a flow, requests leave in arrival order, unless the flow has **size buckets**
(docs/design.md §3, Size buckets inside a flow): then the next request of the flow is the
oldest of its smallest non-empty bucket, unless the flow's oldest request has already been
overtaken ``max_overtaken`` times, in which case the oldest goes. Which flow goes next, and
what it is charged (the cost of the request actually dispatched), do not change.

Meters are kept as integers in fixed-point units of ``1 / UNITS_PER_COST`` of a cost unit.
Integer arithmetic makes ties exact, makes the order independent of float rounding, and
makes renormalisation (subtracting ``v`` from everything) change no future decision.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Generic, TypeVar

from ..config import MAX_OVERTAKEN, MAX_SIZE_BUCKETS

__all__ = [
    "DUE",
    "MAX_COST",
    "MAX_WEIGHT",
    "MIN_WEIGHT",
    "UNITS_PER_COST",
    "UNSIZED",
    "FairQueue",
    "FlowView",
    "check_actual",
    "check_cost",
    "check_size",
    "check_weight",
]

T = TypeVar("T")

UNITS_PER_COST = 1 << 20
"""Fixed-point resolution of meters: a charge is rounded to about a millionth of a token."""

MAX_COST = 1e15
"""The largest cost one item may have. With weights within [MIN_WEIGHT, MAX_WEIGHT] every
charge is a finite number of units, so no operation can overflow half-way through."""
MIN_WEIGHT = 1e-9
MAX_WEIGHT = 1e9

_RENORMALIZE_AT = 1 << 60
"""Internal virtual time above which meters are shifted down, to stay in machine-size ints."""

UNSIZED = 1 << 30
"""The bucket of a request queued without size buckets into a flow that has some (a reload
turned them on or off): after every bucket, so it never overtakes; it may be overtaken."""
DUE = 1 << 30
"""The overtaken count of a request put back at its flow's head (a retry) while the flow has
size buckets: above any ``max_overtaken``, so it is its flow's next request, as without."""


@dataclass(slots=True)
class _Lanes:
    """A flow's size buckets: present from its first push with ``max_overtaken`` until its
    queue is empty. ``marks`` runs alongside the flow's queue, entry for entry."""

    max_overtaken: int  # of the flow's latest push with size buckets
    sizes: dict[int, int] = field(default_factory=dict)  # bucket → queued (UNSIZED not counted)
    marks: deque[list[int]] = field(default_factory=deque)  # [bucket, times overtaken]


class _Flow(Generic[T]):
    """A flow's meter, queue and place in the heap. Not a dataclass: mypyc cannot compile
    a generic one (bench/compiled_core.py)."""

    __slots__ = ("entry", "lanes", "meter", "queue", "running", "weight")

    def __init__(self, meter: int) -> None:
        self.meter = meter
        self.running = 0  # dispatched and not settled: the flow is kept until they are
        self.weight = 1.0  # the flow's weight when it is next charged
        self.queue: deque[tuple[T, float]] = deque()  # (item, cost)
        self.entry = -1  # sequence number of this flow's live heap entry; -1 when it has none
        self.lanes: _Lanes | None = None  # None: the flow is a FIFO (no size buckets)


@dataclass(frozen=True, slots=True)
class FlowView:
    """What ``/admin/state`` and the metrics show of one flow."""

    flow: str
    meter: float
    lag: float  # meter - virtual time; negative for a flow idle below the baseline
    backlog: int
    eligible: bool


class FairQueue(Generic[T]):
    """SFQ over string-named flows, each a FIFO of opaque items with a positive cost (or,
    given size buckets, a line that lets smaller items overtake, boundedly).

    Every operation checks its arguments before it changes anything, so one that raises
    leaves the queue exactly as it was.

    ``renormalize_at`` exists so tests can force renormalisation often and show that it
    never changes the dispatch order; production code leaves it at its default.
    """

    def __init__(self, *, renormalize_at: int | None = _RENORMALIZE_AT) -> None:
        self._flows: dict[str, _Flow[T]] = {}
        self._ineligible: set[str] = set()
        self._heap: list[tuple[int, str, int]] = []  # (meter, flow, entry seq); lazily pruned
        self._seq = 0
        self._v = 0
        self._max_meter = 0
        self._offset = 0  # what renormalisation subtracted so far; the outside never sees it
        self._queued = 0
        self._running = 0  # dispatched and not settled, over every flow
        self._renormalize_at = renormalize_at

    # -- the operations -------------------------------------------------------------------

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
        """Queue ``item`` in ``flow`` with its ``cost``; ``weight`` becomes the flow's weight.

        The charge ``cost / weight`` is made at dispatch, at the flow's weight then (see
        ``set_weight``); a cost, once queued, never changes.

        ``front`` puts it at the head of its flow (a retry, which is its flow's oldest
        request); it still waits for its flow's turn by meter like any other.

        ``max_overtaken`` (None: the flow is a FIFO) gives the flow size buckets, with
        ``bucket`` this request's (``size_bucket`` of its cost): the flow's next request is
        then the oldest of its smallest non-empty bucket, unless its oldest request was
        overtaken ``max_overtaken`` times already (docs/design.md §3, Size buckets). It
        becomes the flow's ``max_overtaken``, as ``weight`` its weight. A retry (``front``)
        with buckets is due at once: it is its flow's next request, as without.
        """
        check_cost(cost)
        check_weight(weight)
        if max_overtaken is not None:
            check_size(bucket, max_overtaken)
        state = self._flows.get(flow)
        if state is None:
            state = self._flows[flow] = _Flow(self._v)
        if not state.queue:
            state.meter = max(state.meter, self._v)
        state.weight = weight
        if max_overtaken is not None or state.lanes is not None:
            _mark(state, front, bucket, max_overtaken)
        if front:
            state.queue.appendleft((item, cost))
        else:
            state.queue.append((item, cost))
        self._queued += 1
        if state.entry < 0 and flow not in self._ineligible:
            self._enter(flow, state)

    def peek(self) -> tuple[str, T] | None:
        """What ``pop`` would return now, changing nothing that can be observed."""
        head = self._head()
        if head is None:
            return None
        state = head[1]
        return head[0], state.queue[0 if state.lanes is None else _pick(state.lanes)][0]

    def pop(self) -> tuple[str, T] | None:
        """Dispatch the next item (its head, or as its size buckets say) of the eligible flow
        with the smallest meter, charging the flow that item's cost now."""
        head = self._head()
        if head is None:
            return None
        flow, state = head
        heap = self._heap
        lanes = state.lanes
        # nothing below can raise (bounded inputs: the charge is finite), so taking it first
        # changes nothing half-way
        item, cost = state.queue.popleft() if lanes is None else _take(state.queue, lanes)
        self._v = max(self._v, state.meter)  # a refunded flow may start below v
        state.meter += _units(cost, state.weight)
        self._max_meter = max(self._max_meter, state.meter)
        self._queued -= 1
        state.running += 1
        self._running += 1
        if state.queue:
            self._seq += 1
            state.entry = self._seq
            heapq.heapreplace(heap, (state.meter, flow, self._seq))
        else:  # it runs: the busy period goes on until it is settled
            state.entry = -1
            state.lanes = None
            heapq.heappop(heap)
        if self._renormalize_at is not None and self._v >= self._renormalize_at:
            self._renormalize()
        return flow, item

    def remove(self, flow: str, item: T) -> bool:
        """Cancel a queued ``item`` (the first equal to it): it leaves uncharged."""
        state = self._flows.get(flow)
        if state is None:
            return False
        for index, (queued, _) in enumerate(state.queue):
            if queued is item or queued == item:
                del state.queue[index]
                if state.lanes is not None:
                    _unmark(state.lanes, index)
                break
        else:
            return False
        self._queued -= 1
        if not state.queue:
            state.entry = -1
            state.lanes = None
            self._after_drain()
        return True

    def settle(self, flow: str, cost: float, actual: float | None = None) -> None:
        """A request of ``flow`` dispatched with ``cost`` has ended: true its charge up to the
        ``actual`` cost the backend reported (None: unknown, the estimate stands).

        ``S += (actual − cost) / weight`` at the flow's weight now, a debt and a refund alike:
        a flow escapes nothing its requests really did, and an honest one that asked for far
        more than it got is not held back for it. A refund can take a waiting flow's meter
        below ``v``, so that it catches up; an idle flow's is lifted to ``v`` when it comes
        back (``push``), so no credit is banked. Raises ValueError, changing nothing, for a
        flow with nothing running or an ``actual`` outside [0, MAX_COST].
        """
        if not (cost.__class__ is float and 0.0 < cost <= MAX_COST):  # the fast path's check
            check_cost(cost)
        if actual is not None:
            check_actual(actual)
        state = self._flows.get(flow)
        if state is None or not state.running:
            raise ValueError(f"settle() of flow {flow!r}, which has nothing running")
        if actual is not None:
            owed = round(actual * UNITS_PER_COST / state.weight) - _units(cost, state.weight)
            meter = state.meter + owed
            if meter != state.meter:
                state.meter = meter
                self._max_meter = max(self._max_meter, meter)
                if state.entry >= 0:  # queued and eligible: its heap entry moves with it
                    self._enter(flow, state)
        state.running -= 1
        self._running -= 1
        if not self._queued and not self._running:
            self._after_drain()

    def set_weight(self, flow: str, weight: float) -> None:
        """Change a queued flow's weight (a config reload): its next charges use it."""
        check_weight(weight)
        state = self._flows.get(flow)
        if state is not None:
            state.weight = weight

    def set_eligible(self, flow: str, ok: bool) -> None:
        """Skip ``flow`` in selection while it is at a cap; its meter and queue stay put.

        Coming back it rejoins under ``max(S, v)``, so time spent capped earns no credit.
        """
        if not ok:
            self._ineligible.add(flow)
            state = self._flows.get(flow)
            if state is not None:
                state.entry = -1
            return
        if flow not in self._ineligible:
            return
        self._ineligible.discard(flow)
        state = self._flows.get(flow)
        if state is not None and state.queue:
            state.meter = max(state.meter, self._v)
            self._enter(flow, state)

    # -- what can be read -------------------------------------------------------------------

    @property
    def virtual_time(self) -> float:
        return (self._v + self._offset) / UNITS_PER_COST

    def meter(self, flow: str) -> float:
        """The flow's next start tag; a flow not tracked any more sits at the baseline ``v``."""
        state = self._flows.get(flow)
        units = self._v if state is None else state.meter
        return (units + self._offset) / UNITS_PER_COST

    def backlog(self, flow: str) -> int:
        state = self._flows.get(flow)
        return 0 if state is None else len(state.queue)

    def is_eligible(self, flow: str) -> bool:
        return flow not in self._ineligible

    def flows(self) -> list[FlowView]:
        """Every tracked flow, in flow-id order (a snapshot for observability)."""
        return [
            FlowView(
                flow=name,
                meter=(state.meter + self._offset) / UNITS_PER_COST,
                lag=(state.meter - self._v) / UNITS_PER_COST,
                backlog=len(state.queue),
                eligible=name not in self._ineligible,
            )
            for name, state in sorted(self._flows.items())
        ]

    def __len__(self) -> int:
        return self._queued

    def __repr__(self) -> str:
        return (
            f"<FairQueue v={self.virtual_time:g} | {len(self._flows)} flows, "
            f"{self._queued} queued, {len(self._ineligible)} ineligible>"
        )

    # -- internals --------------------------------------------------------------------------

    def _head(self) -> tuple[str, _Flow[T]] | None:
        """The flow whose live entry tops the heap, dropping stale entries on the way."""
        heap = self._heap
        while heap:
            _, flow, seq = heap[0]
            state = self._flows.get(flow)
            if state is not None and state.entry == seq:
                return flow, state
            heapq.heappop(heap)  # stale: the flow was charged, emptied or made ineligible
        return None

    def _enter(self, flow: str, state: _Flow[T]) -> None:
        self._seq += 1
        state.entry = self._seq
        heapq.heappush(self._heap, (state.meter, flow, self._seq))

    def _after_drain(self) -> None:
        """Close the busy period when nothing waits and nothing runs anywhere.

        Every flow is then idle at or below the new baseline, where a returning flow would
        join anyway, so their state is forgotten: memory stays bounded by active flows.
        """
        if self._queued or self._running:
            return
        self._v = max(self._v, self._max_meter)
        self._max_meter = self._v
        self._flows.clear()
        self._heap.clear()

    def _renormalize(self) -> None:
        """Shift every meter down by ``v``; only differences matter, so no order changes."""
        shift = self._v
        self._offset += shift
        self._v = 0
        self._max_meter -= shift
        for state in self._flows.values():
            state.meter -= shift
        self._heap = [(m - shift, f, s) for m, f, s in self._heap]  # order kept: heap intact


def _units(cost: float, weight: float) -> int:
    """What a cost charges a flow of ``weight``, in meter units (at least one)."""
    return max(1, round(cost * UNITS_PER_COST / weight))


def _mark(state: _Flow[T], front: bool, bucket: int, max_overtaken: int | None) -> None:
    """Note a request about to be queued in ``state`` (at its head if ``front``) in its
    flow's lanes, made when the flow gets size buckets: what was queued before counts as
    UNSIZED and never overtaken (it was a FIFO)."""
    lanes = state.lanes
    if lanes is None:
        assert max_overtaken is not None
        lanes = state.lanes = _Lanes(max_overtaken)
        lanes.marks.extend([UNSIZED, 0] for _ in state.queue)
    if max_overtaken is None:
        bucket = UNSIZED
    else:
        lanes.max_overtaken = max_overtaken
        lanes.sizes[bucket] = lanes.sizes.get(bucket, 0) + 1
    mark = [bucket, DUE if front else 0]
    (lanes.marks.appendleft if front else lanes.marks.append)(mark)


def _pick(lanes: _Lanes) -> int:
    """Where in its flow's queue the flow's next request is: the oldest (0) when it was
    overtaken ``max_overtaken`` times already, else the oldest of the smallest non-empty
    bucket. Counts never grow from the oldest to the youngest (a dispatch raises everything
    older than it; a newcomer starts at 0; a retry enters at the head, due), so the oldest
    holds the largest count and checking it bounds everyone's."""
    marks = lanes.marks
    sizes = lanes.sizes
    if not sizes or marks[0][1] >= lanes.max_overtaken:
        return 0
    smallest = min(sizes)
    for index, mark in enumerate(marks):
        if mark[0] == smallest:
            return index
    raise AssertionError("a counted bucket has no queued request")  # pragma: no cover


def _take(queue: deque[tuple[T, float]], lanes: _Lanes) -> tuple[T, float]:
    """Take the flow's next request out of its ``queue``, counting what it overtakes."""
    index = _pick(lanes)
    for mark in islice(lanes.marks, index):  # the older ones it overtakes
        mark[1] += 1
    taken = queue[index]
    del queue[index]
    _unmark(lanes, index)
    return taken


def _unmark(lanes: _Lanes, index: int) -> None:
    """The request at ``index`` of its flow's queue left it (dispatched or removed)."""
    bucket = lanes.marks[index][0]
    del lanes.marks[index]
    if bucket != UNSIZED:
        left = lanes.sizes[bucket] - 1
        if left:
            lanes.sizes[bucket] = left
        else:
            del lanes.sizes[bucket]


def check_size(bucket: int, max_overtaken: int) -> None:
    """Raise ValueError unless ``bucket`` is an int in [0, MAX_SIZE_BUCKETS] and
    ``max_overtaken`` one in [0, MAX_OVERTAKEN]."""
    for name, value, high in (
        ("bucket", bucket, MAX_SIZE_BUCKETS),
        ("max_overtaken", max_overtaken, MAX_OVERTAKEN),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"{name} must be an integer in [0, {high}], got {value!r}")


def check_cost(cost: float) -> None:
    """Raise ValueError unless ``cost`` is a number in (0, MAX_COST]."""
    _check_range("cost", cost, MAX_COST)


def check_actual(actual: float) -> None:
    """Raise ValueError unless ``actual`` (what a request really cost) is a number in
    [0, MAX_COST]: a request may have cost nothing."""
    if not (actual.__class__ is float and 0.0 <= actual <= MAX_COST):  # the fast path's check
        _check_range("actual", actual, MAX_COST, allow_zero=True)


def check_weight(weight: float) -> None:
    """Raise ValueError unless ``weight`` is a number in [MIN_WEIGHT, MAX_WEIGHT]."""
    _check_range("weight", weight, MAX_WEIGHT, MIN_WEIGHT)


def _check_range(
    name: str, value: float, high: float, low: float = 0.0, *, allow_zero: bool = False
) -> None:
    """``value`` must be a real number in (0, ``high``] (``[0, high]`` with ``allow_zero``)
    and at least ``low``.

    Compared, never converted: a huge int must fail the check, not overflow inside it.
    NaN fails every comparison.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not (ok and (value > 0 or (allow_zero and value == 0)) and low <= value <= high):
        opening = "[" if allow_zero else "("
        raise ValueError(
            f"{name} must be a number in {opening}0, {high:g}] and >= {low:g}, got {value!r}"
        )
