"""Size buckets inside a flow: bounded overtaking (docs/design.md §3, Size buckets inside a flow).

Within a flow whose class has size buckets, the next request is the oldest of the smallest
non-empty bucket, unless the flow's oldest request has already been overtaken K times
(``max_overtaken``), in which case the oldest goes; a retry put back at the head is due at
once. Which flow goes next is SFQ's choice as before, charged the cost of the request
actually dispatched. Checked here with hypothesis against an independent bookkeeping of
every request's overtakes, and against a linear-scan reference in exact fractions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sfq_harness import Op, Trace, check_band, check_pairwise

from sfq_proxy.config import DEFAULT_MAX_OVERTAKEN, size_bucket
from sfq_proxy.core.fair_queue import FairQueue
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket

FLOWS = ["a", "b", "c"]
BOUNDS = [2.0, 8.0]  # buckets: cost ≤ 2 → 0, ≤ 8 → 1, above → 2
costs = st.integers(1, 64).map(lambda k: k / 4)  # dyadic: exact in floats and fractions
weight_maps = st.fixed_dictionaries({f: st.sampled_from([0.5, 1.0, 2.0, 4.0]) for f in FLOWS})
# each flow's K; None: the flow is a plain FIFO
k_maps = st.fixed_dictionaries({f: st.sampled_from([None, 0, 1, 2, 3, 8]) for f in FLOWS})
op = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(FLOWS), costs),
    st.tuples(st.just("push"), st.sampled_from(FLOWS), costs),
    st.tuples(st.just("front"), st.sampled_from(FLOWS), costs),
    st.tuples(st.just("pop")),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.sampled_from(FLOWS), st.integers(0, 50)),
    st.tuples(st.just("elig"), st.sampled_from(FLOWS), st.booleans()),
)
op_lists = st.lists(op, max_size=250)
fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Ks = dict[str, int | None]


def push(q: Any, flow: str, item: int, cost: float, weight: float, k: int | None, front: bool):
    if k is None:
        q.push(flow, item, cost, weight, front=front)
    else:
        q.push(flow, item, cost, weight, front=front, bucket=size_bucket(cost, BOUNDS),
               max_overtaken=k)  # fmt: skip


# -- an independent account of the rule --------------------------------------------------------


@dataclass
class Waiting:
    item: int
    bucket: int
    charge: Fraction
    front: bool
    overtaken: int = 0


def expected_index(line: list[Waiting], k: int | None) -> int:
    """Where in the flow's line (oldest first) the rule says the next request is."""
    oldest = line[0]
    if k is None or oldest.front or oldest.overtaken >= k:
        return 0
    smallest = min(w.bucket for w in line)
    return next(i for i, w in enumerate(line) if w.bucket == smallest)


def run_sized(q: Any, ops: list[Op], weights: dict[str, float], ks: Ks) -> Trace:
    """Apply ``ops``, checking at every dispatch that the request is the one the rule names
    and that nobody was overtaken more than its flow's K; the trace feeds the SFQ checks."""
    trace = Trace()
    lines: dict[str, list[Waiting]] = {f: [] for f in weights}
    ineligible: set[str] = set()
    for index, (kind, *args) in enumerate(ops):
        if kind in ("push", "front"):
            flow, cost = args
            charge = Fraction(cost) / Fraction(weights[flow])
            front = kind == "front"
            push(q, flow, index, cost, weights[flow], ks[flow], front)
            waiting = Waiting(index, size_bucket(cost, BOUNDS), charge, front)
            (lines[flow].insert(0, waiting) if front else lines[flow].append(waiting))
            trace.max_charge[flow] = max(trace.max_charge.get(flow, Fraction(0)), charge)
        elif kind == "pop":
            got = q.pop()
            ready = [f for f, line in lines.items() if line and f not in ineligible]
            assert (got is None) == (not ready)
            if got is not None:
                flow, item = got
                line = lines[flow]
                at = next(i for i, w in enumerate(line) if w.item == item)
                assert at == expected_index(line, ks[flow]), (flow, item, line)
                for older in line[:at]:
                    older.overtaken += 1
                    assert not older.front
                    assert older.bucket > line[at].bucket  # only a smaller one overtakes
                    assert older.overtaken <= (ks[flow] or 0), older
                trace.dispatches.append(got)
                q.settle(flow, ops[item][2])  # it ends at once: the rule is the queue's
                trace.charges.append((index, flow, line[at].charge))
                del line[at]
        elif kind == "remove":
            flow, k = args
            line = lines[flow]
            if line:
                gone = line.pop(k % len(line))
                assert q.remove(flow, gone.item)
            else:
                assert not q.remove(flow, -1)
        else:
            flow, ok = args
            q.set_eligible(flow, ok)
            (ineligible.discard if ok else ineligible.add)(flow)
        assert len(q) == sum(len(line) for line in lines.values())
        trace.states.append(
            (
                Fraction(q.virtual_time),
                {
                    f: (len(line), f not in ineligible, Fraction(q.meter(f)))
                    for f, line in lines.items()
                },
            )
        )
    return trace


# -- a linear-scan reference in exact fractions --------------------------------------------------


@dataclass
class ReferenceSized:
    """SFQ by linear argmin over exact meters, each flow a list ordered by the rule."""

    ks: Ks
    S: dict[str, Fraction] = field(default_factory=dict)
    lines: dict[str, list[Waiting]] = field(default_factory=dict)
    v: Fraction = Fraction(0)
    ineligible: set[str] = field(default_factory=set)

    @property
    def virtual_time(self) -> Fraction:
        return self.v

    def push(self, flow: str, item: int, cost: float, weight: float = 1.0, *, front=False,
             bucket=0, max_overtaken=None) -> None:  # fmt: skip
        line = self.lines.setdefault(flow, [])
        if not line:
            self.S[flow] = max(self.S.get(flow, self.v), self.v)
        waiting = Waiting(item, bucket, Fraction(cost) / Fraction(weight), front)
        line.insert(0, waiting) if front else line.append(waiting)

    def pop(self) -> tuple[str, int] | None:
        ready = [f for f, line in self.lines.items() if line and f not in self.ineligible]
        if not ready:
            return None
        flow = min(ready, key=lambda f: (self.S[f], f))
        line = self.lines[flow]
        at = expected_index(line, self.ks[flow])
        for older in line[:at]:
            older.overtaken += 1
        chosen = line.pop(at)
        self.v = self.S[flow]
        self.S[flow] += chosen.charge
        return flow, chosen.item

    def settle(self, flow: str, cost: float, actual: float | None = None) -> None:
        """Each request ends right after its dispatch here: the busy period may end."""
        if not any(self.lines.values()):
            self.v = max(self.v, *self.S.values())

    def remove(self, flow: str, item: int) -> bool:
        line = self.lines.get(flow, [])
        for at, waiting in enumerate(line):
            if waiting.item == item:
                del line[at]
                if not any(self.lines.values()):
                    self.v = max(self.v, *self.S.values())
                return True
        return False

    def set_eligible(self, flow: str, ok: bool) -> None:
        if ok and flow in self.ineligible:
            self.ineligible.discard(flow)
            if self.lines.get(flow):
                self.S[flow] = max(self.S[flow], self.v)
        elif not ok:
            self.ineligible.add(flow)

    def meter(self, flow: str) -> Fraction:
        return self.S.get(flow, self.v)

    def __len__(self) -> int:
        return sum(len(line) for line in self.lines.values())


# -- the properties --------------------------------------------------------------------------


@fast
@given(ops=op_lists, weights=weight_maps, ks=k_maps)
def test_the_rule_holds_and_nobody_is_overtaken_more_than_k_times(
    ops: list[Op], weights: dict[str, float], ks: Ks
) -> None:
    run_sized(FairQueue(), ops, weights, ks)


@fast
@given(ops=op_lists, weights=weight_maps, ks=k_maps)
def test_the_sfq_bounds_hold_with_size_buckets(
    ops: list[Op], weights: dict[str, float], ks: Ks
) -> None:
    trace = run_sized(FairQueue(), ops, weights, ks)
    check_band(trace)
    check_pairwise(trace)


@fast
@given(ops=op_lists, weights=weight_maps, ks=k_maps)
def test_agrees_with_the_linear_reference(ops: list[Op], weights: dict[str, float], ks: Ks) -> None:
    fast_trace = run_sized(FairQueue(), ops, weights, ks)
    slow_trace = run_sized(ReferenceSized(ks), ops, weights, ks)
    assert fast_trace.dispatches == slow_trace.dispatches
    assert [s[0] for s in fast_trace.states] == [s[0] for s in slow_trace.states]


@fast
@given(ops=op_lists, weights=weight_maps, ks=k_maps)
def test_deterministic_and_renormalisation_changes_nothing(
    ops: list[Op], weights: dict[str, float], ks: Ks
) -> None:
    once = run_sized(FairQueue(), ops, weights, ks)
    assert run_sized(FairQueue(), ops, weights, ks) == once
    assert run_sized(FairQueue(renormalize_at=1), ops, weights, ks) == once


@fast
@given(ops=op_lists, weights=weight_maps, k=st.sampled_from([0, 1, 8]))
def test_off_or_a_single_bucket_is_exactly_fifo(
    ops: list[Op], weights: dict[str, float], k: int
) -> None:
    """K = 0, or every request in one bucket, gives the plain FIFO's dispatches, meters and
    virtual time step by step."""

    def replay(mode: str) -> list[Any]:
        q: FairQueue[int] = FairQueue()
        out: list[Any] = []
        for index, (kind, *args) in enumerate(ops):
            if kind in ("push", "front"):
                flow, cost = args
                front = kind == "front"
                if mode == "fifo":
                    q.push(flow, index, cost, weights[flow], front=front)
                else:
                    bucket = size_bucket(cost, BOUNDS) if mode == "k0" else 1
                    kk = 0 if mode == "k0" else k
                    q.push(flow, index, cost, weights[flow], front=front, bucket=bucket,
                           max_overtaken=kk)  # fmt: skip
            elif kind == "pop":
                out.append(got := q.pop())
                if got is not None:
                    q.settle(got[0], ops[got[1]][2])
            elif kind == "remove":
                flow, n = args
                out.append(q.remove(flow, n))
            else:
                q.set_eligible(*args)
            out.append((q.virtual_time, [(v.flow, v.meter, v.backlog) for v in q.flows()]))
        return out

    fifo = replay("fifo")
    assert replay("k0") == fifo
    assert replay("one") == fifo


# -- worked examples -------------------------------------------------------------------------


def drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (got := q.pop()) is not None:
        out.append(got[1])
    return out


def test_short_ones_overtake_a_long_one_at_most_k_times() -> None:
    """One flow, K = 2: L1 L2 queued, then four short ones. S1 and S2 overtake both long
    ones; L1 and L2 have then been overtaken twice each, so they go, then S3 and S4."""
    q: FairQueue[str] = FairQueue()
    for name, cost in [("L1", 50), ("L2", 50), ("S1", 1), ("S2", 1), ("S3", 1), ("S4", 1)]:
        q.push("a", name, cost, bucket=size_bucket(cost, BOUNDS), max_overtaken=2)
    assert drain(q) == ["S1", "S2", "L1", "L2", "S3", "S4"]


def test_with_k_large_enough_the_smallest_bucket_goes_first_in_arrival_order() -> None:
    q: FairQueue[str] = FairQueue()
    for name, cost in [("L1", 50), ("M1", 5), ("S1", 1), ("L2", 50), ("M2", 5), ("S2", 1)]:
        q.push("a", name, cost, bucket=size_bucket(cost, BOUNDS), max_overtaken=8)
    assert drain(q) == ["S1", "S2", "M1", "M2", "L1", "L2"]


def test_a_retry_is_due_at_once_and_removal_keeps_counts() -> None:
    q: FairQueue[str] = FairQueue()
    for name, cost in [("L1", 50), ("S1", 1), ("S2", 1)]:
        q.push("a", name, cost, bucket=size_bucket(cost, BOUNDS), max_overtaken=1)
    assert q.pop() == ("a", "S1")  # L1 overtaken once: it is due
    q.push("a", "R", 50, front=True, bucket=2, max_overtaken=1)  # a retry: due at once
    assert q.remove("a", "S2")
    q.push("a", "S3", 1, bucket=0, max_overtaken=1)
    assert drain(q) == ["R", "L1", "S3"]


def test_charges_follow_the_request_actually_dispatched() -> None:
    """Flow a: L (cost 30) then S (cost 1); flow b: one request of cost 2. S overtakes L and
    a is charged 1, not 30: b (at 0) goes next, then a (at 1, below b's 2) sends L."""
    q: FairQueue[str] = FairQueue()
    q.push("a", "L", 30, bucket=size_bucket(30, BOUNDS), max_overtaken=8)
    q.push("a", "S", 1, bucket=size_bucket(1, BOUNDS), max_overtaken=8)
    q.push("b", "B", 2)
    assert q.pop() == ("a", "S")
    assert (q.virtual_time, q.meter("a")) == (0, 1)
    assert q.pop() == ("b", "B")
    assert q.pop() == ("a", "L")
    assert q.meter("a") == 31  # the queue is empty: v moved up to it (global idle)


def test_buckets_turned_on_and_off_by_a_reload() -> None:
    """Requests queued before the flow had buckets count as the largest bucket, overtaken 0
    times; a plain push into a flow with buckets is UNSIZED too; once the flow drains it is a
    FIFO again."""
    q: FairQueue[str] = FairQueue()
    q.push("a", "P1", 1)  # plain
    q.push("a", "P2", 1)
    q.push("a", "S1", 1, bucket=0, max_overtaken=1)
    q.push("a", "P3", 1)  # plain again: after every bucket
    assert drain(q) == ["S1", "P1", "P2", "P3"]
    q.push("a", "X", 50)
    q.push("a", "Y", 1)
    assert drain(q) == ["X", "Y"]


# -- through the scheduler --------------------------------------------------------------------


def test_the_scheduler_passes_a_tickets_bucket_and_the_band_ignores_it() -> None:
    from sfq_proxy.config import BackendSpec

    sched = Scheduler(Placement([BackendSpec(url="http://x:1", slots=1, name="x")]))

    def ticket(name: str, cost: float, **extra: Any) -> Ticket:
        return Ticket(org="o", cls="batch", cost=cost, payload=name, **extra)

    (blocker,) = sched.submit(ticket("blocker", 1.0), 0.0)
    k = DEFAULT_MAX_OVERTAKEN
    for name, cost in [("long", 5000.0), ("short", 10.0)]:
        assert sched.submit(ticket(name, cost, bucket=size_bucket(cost, [500]),
                                   max_overtaken=k), 0.0) == []  # fmt: skip
    (first,) = sched.finish(blocker, 0.0)
    assert first.payload == "short"
    with pytest.raises(ValueError, match="max_overtaken"):
        ticket("bad", 1.0, max_overtaken=-1)
    with pytest.raises(ValueError, match="bucket"):
        ticket("bad", 1.0, bucket=99, max_overtaken=1)


def test_size_bucket_bounds_are_inclusive_upper_bounds() -> None:
    assert [size_bucket(c, [500, 4000]) for c in (1, 500, 501, 4000, 4001)] == [0, 0, 1, 1, 2]
    assert deque([size_bucket(c, []) for c in (1, 1e9)]) == deque([0, 0])
