"""The Scheduler (core/scheduler.py): strict band, in-flight caps and rate pacing in front of
placement, with the fair queue deciding the order (docs/design.md §3, §5, §6).

Sans-I/O: time is a number the test passes in, chosen so every wait is exact in floats.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.fair_queue import MAX_COST, MIN_WEIGHT
from sfq_proxy.core.limits import Rate
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket


def placement(*slots: int) -> Placement:
    return Placement(
        [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots, 1)]
    )


def ticket(org: str, cost: float = 1.0, weight: float = 1.0, payload: str = "") -> Ticket:
    return Ticket(org=org, cls="batch", cost=cost, weight=weight, payload=payload or org)


def test_submit_dispatches_only_while_slots_are_free() -> None:
    sched = Scheduler(placement(1, 1))
    a, b = sched.placement.backends
    t1, t2, t3 = ticket("x"), ticket("x"), ticket("y")
    assert sched.submit(t1, 0.0) == [t1]
    assert t1.backend is a
    assert sched.submit(t2, 0.0) == [t2]
    assert t2.backend is b
    assert sched.submit(t3, 0.0) == []
    assert t3.backend is None
    assert (t1.dispatches, t2.dispatches, t3.dispatches) == (1, 1, 0)
    assert sched.running == 2
    assert len(sched.queue) == 1


def test_finish_frees_the_slot_and_dispatches_in_sfq_order() -> None:
    sched = Scheduler(placement(1))
    (backend,) = sched.placement.backends
    blocker, a1, a2, b1 = ticket("z"), ticket("a"), ticket("a"), ticket("b")
    assert sched.submit(blocker, 0.0) == [blocker]
    for t in (a1, a2, b1):
        assert sched.submit(t, 0.0) == []
    assert sched.finish(blocker, 0.0) == [a1]  # a and b tie; flow id breaks it
    assert blocker.backend is None
    assert a1.backend is backend
    # a was charged for a1, so b goes before a's backlog although it arrived last
    assert sched.finish(a1, 0.0) == [b1]
    assert sched.finish(b1, 0.0) == [a2]
    assert sched.finish(a2, 0.0) == []
    assert (sched.running, backend.in_flight, len(sched.queue)) == (0, 0, 0)


def test_weights_and_costs_order_dispatch() -> None:
    sched = Scheduler(placement(1))
    blocker = ticket("z", cost=1000)
    sched.submit(blocker, 0.0)
    heavy = [ticket("heavy", cost=3.0, payload=f"h{i}") for i in range(3)]
    light = [ticket("light", cost=1.0, payload=f"l{i}") for i in range(4)]
    for t in heavy + light:
        sched.submit(t, 0.0)
    order: list[str] = []
    running = blocker
    while dispatched := sched.finish(running, 0.0):
        (running,) = dispatched
        order.append(running.payload)
    # SFQ start tags: heavy 0,3,6; light 0,1,2,3 (ties broken by flow id)
    assert order == ["h0", "l0", "l1", "l2", "h1", "l3", "h2"]


def test_finish_of_a_ticket_without_slot_raises() -> None:
    sched = Scheduler(placement(1))
    with pytest.raises(RuntimeError, match="holds no slot"):
        sched.finish(ticket("a"), 0.0)


def test_cancel_queued_ticket_is_never_dispatched() -> None:
    sched = Scheduler(placement(1))
    first, cancelled, kept = ticket("a"), ticket("b"), ticket("c")
    sched.submit(first, 0.0)
    sched.submit(cancelled, 0.0)
    sched.submit(kept, 0.0)
    assert sched.cancel(cancelled) is True
    assert sched.cancel(cancelled) is False
    assert sched.finish(first, 0.0) == [kept]
    assert sched.finish(kept, 0.0) == []
    assert cancelled.dispatches == 0
    assert cancelled.backend is None


def test_cancel_of_a_dispatched_ticket_is_false_and_keeps_its_slot() -> None:
    sched = Scheduler(placement(1))
    t = ticket("a")
    sched.submit(t, 0.0)
    assert sched.cancel(t) is False
    assert t.backend is sched.placement.backends[0]
    assert sched.running == 1
    assert sched.finish(t, 0.0) == []


def test_cancel_of_a_never_submitted_ticket_is_false() -> None:
    sched = Scheduler(placement(1))
    sched.submit(ticket("a"), 0.0)
    sched.submit(ticket("a"), 0.0)
    assert sched.cancel(ticket("a")) is False
    assert len(sched.queue) == 1


def test_nothing_is_dispatched_while_no_backend_is_free() -> None:
    sched = Scheduler(placement(1, 1))
    a, b = sched.placement.backends
    sched.placement.mark_down(a, until=5.0)
    t1, t2, t3 = ticket("x"), ticket("y"), ticket("z")
    assert sched.submit(t1, 0.0) == [t1]
    assert t1.backend is b
    assert sched.submit(t2, 0.0) == []
    assert sched.submit(t3, 0.0) == []
    assert sched.pump(0.0) == []
    assert sched.placement.mark_up(a, now=4.0) is False
    assert sched.pump(0.0) == []
    assert (t2.dispatches, t3.dispatches) == (0, 0)


def test_pump_after_a_backend_comes_back() -> None:
    sched = Scheduler(placement(2))
    (a,) = sched.placement.backends
    sched.placement.mark_down(a, until=5.0)
    t1, t2, t3 = ticket("x"), ticket("y"), ticket("x")
    for t in (t1, t2, t3):
        assert sched.submit(t, 0.0) == []
    assert sched.placement.mark_up(a, now=5.0) is True
    assert sched.pump(0.0) == [t1, t2]
    assert (t1.backend, t2.backend, t3.backend) == (a, a, None)
    assert sched.pump(0.0) == []


def test_a_finished_ticket_resubmitted_is_dispatched_again() -> None:
    sched = Scheduler(placement(1))
    t = ticket("a")
    sched.submit(t, 0.0)
    sched.finish(t, 0.0)
    assert sched.submit(t, 0.0) == [t]
    assert t.dispatches == 2


def test_finish_on_a_down_backend_frees_the_slot_but_dispatches_elsewhere() -> None:
    sched = Scheduler(placement(1, 1))
    a, b = sched.placement.backends
    t1, t2, t3 = ticket("x"), ticket("y"), ticket("z")
    sched.submit(t1, 0.0)
    sched.submit(t2, 0.0)
    sched.submit(t3, 0.0)
    sched.placement.mark_down(a, until=1.0)
    assert sched.finish(t1, 0.0) == []
    assert a.in_flight == 0
    assert sched.finish(t2, 0.0) == [t3]
    assert t3.backend is b


@dataclass
class Model:
    """What the test expects, kept beside the scheduler it drives."""

    queued: list[Ticket] = field(default_factory=list)
    running: list[Ticket] = field(default_factory=list)
    cancelled: list[Ticket] = field(default_factory=list)
    dispatches_at_cancel: dict[int, int] = field(default_factory=dict)
    submits: dict[int, int] = field(default_factory=dict)
    now: float = 0.0


flows = st.sampled_from(["a", "b", "c"])


ops = st.one_of(
    st.tuples(st.just("submit"), flows, st.integers(1, 8)),
    st.tuples(st.just("submit"), flows, st.integers(1, 8)),
    st.tuples(st.just("finish"), st.integers(0, 20)),
    st.tuples(st.just("retry"), st.integers(0, 20)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("cancel_running"), st.integers(0, 20)),
    st.tuples(st.just("down"), st.integers(0, 2), st.integers(0, 5)),
    st.tuples(st.just("up"), st.integers(0, 2), st.integers(0, 5)),
    st.tuples(st.just("pump")),
)


def accept(sched: Scheduler, model: Model, dispatched: list[Ticket]) -> None:
    """Check a batch of dispatch decisions against the model, then record them."""
    for t in dispatched:
        assert t in model.queued, "dispatched a ticket that was not waiting"
        assert t not in model.cancelled
        assert t.backend is not None
        assert t.backend.healthy
        model.queued.remove(t)
        model.running.append(t)


def check(sched: Scheduler, model: Model) -> None:
    backends = sched.placement.backends
    for b in backends:
        assert 0 <= b.in_flight <= b.slots
    assert sched.running == sum(b.in_flight for b in backends) == len(model.running)
    for b in backends:
        assert b.in_flight == sum(1 for t in model.running if t.backend is b)
    assert len(sched.queue) == len(model.queued)
    for t in model.queued + model.running + model.cancelled:
        assert t.dispatches <= model.submits[id(t)]
    for t in model.cancelled:  # a retry may have been sent before; not since its cancel
        assert t.dispatches == model.dispatches_at_cancel[id(t)]
        assert t.backend is None
    # work-conserving and no overtaking: work waits only when no backend can take it
    assert not model.queued or sched.placement.choose() is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slots=st.lists(st.integers(1, 3), min_size=2, max_size=3),
    steps=st.lists(ops, max_size=120),
)
def test_random_operations_keep_slots_and_tickets_consistent(
    slots: list[int], steps: list[tuple[object, ...]]
) -> None:
    sched = Scheduler(placement(*slots))
    backends = sched.placement.backends
    model = Model()
    for step in steps:
        match step:
            case ("submit", str(flow), int(cost)):
                t = ticket(flow, cost=float(cost))
                model.submits[id(t)] = 1
                model.queued.append(t)
                accept(sched, model, sched.submit(t, 0.0))
            case ("finish" | "retry" as what, int(i)) if model.running:
                t = model.running.pop(i % len(model.running))
                done_on = t.backend
                dispatched = sched.finish(t, 0.0)
                assert t.backend is None
                assert t not in dispatched
                assert done_on is not None
                accept(sched, model, dispatched)
                if what == "retry":
                    model.submits[id(t)] += 1
                    model.queued.append(t)
                    accept(sched, model, sched.submit(t, 0.0))
            case ("cancel", int(i)) if model.queued:
                t = model.queued.pop(i % len(model.queued))
                assert sched.cancel(t) is True
                model.cancelled.append(t)
                model.dispatches_at_cancel[id(t)] = t.dispatches
            case ("cancel_running", int(i)) if model.running:
                t = model.running[i % len(model.running)]
                assert sched.cancel(t) is False
            case ("down", int(b), int(cooldown)):
                sched.placement.mark_down(backends[b % len(backends)], model.now + cooldown)
            case ("up", int(b), int(elapsed)):
                model.now += elapsed
                backend = backends[b % len(backends)]
                expected = not backend.healthy and model.now >= backend.down_until
                assert sched.placement.mark_up(backend, model.now) is expected
                if expected:
                    accept(sched, model, sched.pump(0.0))
            case ("pump",):
                accept(sched, model, sched.pump(0.0))
        check(sched, model)


fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def sfq(org: str, cls: str = "batch", cost: float = 1.0, tokens: float = 0.0) -> Ticket:
    return Ticket(org=org, cls=cls, cost=cost, tokens=tokens)


def band(org: str = "ops", cls: str = "system") -> Ticket:
    return Ticket(org=org, cls=cls, cost=1.0, priority=True)


def test_priority_ticket_goes_before_a_hundred_queued_sfq_tickets() -> None:
    sched = Scheduler(placement(1))
    blocker = sfq("z")
    assert sched.submit(blocker, 0.0) == [blocker]
    queued = [sfq(org) for _ in range(25) for org in "abcd"]
    for t in queued:
        assert sched.submit(t, 0.0) == []
    urgent = band()
    assert sched.submit(urgent, 0.0) == []  # no slot: it waits, it does not preempt
    assert sched.queued() == 101
    assert sched.finish(blocker, 0.0) == [urgent]
    assert sched.finish(urgent, 0.0) == [queued[0]]


def test_band_is_fifo_and_never_charged() -> None:
    sched = Scheduler(placement(1))
    blocker = sfq("z")
    sched.submit(blocker, 0.0)
    waiting = [sfq("a"), sfq("b")]
    for t in waiting:
        sched.submit(t, 0.0)
    p1, p2, p3 = band("x"), band("c"), band("a")
    for t in (p1, p2, p3):
        sched.submit(t, 0.0)
    q = sched.queue
    assert sched.finish(blocker, 0.0) == [p1]
    assert sched.finish(p1, 0.0) == [p2]
    assert sched.finish(p2, 0.0) == [p3]
    # the band moved no meter: a and b still wait at v = 0, where they joined while the
    # blocker ran (its busy period), and z's charge is remembered
    assert (q.virtual_time, q.meter("a/batch"), q.meter("b/batch")) == (0.0, 0.0, 0.0)
    assert q.meter("z/batch") == 1.0
    assert sched.finish(p3, 0.0) == waiting[:1]
    assert sched.finish(waiting[0], 0.0) == waiting[1:]
    assert [t.dispatches for t in (p1, p2, p3)] == [1, 1, 1]


def test_band_class_cap_holds_while_sfq_keeps_flowing() -> None:
    sched = Scheduler(placement(10), class_caps={"system": 2})
    p1, p2, p3, p4 = band(), band(), band(), band()
    assert sched.submit(p1, 0.0) == [p1]
    assert sched.submit(p2, 0.0) == [p2]
    assert sched.submit(p3, 0.0) == []  # at the cap, with 8 free slots
    assert sched.submit(p4, 0.0) == []
    flowing = [sfq("a"), sfq("b"), sfq("a")]
    for t in flowing:
        assert sched.submit(t, 0.0) == [t]  # SFQ does not wait behind the capped band
    assert sched.finish(flowing[0], 0.0) == []  # a free slot does not lift the cap
    assert sched.finish(p2, 0.0) == [p3]  # FIFO within the band
    assert sched.finish(p1, 0.0) == [p4]
    assert sched.finish(p3, 0.0) == []
    assert (sched.running, sched.queued()) == (3, 0)


def test_a_capped_band_class_does_not_block_another_band_class() -> None:
    sched = Scheduler(placement(10), class_caps={"system": 1})
    s1, s2, alert = band(cls="system"), band(cls="system"), band(cls="alert")
    assert sched.submit(s1, 0.0) == [s1]
    assert sched.submit(s2, 0.0) == []
    assert sched.submit(alert, 0.0) == [alert]
    assert sched.finish(s1, 0.0) == [s2]


def test_org_cap_skips_the_org_and_keeps_its_place() -> None:
    sched = Scheduler(placement(3), org_caps={"a": 2})
    q = sched.queue
    a = [sfq("a") for _ in range(5)]
    b = [sfq("b") for _ in range(5)]
    assert sched.submit(a[0], 0.0) == [a[0]]
    assert sched.submit(a[1], 0.0) == [a[1]]
    assert sched.submit(a[2], 0.0) == []  # org a at its cap, a slot is free
    assert not q.is_eligible("a/batch")
    assert q.meter("a/batch") == 2.0
    assert sched.submit(b[0], 0.0) == [b[0]]  # b takes the free slot
    for t in b[1:]:
        sched.submit(t, 0.0)
    # b is served while a is capped, and a's meter does not move
    assert sched.finish(b[0], 0.0) == [b[1]]
    assert sched.finish(b[1], 0.0) == [b[2]]
    assert sched.finish(b[2], 0.0) == [b[3]]
    # (a's running requests keep the busy period open: nobody is reset to a new baseline)
    assert (q.meter("a/batch"), q.virtual_time, q.meter("b/batch")) == (2.0, 4.0, 5.0)
    assert not q.is_eligible("a/batch")
    # a drops below its cap: it rejoins at max(S, v) = v = 4 and goes before b (5)
    assert sched.finish(a[0], 0.0) == [a[2]]
    assert (q.meter("a/batch"), q.virtual_time) == (5.0, 4.0)
    assert not q.is_eligible("a/batch")  # at the cap again
    assert sched.submit(a[3], 0.0) == []
    assert sched.finish(b[3], 0.0) == [b[4]]
    assert sched.finish(a[1], 0.0) == [a[3]]
    counts = Counter(t.org for t in a + b if t.backend is not None)
    assert counts == {"a": 2, "b": 1}


def test_a_capped_org_ahead_of_v_rejoins_at_its_own_meter() -> None:
    sched = Scheduler(placement(2), org_caps={"a": 1})
    q = sched.queue
    (backend,) = sched.placement.backends
    sched.placement.mark_down(backend, until=0.0)  # everything queues before any dispatch
    big, a2 = sfq("a", cost=10.0), sfq("a")
    b = [sfq("b") for _ in range(12)]
    for t in (big, a2, *b):
        assert sched.submit(t, 0.0) == []
    assert sched.placement.mark_up(backend, 0.0)
    assert sched.pump(0.0) == [big, b[0]]  # a's meter: 10, and a is at its cap
    assert sched.finish(b[0], 0.0) == [b[1]]
    assert sched.finish(b[1], 0.0) == [b[2]]
    assert sched.finish(big, 0.0) == [b[3]]  # a eligible again at S = 10 > v: b goes first
    assert q.is_eligible("a/batch")
    assert (q.meter("a/batch"), q.meter("b/batch")) == (10.0, 4.0)
    running, order = [b[2], b[3]], []
    while running:
        dispatched = sched.finish(running.pop(0), 0.0)
        order += dispatched
        running += dispatched
    # b's meter reaches 10 after b[9]; the tie at 10 goes to flow "a/batch"
    assert order == [*b[4:10], a2, *b[10:]]


def test_class_cap_on_a_fair_queued_class() -> None:
    sched = Scheduler(placement(10), class_caps={"batch": 2})
    q = sched.queue
    a1, a2, a3 = sfq("a"), sfq("a"), sfq("a")
    b1, b2 = sfq("b"), sfq("b")
    i1, i2 = sfq("a", "interactive"), sfq("a", "interactive")
    assert sched.submit(a1, 0.0) == [a1]
    assert sched.submit(a2, 0.0) == [a2]
    for t in (a3, b1, b2):
        assert sched.submit(t, 0.0) == []
    assert (q.is_eligible("a/batch"), q.is_eligible("b/batch")) == (False, False)
    assert sched.submit(i1, 0.0) == [i1]  # another class is not capped
    assert sched.submit(i2, 0.0) == [i2]
    assert q.is_eligible("a/interactive")
    assert (q.meter("a/batch"), q.meter("b/batch"), q.virtual_time) == (2.0, 1.0, 2.0)
    assert sched.finish(i1, 0.0) == []
    # both rejoin at max(S, v) = 2, b not at its older meter; the tie goes to a
    assert sched.finish(a1, 0.0) == [a3]
    assert (q.meter("a/batch"), q.meter("b/batch")) == (3.0, 2.0)
    assert sched.finish(a3, 0.0) == [b1]
    assert sched.finish(a2, 0.0) == [b2]
    assert sched.finish(i2, 0.0) == []
    assert (sched.running, sched.queued()) == (2, 0)


def test_waiting_counts_the_flow_backlog_or_the_band_class() -> None:
    sched = Scheduler(placement(1))
    sched.submit(sfq("z"), 0.0)
    for t in (sfq("a"), sfq("a"), sfq("a"), sfq("b"), sfq("a", "interactive")):
        sched.submit(t, 0.0)
    for t in (band(cls="system"), band(cls="system"), band(cls="alert")):
        sched.submit(t, 0.0)
    assert sched.waiting(sfq("a")) == 3
    assert sched.waiting(sfq("b")) == 1
    assert sched.waiting(sfq("a", "interactive")) == 1
    assert sched.waiting(sfq("c")) == 0
    assert sched.waiting(band(cls="system")) == 2
    assert sched.waiting(band(org="other", cls="system")) == 2  # the band is per class
    assert sched.waiting(band(cls="alert")) == 1
    assert sched.waiting(band(cls="none")) == 0


def test_cancel_of_a_band_ticket() -> None:
    sched = Scheduler(placement(1))
    blocker = sfq("z")
    sched.submit(blocker, 0.0)
    later = sfq("a")
    sched.submit(later, 0.0)
    p1, p2 = band(), band()
    sched.submit(p1, 0.0)
    sched.submit(p2, 0.0)
    assert sched.cancel(p1) is True
    assert sched.cancel(p1) is False
    assert sched.cancel(band()) is False  # never submitted
    assert sched.waiting(p2) == 1
    assert sched.finish(blocker, 0.0) == [p2]
    assert sched.cancel(p2) is False  # running: not cancelled, keeps its slot
    assert p2.backend is not None
    assert sched.finish(p2, 0.0) == [later]
    assert p1.dispatches == 0


def test_provider_rate_paces_dispatch_one_per_second() -> None:
    sched = Scheduler(placement(100), rate=Rate.of(60, None, burst_s=1.0))
    tickets = [sfq("a") for _ in range(5)]
    dispatched = [t for ticket in tickets for t in sched.submit(ticket, 0.0)]
    assert dispatched == tickets[:1]
    assert sched.wake_at == 1.0
    assert sched.pump(0.5) == []
    assert sched.wake_at == 1.0
    assert sched.pump(1.0) == tickets[1:2]
    assert sched.wake_at == 2.0
    assert sched.pump(3.0) == tickets[2:3]  # the burst is one request: nothing banked
    assert sched.wake_at == 4.0
    assert sched.pump(4.0) == tickets[3:4]
    assert sched.pump(5.0) == tickets[4:]
    assert sched.wake_at is None  # nothing left to wait for
    assert sched.running == 5


def test_provider_rate_with_a_minute_of_burst() -> None:
    sched = Scheduler(placement(100), rate=Rate.of(60, None))
    tickets = [sfq("a") for _ in range(65)]
    dispatched = [t for ticket in tickets for t in sched.submit(ticket, 0.0)]
    assert dispatched == tickets[:60]
    assert sched.wake_at == 1.0
    assert sched.pump(1.0) == tickets[60:61]
    assert sched.pump(3.0) == tickets[61:63]  # two tokens refilled since 1.0


def test_provider_rate_blocks_the_band_too_and_nothing_overtakes() -> None:
    sched = Scheduler(placement(100), rate=Rate.of(60, None, burst_s=1.0))
    first, second, urgent = sfq("a"), sfq("b"), band()
    assert sched.submit(first, 0.0) == [first]
    assert sched.submit(second, 0.0) == []
    assert sched.submit(urgent, 0.0) == []
    assert sched.pump(1.0) == [urgent]  # the band still goes first when the rate allows
    assert sched.pump(2.0) == [second]


def test_ticket_tokens_gate_dispatch_with_a_tokens_per_minute_rate() -> None:
    sched = Scheduler(placement(100), rate=Rate.of(None, 600, burst_s=1.0))  # 10 tokens/s
    small = [sfq("a", tokens=5) for _ in range(3)]
    assert [t for ticket in small for t in sched.submit(ticket, 0.0)] == small[:2]
    assert sched.wake_at == 0.5  # 5 tokens × 60 / 600
    assert sched.pump(0.5) == small[2:]
    # a ticket bigger than the burst waits for a full bucket, then leaves it in debt
    big, after = sfq("b", tokens=100), sfq("a", tokens=5)
    assert sched.submit(big, 0.5) == []
    assert sched.wake_at == 1.5
    assert sched.pump(1.5) == [big]
    assert sched.submit(after, 1.5) == []
    assert sched.wake_at == 11.0  # (5 + 90 of debt) × 60 / 600 = 9.5 s later
    assert sched.pump(10.5) == []
    assert sched.pump(11.0) == [after]


def test_a_large_head_ticket_is_not_overtaken_by_a_smaller_one() -> None:
    sched = Scheduler(placement(100), rate=Rate.of(None, 600, burst_s=1.0))
    sched.submit(sfq("z", tokens=10), 0.0)  # empties the bucket
    head, small = sfq("a", tokens=10), sfq("b", tokens=1)
    assert sched.submit(head, 0.0) == []
    assert sched.submit(small, 0.0) == []
    assert sched.pump(0.5) == []  # 5 tokens would fit small, but head is first in line
    assert sched.pump(1.0) == [head]
    assert sched.pump(1.5) == [small]


def test_band_tickets_pass_their_org_cap_but_count_toward_it() -> None:
    """By design (docs/how-it-works.md): a health check never waits behind its team's batch."""
    sched = Scheduler(placement(10), org_caps={"ops": 2}, class_caps={"system": 4})
    tickets = [band("ops") for _ in range(3)]
    dispatched = [t for ticket in tickets for t in sched.submit(ticket, 0.0)]
    assert dispatched == tickets
    batch = Ticket(org="ops", cls="batch", cost=1.0)
    assert sched.submit(batch, 0.0) == []  # the org is over its cap for SFQ work
    assert not sched.queue.is_eligible(batch.flow)


ORG_CAPS = {"a": 2, "b": 1}


CLASS_CAPS = {"batch": 3, "system": 2}


sched_ops = st.one_of(
    st.tuples(
        st.just("submit"),
        st.sampled_from(["a", "b", "c"]),
        st.sampled_from(["batch", "interactive"]),
        st.integers(1, 5),
    ),
    st.tuples(st.just("submit"), st.sampled_from(["a", "b"]), st.just("batch"), st.just(1)),
    # band tickets come from orgs without a cap (see test_band_tickets_respect_their_org_cap)
    st.tuples(st.just("band"), st.sampled_from(["ops", "c"]), st.sampled_from(["system", "alert"])),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("finish"), st.integers(0, 30)),
    st.tuples(st.just("retry"), st.integers(0, 30)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
)


@dataclass
class Tracked:
    """The test's own account of what is queued and running."""

    queued: list[Ticket] = field(default_factory=list)  # in submission order
    running: list[Ticket] = field(default_factory=list)

    def accept(self, dispatched: list[Ticket]) -> None:
        seen_sfq = False
        for t in dispatched:
            assert t in self.queued, "dispatched a ticket that was not waiting"
            if t.priority:
                assert not seen_sfq, "a band ticket was dispatched after an SFQ one"
                earlier = self.queued[: self.queued.index(t)]
                assert not [e for e in earlier if e.priority and e.cls == t.cls], "band not FIFO"
            seen_sfq = seen_sfq or not t.priority
            self.queued.remove(t)
            self.running.append(t)


def at_cap(running: list[Ticket], t: Ticket) -> bool:
    orgs = Counter(r.org for r in running)
    classes = Counter(r.cls for r in running)
    org_full = t.org in ORG_CAPS and orgs[t.org] >= ORG_CAPS[t.org]
    return org_full or (t.cls in CLASS_CAPS and classes[t.cls] >= CLASS_CAPS[t.cls])


def check_caps_and_work_conservation(sched: Scheduler, model: Tracked) -> None:
    orgs = Counter(t.org for t in model.running)
    classes = Counter(t.cls for t in model.running)
    for org, cap in ORG_CAPS.items():
        assert orgs[org] <= cap
    for cls, cap in CLASS_CAPS.items():
        assert classes[cls] <= cap
    assert sched.running == len(model.running)
    assert sched.queued() == len(model.queued)
    for t in model.queued:
        if not t.priority:
            assert sched.queue.is_eligible(t.flow) == (not at_cap(model.running, t))
    if sched.placement.choose() is not None:  # a free slot: everything waiting is capped
        assert all(at_cap(model.running, t) for t in model.queued)


@fast
@given(
    slots=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    steps=st.lists(sched_ops, max_size=120),
)
def test_caps_are_never_exceeded_and_free_slots_never_idle(
    slots: list[int], steps: list[tuple[Any, ...]]
) -> None:
    sched = Scheduler(placement(*slots), org_caps=ORG_CAPS, class_caps=CLASS_CAPS)
    model = Tracked()
    for step in steps:
        match step:
            case ("submit", str(org), str(cls), int(cost)):
                t = sfq(org, cls, cost=float(cost))
                model.queued.append(t)
                model.accept(sched.submit(t, 0.0))
            case ("band", str(org), str(cls)):
                t = band(org, cls)
                model.queued.append(t)
                model.accept(sched.submit(t, 0.0))
            case ("finish" | "retry" as what, int(i)) if model.running:
                t = model.running.pop(i % len(model.running))
                model.accept(sched.finish(t, 0.0))
                if what == "retry" and not t.priority:  # back at the head of its own flow
                    model.queued.append(t)
                    model.accept(sched.submit(t, 0.0, front=True))
            case ("cancel", int(i)) if model.queued:
                t = model.queued.pop(i % len(model.queued))
                assert sched.cancel(t) is True
        check_caps_and_work_conservation(sched, model)


@pytest.mark.parametrize(
    "fields",
    [
        {"cost": math.nan},
        {"cost": 1e305},
        {"cost": 0},
        {"weight": 1e-300},
        {"weight": math.inf},
        {"tokens": math.nan},
        {"tokens": -1.0},
        {"tokens": 1e16},
    ],
    ids=repr,
)
def test_a_ticket_with_numbers_the_scheduler_cannot_use_is_never_made(
    fields: dict[str, float],
) -> None:
    with pytest.raises(ValueError, match="must be"):
        Ticket(**{"org": "a", "cls": "batch", "cost": 1.0, **fields})  # type: ignore[arg-type]


def test_the_largest_valid_ticket_is_queued_charged_and_paced_like_any() -> None:
    sched = Scheduler(placement(1), rate=Rate.of(None, 600, burst_s=1.0))
    huge = Ticket(org="a", cls="batch", cost=MAX_COST, weight=MIN_WEIGHT, tokens=MAX_COST)
    small = sfq("b", tokens=1)
    assert sched.submit(huge, 0.0) == [huge]
    assert sched.submit(small, 0.0) == []
    assert sched.finish(huge, 0.0) == []  # the pacing bucket is deep in debt, not broken
    assert sched.wake_at is not None
    assert math.isfinite(sched.wake_at)
    sched.refund(MAX_COST, 0.0)  # the upstream refused it at once: the debt is forgiven
    assert sched.pump(0.0) == [small]


def test_a_dispatch_that_fails_leaves_the_ticket_queued_and_every_slot_free() -> None:
    """The only check of a dispatch (a free slot) comes before any change: a placement that
    raises leaves the ticket in line, uncharged, and nothing held."""
    place = placement(1)
    sched = Scheduler(place)
    ticket = sfq("a")

    def broken(backend: Any) -> None:
        raise RuntimeError("injected")

    place.acquire = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        sched.submit(ticket, 0.0)
    assert (sched.queued(), sched.running, sched.queue.meter("a")) == (1, 0, 0.0)
    del place.acquire
    assert sched.pump(0.0) == [ticket]
