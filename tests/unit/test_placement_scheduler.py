"""Placement (which backend) and the Scheduler (fair queue in front of placement)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.placement import Backend, Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket


def placement(*slots: int) -> Placement:
    return Placement(
        [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots, 1)]
    )


def fill(p: Placement, backend: Backend, n: int) -> None:
    for _ in range(n):
        p.acquire(backend)


# -- Placement --------------------------------------------------------------------------------


def test_backends_are_built_from_specs() -> None:
    p = Placement(
        [
            BackendSpec(url="http://10.0.0.1:8000/", slots=2),
            BackendSpec(url="http://10.0.0.2:8000", slots=3, name="gpu-b"),
        ]
    )
    got = [(b.name, b.url, b.slots, b.in_flight, b.healthy) for b in p.backends]
    assert got == [
        ("10.0.0.1:8000", "http://10.0.0.1:8000", 2, 0, True),
        ("gpu-b", "http://10.0.0.2:8000", 3, 0, True),
    ]


def test_choose_prefers_least_loaded_by_fraction_of_slots() -> None:
    p = placement(4, 2)
    a, b = p.backends
    fill(p, a, 1)  # a: 1/4, b: 0/2
    assert p.choose() is b
    fill(p, b, 1)  # a: 1/4, b: 1/2
    assert p.choose() is a
    fill(p, a, 1)  # a: 2/4 = b: 1/2 -> tie, first listed
    assert p.choose() is a


def test_choose_ties_go_to_first_listed() -> None:
    p = placement(2, 2, 2)
    assert p.choose() is p.backends[0]
    fill(p, p.backends[0], 1)
    assert p.choose() is p.backends[1]
    fill(p, p.backends[1], 1)
    assert p.choose() is p.backends[2]


def test_choose_skips_unhealthy_and_full_backends() -> None:
    p = placement(1, 8, 8)
    a, b, c = p.backends
    p.mark_down(b, until=10.0)
    assert p.choose() is a
    fill(p, a, 1)  # a is full at load 1.0
    fill(p, c, 7)  # c is at 7/8 but has a slot
    assert p.choose() is c
    fill(p, c, 1)
    assert p.choose() is None


def test_choose_is_none_when_all_down() -> None:
    p = placement(1, 1)
    for backend in p.backends:
        p.mark_down(backend, until=1.0)
    assert p.choose() is None
    assert not p.any_healthy()


def test_acquire_beyond_slots_raises() -> None:
    p = placement(2)
    (a,) = p.backends
    fill(p, a, 2)
    with pytest.raises(RuntimeError, match="no free slot"):
        p.acquire(a)
    assert a.in_flight == 2


def test_release_below_zero_raises() -> None:
    p = placement(2)
    (a,) = p.backends
    p.acquire(a)
    p.release(a)
    with pytest.raises(RuntimeError, match="released more slots"):
        p.release(a)
    assert a.in_flight == 0


def test_mark_up_only_after_cooldown() -> None:
    p = placement(1)
    (a,) = p.backends
    assert p.mark_up(a, now=0.0) is False  # healthy already: nothing brought back
    p.mark_down(a, until=10.0)
    assert (a.healthy, a.down_until) == (False, 10.0)
    assert p.mark_up(a, now=9.99) is False
    assert a.healthy is False
    assert p.choose() is None
    assert p.mark_up(a, now=10.0) is True
    assert a.healthy is True
    assert p.choose() is a
    assert p.mark_up(a, now=11.0) is False


def test_mark_down_keeps_the_later_cooldown() -> None:
    p = placement(1)
    (a,) = p.backends
    p.mark_down(a, until=20.0)
    p.mark_down(a, until=5.0)
    assert a.down_until == 20.0
    assert p.mark_up(a, now=15.0) is False
    assert p.mark_up(a, now=20.0) is True


# -- Scheduler --------------------------------------------------------------------------------


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


# -- property: random operations never break the accounting -------------------------------


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


def test_update_keeps_known_backends_and_adds_new_ones_unhealthy() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=2), BackendSpec(url="http://b:1", slots=2)])
    a, b = p.backends
    p.acquire(b)
    p.update([BackendSpec(url="http://a:1", slots=3), BackendSpec(url="http://c:1", slots=1)])
    assert p.backends[0] is a
    assert a.slots == 3
    assert [x.url for x in p.backends] == ["http://a:1", "http://c:1"]
    assert not p.backends[1].healthy  # joins after its first good probe
    assert p.choose() is a
    p.release(b)  # a removed backend's request still finishes and frees its slot
    assert b.in_flight == 0
