"""One conformance suite over the five implementations of ``DispatchQueue`` (FIFO, strict
priority, round robin, DRR and SFQ), then what each policy is meant to do. SFQ's own
properties (the bound, the reference model) are in test_fair_queue.py on top of this."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.fair_queue import MAX_COST, FairQueue
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.queues import (
    QUEUE_NAMES,
    DispatchQueue,
    Drr,
    Fifo,
    RoundRobin,
    StrictPriority,
    make_queue,
)
from sfq_proxy.core.scheduler import Scheduler, Ticket

FLOWS = ["o1/batch", "o2/interactive", "o3/batch", "o4/system"]
Make = Callable[[], DispatchQueue[int]]
MAKERS: dict[str, Make] = {
    "fifo": Fifo,
    "priority": StrictPriority,
    "rr": RoundRobin,
    "drr": lambda: Drr(3.0),
    "drr-small-quantum": lambda: Drr(0.3),
    "sfq": FairQueue,
}
every_queue = pytest.mark.parametrize("make", list(MAKERS.values()), ids=list(MAKERS))

costs = st.integers(1, 40).map(lambda k: k / 4)
op = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(FLOWS), costs, st.sampled_from([0.5, 1.0, 2.0])),
    st.tuples(st.just("front"), st.sampled_from(FLOWS), costs, st.just(1.0)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("pop")),
    st.tuples(st.just("peek")),
    st.tuples(st.just("remove"), st.sampled_from(FLOWS), st.integers(0, 80)),
    st.tuples(st.just("elig"), st.sampled_from(FLOWS), st.booleans()),
    st.tuples(st.just("weight"), st.sampled_from(FLOWS), st.sampled_from([0.5, 1.0, 2.0])),
)
op_lists = st.lists(op, max_size=200)
fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def play(make: Make, ops: list[tuple[object, ...]], *, peeks: bool = True) -> list[object]:
    """Run ``ops``, checking the contract against a plain model at every step; returns
    what the queue said (pops and removals), for determinism checks."""
    q = make()
    model: dict[str, deque[int]] = {f: deque() for f in FLOWS}
    eligible = dict.fromkeys(FLOWS, True)
    said: list[object] = []
    item = 0
    for o in ops:
        kind = o[0]
        if kind in ("push", "front"):
            _, flow, cost, weight = o
            item += 1
            q.push(flow, item, cost, weight, front=kind == "front")  # type: ignore[arg-type]
            (model[flow].appendleft if kind == "front" else model[flow].append)(item)  # type: ignore[index]
        elif kind == "peek" and not peeks:
            continue
        elif kind in ("pop", "peek"):
            peeked = q.peek()
            assert q.peek() == peeked  # peek changes nothing
            popped = q.pop() if kind == "pop" else peeked
            assert popped == peeked
            if popped is None:
                assert not any(model[f] for f in FLOWS if eligible[f])
            elif kind == "pop":
                flow, got = popped
                assert eligible[flow], "an ineligible flow was served"
                assert model[flow].popleft() == got, "not FIFO within the flow"
            said.append((kind, popped))
        elif kind == "remove":
            _, flow, which = o
            ok = q.remove(flow, which)  # type: ignore[arg-type]
            assert ok == (which in model[flow])  # type: ignore[index]
            if ok:
                model[flow].remove(which)  # type: ignore[index, arg-type]
            said.append((kind, ok))
        elif kind == "elig":
            _, flow, ok = o
            q.set_eligible(flow, ok)  # type: ignore[arg-type]
            eligible[flow] = ok  # type: ignore[index]
            assert q.is_eligible(flow) == ok  # type: ignore[arg-type]
        elif kind == "weight":
            _, flow, weight = o
            q.set_weight(flow, weight)  # type: ignore[arg-type]
        assert len(q) == sum(len(m) for m in model.values())
        for f in FLOWS:
            assert q.backlog(f) == len(model[f])
        views = q.flows()
        assert [v.flow for v in views] == sorted(v.flow for v in views)
        assert all(v.backlog == len(model[v.flow]) for v in views)
    # drain what is left: nothing lost, nothing duplicated
    for f in FLOWS:
        q.set_eligible(f, True)
    rest: Counter[str] = Counter()
    while (popped := q.pop()) is not None:
        rest[popped[0]] += 1
        assert model[popped[0]].popleft() == popped[1]
    assert not any(model.values())
    assert len(q) == 0
    return said


@every_queue
@fast
@given(ops=op_lists)
def test_the_contract_on_random_interleavings(make: Make, ops: list[tuple[object, ...]]) -> None:
    play(make, ops)


@every_queue
@fast
@given(ops=op_lists)
def test_same_operations_same_order_and_peeking_changes_nothing(
    make: Make, ops: list[tuple[object, ...]]
) -> None:
    first = play(make, ops)
    assert play(make, ops) == first
    assert play(make, ops, peeks=False) == [s for s in first if s[0] != "peek"]


@every_queue
def test_bad_numbers_raise_and_change_nothing(make: Make) -> None:
    q = make()
    q.push("a/x", 1, 1.0)
    for cost, weight in ((0, 1.0), (-1, 1.0), (float("nan"), 1.0), (MAX_COST * 2, 1.0),
                         (True, 1.0), (1.0, 0), (1.0, float("inf"))):  # fmt: skip
        with pytest.raises(ValueError, match="must be"):
            q.push("b/x", 2, cost, weight)
    with pytest.raises(ValueError, match="weight"):
        q.set_weight("a/x", -1)
    assert len(q) == 1
    assert q.backlog("b/x") == 0
    assert q.pop() == ("a/x", 1)
    assert q.pop() is None


@every_queue
def test_an_ineligible_flow_keeps_its_queue_and_nothing_else_waits(make: Make) -> None:
    q = make()
    q.push("a/x", 1, 1.0)
    q.set_eligible("a/x", False)
    assert q.peek() is None
    assert q.pop() is None
    assert len(q) == 1
    q.set_eligible("a/x", True)
    assert q.pop() == ("a/x", 1)
    assert not q.remove("a/x", 1)
    assert not q.remove("zz/x", 1)


@every_queue
def test_the_scheduler_takes_it(make: Make) -> None:
    placement = Placement([BackendSpec(url="http://b1:1", slots=2)])
    sched = Scheduler(placement, queue=make())  # type: ignore[arg-type]
    tickets = [Ticket(org=f"o{i % 3}", cls="batch", cost=1.0 + i) for i in range(9)]
    started = [t for ticket in tickets for t in sched.submit(ticket, 0.0)]
    assert len(started) == 2
    assert sched.queued() == 7
    running, done = list(started), []
    while running:
        ticket = running.pop(0)
        done.append(ticket)
        running += sched.finish(ticket, 1.0)
    assert sched.queued() == 0
    assert sched.running == 0
    assert sorted(id(t) for t in tickets) == sorted(id(t) for t in done)
    assert all(t.dispatches == 1 for t in tickets)


def test_make_queue_names_every_policy() -> None:
    for name in QUEUE_NAMES:
        assert make_queue(name, quantum=2) is not None
    with pytest.raises(ValueError, match="unknown policy"):
        make_queue("lifo")
    with pytest.raises(ValueError, match="quantum"):
        Drr(0)


# -- what each policy does ------------------------------------------------------------------


def order(q: DispatchQueue[int]) -> list[str]:
    out = []
    while (popped := q.pop()) is not None:
        out.append(f"{popped[0][:2]}{popped[1]}")
    return out


def test_fifo_serves_in_arrival_order_across_flows_and_a_retry_first() -> None:
    q: Fifo[int] = Fifo()
    for i, flow in enumerate(["a/x", "b/x", "a/x", "c/x"]):
        q.push(flow, i, 100.0 if flow == "a/x" else 1.0)
    q.push("c/x", 9, 1.0, front=True)
    assert order(q) == ["c/9", "a/0", "b/1", "a/2", "c/3"]


def test_strict_priority_serves_the_highest_class_first_fifo_within() -> None:
    q: StrictPriority[int] = StrictPriority(["interactive", "batch"])
    q.push("a/batch", 0, 1.0)
    q.push("b/other", 1, 1.0)
    q.push("c/interactive", 2, 1.0)
    q.push("a/batch", 3, 1.0)
    q.push("d/interactive", 4, 1.0)
    assert order(q) == ["c/2", "d/4", "a/0", "a/3", "b/1"]


def test_round_robin_alternates_whatever_the_cost_and_newcomers_join_the_round_end() -> None:
    q: RoundRobin[int] = RoundRobin()
    for i in range(3):
        q.push("a/x", i, 100.0)
        q.push("b/x", 10 + i, 1.0)
    assert q.pop() == ("a/x", 0)
    q.push("c/x", 20, 1.0)
    assert order(q) == ["b/10", "a/1", "c/20", "b/11", "a/2", "b/12"]


def naive_drr(quantum: float, pushes: list[tuple[str, int, float]]) -> list[int]:
    """The paper's loop, for flows all queued up front (no eligibility, no arrivals)."""
    queues: dict[str, deque[tuple[int, float]]] = {}
    active: deque[str] = deque()
    for flow, item, cost in pushes:
        if flow not in queues:
            queues[flow] = deque()
            active.append(flow)
        queues[flow].append((item, cost))
    deficit = dict.fromkeys(queues, 0.0)
    out = []
    while active:
        flow = active.popleft()
        deficit[flow] += quantum
        while queues[flow] and queues[flow][0][1] <= deficit[flow]:
            item, cost = queues[flow].popleft()
            deficit[flow] -= cost
            out.append(item)
        if queues[flow]:
            active.append(flow)
        else:
            deficit[flow] = 0.0
    return out


@settings(max_examples=200, deadline=None)
@given(
    quantum=st.sampled_from([0.25, 1.0, 3.0, 10.0]),
    pushes=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 40).map(lambda k: k / 4))),
)
def test_drr_agrees_with_the_papers_loop(quantum: float, pushes: list[tuple[str, float]]) -> None:
    numbered = [(flow, i, cost) for i, (flow, cost) in enumerate(pushes)]
    q: Drr[int] = Drr(quantum)
    for flow, item, cost in numbered:
        q.push(flow, item, cost)
    got = []
    while (popped := q.pop()) is not None:
        got.append(popped[1])
    assert got == naive_drr(quantum, numbered)


def test_drr_and_sfq_share_cost_rr_shares_requests() -> None:
    def counts(q: DispatchQueue[int], n: int = 40) -> Counter[str]:
        for i in range(200):
            q.push("a/x", i, 4.0)
            q.push("b/x", i, 1.0)
        return Counter(q.pop()[0] for _ in range(n))  # type: ignore[index]

    assert counts(RoundRobin()) == Counter({"a/x": 20, "b/x": 20})
    for q in (Drr(4.0), FairQueue()):
        got = counts(q)  # type: ignore[arg-type]
        assert abs(got["a/x"] * 4 - got["b/x"]) <= 8, got


def test_baseline_meters_are_normalised_service() -> None:
    q: Fifo[int] = Fifo()
    q.push("a/x", 1, 6.0, 2.0)
    q.push("a/x", 2, 2.0, 2.0)
    q.pop()
    assert q.meter("a/x") == 3.0
    assert q.virtual_time == 0.0
    q.pop()
    assert q.meter("a/x") == 0.0  # forgotten when the queue empties, as SFQ does
    assert q.virtual_time == 3.0
