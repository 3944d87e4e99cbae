"""The engine gate (core/engine_gate.py): may a backend take one more request now, judged by
its engine's readings, corrected by what the proxy sent since.

Sans-I/O: times are numbers the test passes in. The properties run on random sequences of
dispatches, completions, readings (fresh, late, stale or unusable) and time, and on a tiny
engine simulated here: FIFO, K requests at once, scraped at random moments with random
delays, behind an endless backlog.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from random import Random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.core.engine_gate import Decision, EngineGate, Estimate, GatePolicy
from sfq_proxy.core.engine_metrics import EngineReading, unavailable

fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reading(running: int, waiting: int = 0, **more: object) -> EngineReading:
    return EngineReading(running=running, waiting=waiting, **more)  # type: ignore[arg-type]


def gate(**policy: object) -> EngineGate:
    return EngineGate(GatePolicy(**policy))  # type: ignore[arg-type]


def send(g: EngineGate, now: float, n: int = 1) -> None:
    for _ in range(n):
        assert g.admit(now).admit
        g.dispatched(now)


# --- the rule, case by case -------------------------------------------------------------


def test_without_a_reading_it_falls_back_to_static_slots() -> None:
    g = gate(slots=3)
    assert g.admit(0.0) == Decision(True, "stale")
    send(g, 0.0, 3)
    assert g.admit(0.0) == Decision(False, "slots")


def test_an_auto_backend_without_a_reading_runs_its_fallback_slots() -> None:
    g = gate(fallback_slots=2)
    send(g, 0.0, 2)
    assert g.admit(0.0) == Decision(False, "stale")


def test_a_reading_older_than_max_age_is_stale_and_dispatch_goes_on() -> None:
    g = gate(slots=4, max_age_s=2.0)
    g.observe(reading(10, 50), requested_at=0.0, now=0.1)  # a full engine, then silence
    assert g.admit(1.0) == Decision(False, "engine_queue")
    assert g.admit(2.0) == Decision(False, "engine_queue")
    assert g.admit(2.01) == Decision(True, "stale")


def test_the_age_counts_from_when_the_scrape_was_requested() -> None:
    g = gate(slots=4, max_age_s=2.0)
    g.observe(reading(10, 50), requested_at=0.0, now=1.9)  # a slow answer
    assert g.admit(2.01).reason == "stale"


def test_an_unusable_reading_leaves_the_last_one_to_age() -> None:
    g = gate(slots=4)
    g.observe(reading(4, 3), requested_at=0.0, now=0.0)
    g.observe(unavailable("invalid"), requested_at=0.5, now=0.5)
    assert g.problem == "invalid"
    assert g.admit(1.0).reason == "engine_queue"
    assert g.admit(2.5).reason == "stale"
    g.observe(reading(0), requested_at=3.0, now=3.0)
    assert g.problem is None
    assert g.admit(3.0) == Decision(True, "ok")


def test_a_late_answer_of_an_older_scrape_is_dropped() -> None:
    g = gate()
    g.observe(reading(0), requested_at=1.0, now=1.0)
    g.observe(reading(5, 5), requested_at=0.5, now=1.1)
    assert g.reading == reading(0)


def test_an_idle_engine_always_takes_one() -> None:
    """Nothing running, nothing waiting, nothing unseen: whatever the KV use or the class."""
    g = gate(kv_ceiling=0.5)
    g.observe(reading(0, kv_usage=1.0), requested_at=0.0, now=0.0)
    assert g.admit(0.0, ceiling=0.1) == Decision(True, "ok")


def test_the_engine_may_hold_the_allowance_waiting_and_no_more() -> None:
    g = gate(capacity=4, allowance=2)
    g.observe(reading(3), requested_at=0.0, now=0.0)
    send(g, 0.0, 3)  # 3 running + 3 unseen = 4 running and 2 waiting
    assert g.admit(0.0) == Decision(False, "engine_queue")
    est = g.estimate(0.0)
    assert est is not None
    assert (est.running, est.waiting, est.capacity, est.credit) == (4, 2, 4, 3)


def test_a_completion_the_reading_may_have_seen_is_not_credited() -> None:
    """settle_s after the answer: a finished request takes that long to reach the proxy."""
    g = gate(capacity=2, settle_s=0.1)
    for _ in range(3):  # one more than the capacity: the allowance
        g.dispatched(0.0)
    g.observe(reading(2, 1), requested_at=1.0, now=1.02)
    assert g.admit(1.05).reason == "engine_queue"
    g.completed(1.05)  # may be one the reading no longer counted
    assert g.admit(1.05).reason == "engine_queue"
    g.completed(1.2)  # surely one it counted
    assert g.admit(1.2) == Decision(True, "ok")


def test_a_dispatch_shortly_before_the_scrape_counts_as_unseen() -> None:
    """settle_s before the request: a dispatch takes that long to reach the scheduler."""
    g = gate(capacity=2, settle_s=0.1)
    send(g, 0.0)
    send(g, 0.95)
    g.observe(reading(1), requested_at=1.0, now=1.01)  # the first seen, the second maybe not
    est = g.estimate(1.01)
    assert est is not None
    assert est.credit == 1
    assert est.load == 2


def test_kv_use_stops_a_class_at_its_share_of_the_kv_ceiling() -> None:
    g = gate(capacity=100, kv_ceiling=0.9)
    g.observe(reading(10, kv_usage=0.85), requested_at=0.0, now=0.0)
    assert g.admit(0.0, ceiling=1.0) == Decision(True, "ok")
    assert g.admit(0.0, ceiling=0.9) == Decision(False, "kv_cache")  # 0.85 ≥ 0.9 × 0.9
    g.observe(reading(10, kv_usage=0.9), requested_at=0.1, now=0.1)
    assert g.admit(0.1) == Decision(False, "kv_cache")
    g = gate(capacity=100, kv_ceiling=None)
    g.observe(reading(10, kv_usage=1.0), requested_at=0.0, now=0.0)
    assert g.admit(0.0).admit


def test_a_class_below_one_leaves_room_for_the_classes_above() -> None:
    g = gate(capacity=10, allowance=1)
    g.observe(reading(8), requested_at=0.0, now=0.0)
    assert g.admit(0.0, ceiling=0.9).admit
    g.dispatched(0.0)  # 9 running
    assert g.admit(0.0, ceiling=0.9) == Decision(False, "capacity")
    send(g, 0.0, 2)  # interactive fills the batch and the allowance
    assert g.admit(0.0) == Decision(False, "engine_queue")


def test_a_small_engine_still_serves_every_class() -> None:
    """⌊0.5 × 1⌋ = 0 would starve the class: it gets one at least."""
    g = gate(capacity=1)
    g.observe(reading(0), requested_at=0.0, now=0.0)
    assert g.admit(0.0, ceiling=0.5).admit


def test_saturation_shows_the_capacity_and_the_allowance_lets_it_grow_back() -> None:
    g = gate()
    g.observe(reading(5, 3, waiting_for_capacity=3), requested_at=0.0, now=0.0)
    assert (g.capacity(), g.saturated) == (5, True)
    g.observe(reading(6), requested_at=1.0, now=1.0)  # it ran one more, nobody waiting
    assert g.capacity() == 6
    g.observe(reading(4, 1), requested_at=2.0, now=2.0)  # KV-limited now
    assert g.capacity() == 4


def test_waiting_for_other_reasons_or_with_nothing_running_is_no_capacity() -> None:
    g = gate()
    g.observe(reading(3, 2, waiting_for_capacity=0), requested_at=0.0, now=0.0)
    assert (g.capacity(), g.saturated) == (3, False)
    g.observe(reading(0, 7), requested_at=1.0, now=1.0)  # loading: a queue, nothing runs
    assert (g.capacity(), g.saturated) == (3, False)


def test_the_least_known_capacity_wins() -> None:
    g = gate(capacity=8)
    g.observe(reading(2, capacity=6), requested_at=0.0, now=0.0)
    assert g.capacity() == 6
    g.observe(reading(4, 1), requested_at=1.0, now=1.0)
    assert g.capacity() == 4


def test_until_a_capacity_is_known_the_gate_ramps_slots_or_not() -> None:
    """``slots`` is a ceiling, not what the engine runs: with slots 16 and an idle engine
    the gate lets one in (the idle engine's), and then only what it has seen running plus the
    allowance, as with ``auto``."""
    g = gate(slots=16)
    g.observe(reading(0), requested_at=0.0, now=0.0)
    send(g, 0.0, 1)  # an idle engine takes one; nothing seen running yet: no more
    assert g.admit(0.0).reason == "engine_queue"
    g.observe(reading(1), requested_at=0.1, now=0.1)
    send(g, 0.1, 1)  # it ran that one: one more (1 seen running + the allowance)
    assert g.admit(0.1).reason == "engine_queue"
    auto = gate(allowance=2)
    auto.observe(reading(3), requested_at=0.0, now=0.0)
    send(auto, 0.0, 2)  # 3 seen running + the allowance
    assert auto.admit(0.0).reason == "engine_queue"


def test_leases_ramp_as_admit_does_and_stay_within_slots() -> None:
    """Shared in Redis, the gate bounds what every replica holds together: the capacity as
    far as known and the allowance; static dispatch's when stale."""
    g = gate(slots=6, allowance=1, max_age_s=1.0)
    assert g.leases(0.0) == 6  # no reading: the static slots
    g.observe(reading(0), requested_at=0.0, now=0.0)
    assert g.leases(0.0) == 1  # nothing seen running: an idle engine's one
    g.observe(reading(3), requested_at=0.1, now=0.1)
    assert g.leases(0.1) == 4  # 3 seen running + the allowance
    g.observe(reading(4, 2, waiting_for_capacity=2), requested_at=0.2, now=0.2)
    assert g.leases(0.2) == 5  # saturated at 4
    g.observe(reading(9), requested_at=0.3, now=0.3)
    assert g.leases(0.3) == 6  # within the slots
    assert g.leases(5.0) == 6  # stale: the slots


def test_class_leases_hold_a_class_at_its_share_and_at_its_kv_ceiling() -> None:
    g = gate(allowance=1, kv_ceiling=0.9)
    g.observe(reading(6, 1, waiting_for_capacity=1, kv_usage=0.5), requested_at=0.0, now=0.0)
    assert g.leases(0.0) == 7
    assert g.class_leases(0.0, 1.0) is None  # the top class: the leases alone
    assert g.class_leases(0.0, 0.75) == 4  # ⌊0.75 × 6⌋
    g.observe(reading(6, 0, kv_usage=0.7), requested_at=0.1, now=0.1)
    assert g.class_leases(0.1, 0.75) == 4  # 0.7 < 0.75 × 0.9: the share binds
    assert g.class_leases(0.1, 0.5) == 3  # 0.7 ≥ 0.5 × 0.9: what runs, 6; the share, 3
    g.observe(reading(2, 0, kv_usage=0.95), requested_at=0.2, now=0.2)
    assert g.class_leases(0.2, 1.0) == 2  # over the ceiling: no more than it runs
    g.observe(reading(0, 0, kv_usage=0.95), requested_at=0.3, now=0.3)
    assert g.class_leases(0.3, 1.0) == 1  # running nothing, it takes one
    assert g.class_leases(5.0, 0.5) is None  # stale: static dispatch
    ramp = gate()
    ramp.observe(reading(1), requested_at=0.0, now=0.0)
    assert ramp.class_leases(0.0, 0.5) is None  # no capacity known: the ramp is not capped


def test_stale_fallback_of_an_auto_backend_is_what_it_learned() -> None:
    g = gate(fallback_slots=2)
    g.observe(reading(7, 1), requested_at=0.0, now=0.0)
    assert g.fallback() == 7
    assert g.admit(10.0) == Decision(True, "stale")


def test_a_reading_stale_on_arrival_teaches_nothing() -> None:
    g = gate(max_age_s=1.0)
    g.observe(reading(7, 1), requested_at=0.0, now=1.5)
    assert (g.capacity(), g.saturated) == (0, False)


def test_completions_beyond_dispatches_are_a_bug() -> None:
    with pytest.raises(RuntimeError):
        gate().completed(0.0)


@pytest.mark.parametrize(
    "policy",
    [
        {"slots": 0}, {"capacity": 0}, {"allowance": 0}, {"fallback_slots": 0},
        {"max_age_s": 0.0}, {"max_age_s": math.inf}, {"max_age_s": math.nan},
        {"settle_s": -1.0}, {"settle_s": math.nan}, {"kv_ceiling": 0.0}, {"kv_ceiling": 1.5},
    ],
)  # fmt: skip
def test_a_policy_that_could_halt_or_mislead_is_refused(policy: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must"):
        GatePolicy(**policy)  # type: ignore[arg-type]


@pytest.mark.parametrize("ceiling", [0.0, -0.5, 1.01, math.nan])
def test_a_class_ceiling_is_a_fraction(ceiling: float) -> None:
    with pytest.raises(ValueError, match="ceiling"):
        gate().admit(0.0, ceiling=ceiling)


def test_dispatch_times_are_kept_only_as_long_as_a_reading_can_be_fresh() -> None:
    g = gate(max_age_s=1.0, settle_s=0.0)
    for i in range(1000):
        g.dispatched(i * 0.01)
        g.completed(i * 0.01)
    assert len(g._times) <= 102


# --- properties on random sequences ----------------------------------------------------

CEILINGS = (0.25, 0.5, 0.9, 1.0)

policies = st.builds(
    GatePolicy,
    slots=st.none() | st.integers(1, 12),
    capacity=st.none() | st.integers(1, 12),
    allowance=st.integers(1, 3),
    max_age_s=st.sampled_from([0.5, 2.0]),
    kv_ceiling=st.none() | st.sampled_from([0.5, 0.9, 1.0]),
    fallback_slots=st.integers(1, 4),
    settle_s=st.sampled_from([0.0, 0.05, 0.3]),
)
readings = st.builds(
    EngineReading,
    running=st.integers(0, 15),
    waiting=st.integers(0, 6),
    waiting_for_capacity=st.none() | st.integers(0, 6),
    kv_usage=st.none() | st.floats(0, 1),
    capacity=st.none() | st.integers(1, 12),
) | st.sampled_from([unavailable("invalid"), unavailable("no_metrics"), unavailable("missing")])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("dispatch"), st.sampled_from(CEILINGS)),
        st.tuples(st.just("complete")),
        st.tuples(st.just("advance"), st.floats(0, 1.5)),
        st.tuples(st.just("observe"), readings, st.floats(0, 1.0), st.floats(0, 0.3)),
    ),
    max_size=60,
)


def run(policy: GatePolicy, script: list[tuple[object, ...]]) -> list[list[Decision]]:
    """Play ``script`` on a gate as a caller would (dispatching only what it admits), checking
    every property at every step; the decisions, for the determinism check."""
    g, now, seen = EngineGate(policy), 0.0, []
    for op in script:
        kind = op[0]
        if kind == "dispatch" and g.admit(now, ceiling=op[1]).admit:  # type: ignore[arg-type]
            g.dispatched(now)
        elif kind == "complete" and g.in_flight > 0:
            g.completed(now)
        elif kind == "advance":
            now += op[1]  # type: ignore[operator]
        elif kind == "observe":
            reply, age = op[2], op[3]  # requested ``age`` ago, answered ``reply`` ago
            g.observe(op[1], now - reply - age, now - reply)  # type: ignore[arg-type,operator]
        decisions = [g.admit(now, ceiling=c) for c in CEILINGS]
        check(g, now, decisions)
        seen.append(decisions)
    return seen


def check(g: EngineGate, now: float, decisions: list[Decision]) -> None:
    policy = g.policy
    # never beyond the static slots, never admitted at them
    if policy.slots is not None:
        assert g.in_flight <= policy.slots
        if g.in_flight >= policy.slots:
            assert not any(d.admit for d in decisions)
    # monotone in the class's ceiling: a higher class is admitted whenever a lower one is
    admitted = [d.admit for d in decisions]
    assert admitted == sorted(admitted)
    est = g.estimate(now)
    if est is None:
        # stale or missing: static dispatch, never below the static slots, never halted
        static = policy.slots if policy.slots is not None else policy.fallback_slots
        if g.in_flight < static:
            assert all(d.admit for d in decisions)
        assert all(d.reason in ("stale", "slots") for d in decisions)
    else:
        # fresh: never more than the allowance waiting in the engine
        if est.waiting > policy.allowance or est.load + 1 > est.capacity + policy.allowance:
            assert not any(d.admit for d in decisions) or est.load == 0
        for d in decisions:
            if d.admit:
                after = est.load + 1 - min(est.load + 1, est.capacity)
                assert est.load == 0 or after <= policy.allowance
        if est.load == 0 and (policy.slots is None or g.in_flight < policy.slots):
            assert all(d.admit for d in decisions)  # an idle engine takes one
    check_leases(g, now, est)


def check_leases(g: EngineGate, now: float, est: Estimate | None) -> None:
    """What the replicas sharing Redis may hold together (``leases``, ``class_leases``):
    at least one, never beyond the static slots; stale, static dispatch's; fresh, at most
    the allowance beyond the capacity; lower for a lower class, never zero."""
    policy, leases = g.policy, g.leases(now)
    limits = [g.class_leases(now, c) for c in CEILINGS]
    assert leases >= 1
    if policy.slots is not None:
        assert leases <= policy.slots
    if est is None:
        assert leases == g.fallback()
        assert limits == [None] * len(CEILINGS)
    else:
        assert leases <= est.capacity + policy.allowance
        bounds = [math.inf if limit is None else limit for limit in limits]
        assert bounds == sorted(bounds)
        assert min(bounds) >= 1


@fast
@given(policies, ops)
def test_the_gate_keeps_its_promises_on_any_sequence(
    policy: GatePolicy, script: list[tuple[object, ...]]
) -> None:
    run(policy, script)


@fast
@given(policies, ops)
def test_the_gate_is_deterministic(policy: GatePolicy, script: list[tuple[object, ...]]) -> None:
    assert run(policy, script) == run(policy, script)


@fast
@given(
    st.builds(
        GatePolicy,
        slots=st.none() | st.integers(1, 40),
        capacity=st.none() | st.integers(1, 32),
        allowance=st.integers(1, 3),
        kv_ceiling=st.none() | st.floats(0.1, 1.0),
    ),
    st.builds(
        EngineReading,
        running=st.integers(0, 20),
        waiting=st.integers(0, 2),
        waiting_for_capacity=st.none() | st.just(0),
        kv_usage=st.none() | st.floats(0, 1),
        capacity=st.none() | st.integers(1, 32),
    ),
    st.integers(0, 4),
    st.floats(0.01, 1.0),
    st.floats(0.01, 1.0),
)
def test_a_higher_class_is_admitted_whenever_a_lower_one_is(
    policy: GatePolicy, got: EngineReading, sent: int, a: float, b: float
) -> None:
    """One fresh state, any two ceilings: monotone, and a ceiling of 1 admits whatever any
    does (a stale reading ignores the classes)."""
    g = EngineGate(policy)
    g.observe(got, requested_at=0.0, now=0.0)
    for _ in range(sent):
        g.dispatched(0.0)
    low, high = sorted((a, b))
    if g.admit(0.0, ceiling=low).admit:
        assert g.admit(0.0, ceiling=high).admit
        assert g.admit(0.0, ceiling=1.0).admit


# --- a simulated engine behind an endless backlog ---------------------------------------


@dataclass
class SimulatedEngine:
    """FIFO; runs ``capacity`` requests at once; a request runs its duration once started."""

    capacity: int
    running: int = 0
    waiting: deque[float] = field(default_factory=deque)
    most_waiting: int = 0


@dataclass
class Trace:
    scrapes: list[tuple[float, int, int]] = field(default_factory=list)  # time, running, waiting
    full_time: float = 0.0  # time the engine ran at capacity, after it first did
    first_full: float | None = None


def simulate(
    capacity: int,
    policy: GatePolicy,
    random: Random,
    *,
    interval: float,
    transit: float,
    tail: float,
    horizon: float,
    durations: tuple[float, float],
    make: Callable[[GatePolicy], EngineGate] = EngineGate,
) -> Trace:
    """A request reaches the engine within ``transit``, its end reaches the proxy within
    ``tail``, and either half of a scrape takes up to ``transit`` (each drawn anew)."""
    engine, g, trace = SimulatedEngine(capacity), make(policy), Trace()
    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def at(t: float, kind: str, data: object = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    def dispatch(now: float) -> None:
        while g.admit(now).admit:
            g.dispatched(now)
            at(now + random.uniform(0, transit), "arrive", random.uniform(*durations))

    def start(now: float) -> None:
        while engine.running < engine.capacity and engine.waiting:
            engine.running += 1
            at(now + engine.waiting.popleft(), "finish")
        engine.most_waiting = max(engine.most_waiting, len(engine.waiting))

    at(0.0, "scrape")
    dispatch(0.0)
    last = 0.0
    while events:
        now, _, kind, data = heapq.heappop(events)
        if now > horizon:
            break
        if trace.first_full is not None and engine.running == capacity:
            trace.full_time += now - last
        last = now
        if kind == "arrive":
            engine.waiting.append(data)  # type: ignore[arg-type]
            start(now)
        elif kind == "finish":
            engine.running -= 1
            start(now)
            at(now + random.uniform(0, tail), "notify")
        elif kind == "notify":
            g.completed(now)
            dispatch(now)
        elif kind == "scrape":
            at(now + random.uniform(0, transit), "snapshot", now)
            at(now + interval * random.uniform(0.5, 1.5), "scrape")
        elif kind == "snapshot":
            trace.scrapes.append((now, engine.running, len(engine.waiting)))
            got = reading(engine.running, len(engine.waiting))
            at(now + random.uniform(0, transit), "answer", (got, data))
        elif kind == "answer":
            got, requested_at = data  # type: ignore[misc]
            g.observe(got, requested_at, now)
            dispatch(now)
        if trace.first_full is None and engine.running == capacity:
            trace.first_full = now
        assert len(engine.waiting) <= policy.allowance, (now, kind, engine.waiting)
    return trace


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 12),
    allowance=st.integers(1, 3),
    known=st.booleans(),
    interval=st.floats(0.05, 0.5),
    delay=st.floats(0.0, 0.05),
    seed=st.integers(0, 2**32),
)
def test_a_simulated_engine_queues_at_most_the_allowance_and_its_batch_fills(
    capacity: int,
    allowance: int,
    known: bool,
    interval: float,
    delay: float,
    seed: int,
) -> None:
    """With the delays within ``settle_s``: the engine never holds more than the allowance
    waiting (checked at every event, scrapes included), its batch reaches K, and once it
    has, it runs full most of the time (the rest is turnover inside the settle window)."""
    policy = GatePolicy(capacity=capacity if known else None, allowance=allowance, settle_s=0.05)
    horizon = 30.0 + 2 * capacity * interval  # an auto backend ramps by the allowance a reading
    trace = simulate(
        capacity, policy, Random(seed), interval=interval, transit=delay, tail=delay,
        horizon=horizon,
        durations=(1.0, 4.0),
    )  # fmt: skip
    assert all(waiting <= allowance for _, _, waiting in trace.scrapes)
    assert trace.first_full is not None
    assert any(running == capacity for _, running, _ in trace.scrapes)
    assert trace.full_time >= 0.8 * (horizon - trace.first_full)


class WindowOnly(EngineGate):
    """No ghosts: only the settle window holds completions back."""

    def observe(self, reading: EngineReading, requested_at: float, now: float) -> None:
        super().observe(reading, requested_at, now)
        self._ghosts = 0


class CreditSinceRequest(WindowOnly):
    """The credit as first sketched: every completion since the scrape was requested is
    credited, so one the reading had already dropped is taken off twice."""

    def observe(self, reading: EngineReading, requested_at: float, now: float) -> None:
        super().observe(reading, requested_at, now)
        if self.requested_at == requested_at:
            self._count_from = requested_at


def _caught(make: Callable[[GatePolicy], EngineGate], tail: float) -> int:
    """In how many of 10 runs the engine held more than the allowance waiting."""
    policy = GatePolicy(capacity=4, allowance=1, settle_s=0.05)
    caught = 0
    for seed in range(10):
        try:
            simulate(
                4, policy, Random(seed), interval=0.2, transit=0.05, tail=tail,
                horizon=30.0, durations=(1.0, 4.0), make=make,
            )  # fmt: skip
        except AssertionError:
            caught += 1
    return caught


def test_the_simulation_catches_a_credit_that_counts_completions_twice() -> None:
    """Completions heard within the window: the window alone suffices, and without it (nor
    ghosts) the engine queues beyond the allowance."""
    assert _caught(WindowOnly, tail=0.05) == 0
    assert _caught(CreditSinceRequest, tail=0.05) >= 5


def test_ghosts_hold_back_completions_heard_late() -> None:
    """Completions heard up to 0.3 s late against a 0.05 s window: the window alone lets
    the engine queue beyond the allowance, the ghosts do not."""
    assert _caught(WindowOnly, tail=0.3) >= 5
    assert _caught(EngineGate, tail=0.3) == 0


def test_ghosts_are_the_requests_in_flight_a_reading_cannot_show() -> None:
    g = gate(settle_s=0.0)
    for _ in range(5):
        g.dispatched(0.0)
    g.observe(reading(3), requested_at=1.0, now=1.0)  # two of the five finished, unheard
    assert g._ghosts == 2
    g.completed(1.1)
    g.completed(1.1)
    assert g.estimate(1.1) == Estimate(running=3, waiting=0, capacity=3, credit=0)
    g.completed(1.2)  # one the reading showed running
    assert g.estimate(1.2) == Estimate(running=2, waiting=0, capacity=3, credit=-1)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 12),
    allowance=st.integers(1, 3),
    interval=st.floats(0.05, 0.5),
    tail=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_however_late_completions_are_heard_the_engine_queues_at_most_the_allowance(
    capacity: int, allowance: int, interval: float, tail: float, seed: int
) -> None:
    """The proxy alone in front of the engine, dispatches reaching it within the window:
    the bound needs no assumption on when completions are heard, and the batch reaches K."""
    policy = GatePolicy(allowance=allowance, settle_s=0.05)
    trace = simulate(
        capacity, policy, Random(seed), interval=interval, transit=0.05, tail=tail,
        horizon=40.0 + 2 * capacity * interval, durations=(1.0, 4.0),
    )  # fmt: skip
    assert trace.first_full is not None


def test_a_class_below_one_sending_alone_still_ramps_and_then_keeps_its_share() -> None:
    """A ceiling applies to a known capacity: batch at 0.75 alone on an engine of 8 ramps
    (a ceiling applied to the ramp held it at ⌊0.75 × 1⌋ = 1 for ever, on a real vLLM), and
    once the engine has shown its 8 (running 8, one waiting), batch stays at 6 as its
    requests end."""
    g, now, most = gate(), 0.0, 0
    for _ in range(40):  # a reading a second; once it is known, a request ends after each
        now += 1.0
        running, waiting = min(g.in_flight, 8), max(0, g.in_flight - 8)
        g.observe(reading(running, waiting), requested_at=now, now=now)
        while g.admit(now, 0.75).admit:
            g.dispatched(now)
        most, held = max(most, g.in_flight), g.in_flight
        if g.bounded():
            g.completed(now + 0.5)
    assert most == 9  # it ramped to the engine's batch and the allowance
    assert g.capacity() == 8
    assert held == 6  # then 0.75 × 8
