"""Engine gates in placement and the scheduler (core/placement.py ``place_gated``,
``set_gate``, ``gated_slots``; core/scheduler.py ``ceilings``): a backend whose gate refuses
counts as full, SFQ still decides who goes, the gate hears every dispatch and completion,
and refusals are counted once per dispatch attempt. Sans-I/O: times are numbers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.engine_gate import GatePolicy
from sfq_proxy.core.engine_metrics import EngineReading
from sfq_proxy.core.placement import Backend, Placement, gated_slots, set_gate, starting_slots
from sfq_proxy.core.scheduler import Scheduler, Ticket


def gated(slots: list[int | str], **policy: object) -> Placement:
    """Backends b0, b1… of ``slots`` each, every one with a gate (``slots: auto`` for "auto")."""
    specs = [BackendSpec(url=f"http://b{i}:1", slots=n, name=f"b{i}") for i, n in enumerate(slots)]
    placement = Placement(specs)
    for backend, spec in zip(placement.backends, specs, strict=True):
        fixed = spec.slots if isinstance(spec.slots, int) else None
        set_gate(backend, GatePolicy(slots=fixed, **policy), 0.0)  # type: ignore[arg-type]
    return placement


def observe(backend: Backend, running: int, waiting: int, now: float) -> None:
    assert backend.gate is not None
    backend.gate.observe(EngineReading(running=running, waiting=waiting), now, now)
    gated_slots(backend)


def test_a_backend_whose_gate_refuses_counts_as_full() -> None:
    p = gated([8, 8])
    b0, b1 = p.backends
    observe(b0, 4, 1, 0.0)  # capacity learned 4, one waiting: full with allowance 1
    observe(b1, 0, 0, 0.0)
    assert p.place_gated(None, 0.1, 1.0) == (b1, "fallback")
    observe(b1, 4, 1, 0.2)
    assert p.place_gated(None, 0.3, 1.0) is None
    assert b0.refused == {"engine_queue": 1}
    assert b1.refused == {"engine_queue": 1}


def test_a_full_static_slot_is_no_refusal_of_the_gate() -> None:
    p = gated([1])
    p.acquire(p.backends[0])
    assert p.place_gated(None, 0.0, 1.0) is None
    assert not p.backends[0].refused


def test_auto_slots_follow_the_gate() -> None:
    """An auto backend's slots are its gate's fallback (capacity, at least fallback_slots)
    and the allowance: sane for shares and metrics, never below what the gate admits."""
    p = gated(["auto"], fallback_slots=2, allowance=1)
    b = p.backends[0]
    assert b.slots == 3
    observe(b, 6, 2, 0.0)  # saturated at 6
    assert b.slots == 7
    assert starting_slots(BackendSpec(url="http://x:1", slots="auto", capacity=5)) == 5


def test_a_new_gate_counts_the_requests_already_in_flight() -> None:
    p = Placement([BackendSpec(url="http://x:1", slots=4)])
    b = p.backends[0]
    p.acquire(b)
    set_gate(b, GatePolicy(slots=4), 1.0)
    assert b.gate is not None
    assert b.gate.in_flight == 1
    b.gate.completed(2.0)  # no "more completions than dispatches"
    set_gate(b, None, 2.0)
    assert b.gate is None


def test_the_scheduler_tells_the_gate_and_waits_for_it() -> None:
    p = gated([8])
    b = p.backends[0]
    sched = Scheduler(p)
    sched.ceilings = {"batch": 1.0}
    observe(b, 0, 0, 0.0)
    tickets = [Ticket(org="A", cls="batch", cost=1.0) for _ in range(12)]
    dispatched = [t for ticket in tickets for t in sched.submit(ticket, 0.01)]
    assert b.gate is not None
    # slots 8 is a ceiling: an idle engine takes one, then the gate waits to see it run
    assert len(dispatched) == b.gate.dispatches == 1
    observe(b, 1, 0, 0.1)  # it runs 1, nobody waits: up to 1 + the allowance
    assert len(sched.pump(0.1)) == 1
    observe(b, 1, 1, 0.2)  # one waits for room: the engine runs 1 at once, capacity 1
    assert sched.pump(0.2) == []  # 1 running + the allowance waiting: no more
    assert len(sched.finish(dispatched[0], 0.3)) == 1  # one ended: the allowance refills
    assert b.gate.completions == 1


@settings(max_examples=200, deadline=None)
@given(
    ceiling=st.sampled_from([0.25, 0.5, 0.75, 0.9, 1.0]),
    capacity=st.integers(1, 16),
    steps=st.lists(st.booleans(), min_size=1, max_size=60),
)
def test_a_class_below_its_ceiling_never_runs_past_it(
    ceiling: float, capacity: int, steps: list[bool]
) -> None:
    """Whatever dispatches and completions happen (readings exact, every dispatch seen), a
    class of ``ceiling`` < 1 never has more than ⌊ceiling × capacity⌋ (at least 1) in
    flight; at 1 it never passes capacity + allowance; SFQ's queue keeps the rest."""
    p = gated([64], capacity=capacity)
    b = p.backends[0]
    sched = Scheduler(p)
    sched.ceilings = {"batch": ceiling}
    running: list[Ticket] = []
    limit = max(1, int(ceiling * capacity + 1e-9)) if ceiling < 1 else capacity + 1
    now = 0.0
    for step in steps:
        now += 1.0
        observe(b, min(b.in_flight, capacity), max(0, b.in_flight - capacity), now)
        now += 1.0
        if step or not running:
            running += sched.submit(Ticket(org="A", cls="batch", cost=1.0), now)
        else:
            running += sched.finish(running.pop(0), now)
        assert b.in_flight <= limit
