"""The SFQ core's guarantees (docs/design.md §3; the SFQ article §2.7, §3 and §7.5)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, example, find, given, settings
from hypothesis import strategies as st
from sfq_harness import Op, QueueLike, ReferenceSFQ, Trace, check_band, check_pairwise, run

from sfq_proxy.core.fair_queue import MAX_COST, MAX_WEIGHT, MIN_WEIGHT, FairQueue

FLOWS = ["a", "b", "c", "d"]
Make = Callable[[], QueueLike]

# Dyadic costs and power-of-two weights keep every charge exact in floats, in the core's
# fixed-point meters and in the reference's fractions, so the two can be compared exactly.
costs = st.integers(1, 64).map(lambda k: k / 4)
weight_maps = st.fixed_dictionaries({f: st.sampled_from([0.5, 1.0, 2.0, 4.0]) for f in FLOWS})
op = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(FLOWS), costs),
    st.tuples(st.just("front"), st.sampled_from(FLOWS), costs),
    st.tuples(st.just("pop")),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.sampled_from(FLOWS), st.integers(0, 50)),
    st.tuples(st.just("elig"), st.sampled_from(FLOWS), st.booleans()),
    # a running request ends: its actual cost unknown, or anything from nothing to far more
    # than any estimate (an arbitrary function of the request, unknown to the estimator)
    st.tuples(
        st.just("settle"),
        st.sampled_from(FLOWS),
        st.integers(0, 50),
        st.none() | st.integers(0, 1024).map(lambda k: k / 4),
    ),
    st.tuples(st.just("settle"), st.sampled_from(FLOWS), st.integers(0, 50), st.none()),
)
op_lists = st.lists(op, max_size=250)
fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the worked example -----------------------------------------------------------------------


def test_worked_example_of_section_2_7_row_by_row() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(10):
        q.push("A", i, 3)
        q.push("B", i, 1)
    rows = []
    for _ in range(8):
        flow, _ = q.pop()
        rows.append((q.virtual_time, flow, q.meter("A"), q.meter("B")))
    assert rows == [
        (0, "A", 3, 0),
        (0, "B", 3, 1),
        (1, "B", 3, 2),
        (2, "B", 3, 3),
        (3, "A", 6, 3),
        (3, "B", 6, 4),
        (4, "B", 6, 5),
        (5, "B", 6, 6),
    ]


# -- random interleavings ---------------------------------------------------------------------


@fast
@given(ops=op_lists, weights=weight_maps)
def test_band_and_pairwise_bounds_hold(ops: list[Op], weights: dict[str, float]) -> None:
    trace = run(FairQueue(), ops, weights)
    check_band(trace)
    check_pairwise(trace)


@fast
@given(ops=op_lists, weights=weight_maps)
# a refund after the period's last dispatch: the next period starts at its highest meter
@example(
    ops=[("push", "a", 0.25), ("pop",), ("settle", "a", 0, 0.0)], weights=dict.fromkeys("abcd", 0.5)
)
def test_agrees_with_the_naive_reference(ops: list[Op], weights: dict[str, float]) -> None:
    fast_trace = run(FairQueue(), ops, weights)
    slow_trace = run(ReferenceSFQ(), ops, weights)
    assert fast_trace.dispatches == slow_trace.dispatches
    for (v1, flows1), (v2, flows2) in zip(fast_trace.states, slow_trace.states, strict=True):
        assert v1 == v2
        for flow, (backlog, _, meter) in flows1.items():
            if backlog:
                assert meter == flows2[flow][2]


@fast
@given(ops=op_lists, weights=weight_maps)
def test_renormalisation_changes_nothing(ops: list[Op], weights: dict[str, float]) -> None:
    every_step = run(FairQueue(renormalize_at=1), ops, weights)
    never = run(FairQueue(renormalize_at=None), ops, weights)
    assert every_step == never


@fast
@given(ops=op_lists, weights=weight_maps)
def test_same_operations_same_dispatch_order(ops: list[Op], weights: dict[str, float]) -> None:
    assert run(FairQueue(), ops, weights) == run(FairQueue(), ops, weights)


@fast
@given(ops=op_lists, weights=weight_maps)
def test_every_request_leaves_exactly_once(ops: list[Op], weights: dict[str, float]) -> None:
    q: FairQueue[int] = FairQueue()
    run(q, ops, weights)  # checks FIFO per flow and the queue length at every step
    pushed = {i for i, o in enumerate(ops) if o[0] in ("push", "front")}
    for flow in FLOWS:
        q.set_eligible(flow, True)
    drained = []
    while (got := q.pop()) is not None:
        drained.append(got[1])
    assert len(q) == 0
    assert len(drained) == len(set(drained))
    assert set(drained) <= pushed


class PeekingQueue(FairQueue[int]):
    """Checks before every pop that ``peek`` announced exactly what ``pop`` returns."""

    def pop(self) -> tuple[str, int] | None:
        announced = self.peek()
        got = super().pop()
        assert got == announced
        return got


@fast
@given(ops=op_lists, weights=weight_maps)
def test_peek_announces_pop_and_changes_nothing(ops: list[Op], weights: dict[str, float]) -> None:
    assert run(PeekingQueue(), ops, weights) == run(FairQueue(), ops, weights)


def test_front_push_is_next_in_its_flow_but_waits_for_the_flows_turn() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "a1", 1.0)
    q.push("a", "a2", 1.0)
    q.push("b", "b1", 1.0)
    assert q.pop() == ("a", "a1")
    q.push("a", "a1-retry", 1.0, front=True)
    assert [q.pop() for _ in range(3)] == [("b", "b1"), ("a", "a1-retry"), ("a", "a2")]


# -- the five regression properties of §7.5 ---------------------------------------------------


def equal_costs_counts_within_one(make: Make) -> None:
    q = make()
    for flow in "abc":
        for i in range(50):
            q.push(flow, i, 2.0)
    counts: Counter[str] = Counter()
    while all(q.backlog(f) for f in "abc"):
        counts[q.pop()[0]] += 1
        assert max(counts[f] for f in "abc") - min(counts[f] for f in "abc") <= 1, counts


def ten_times_cost_gets_a_tenth(make: Make) -> None:
    q = make()
    for i in range(300):
        q.push("heavy", i, 10.0)
    for i in range(3000):
        q.push("light", i, 1.0)
    counts = Counter(q.pop()[0] for _ in range(1100))
    # |10·n_heavy − n_light| ≤ 2·c_max with n_heavy + n_light = 1100 → n_heavy ∈ [98.2, 101.8]
    assert 99 <= counts["heavy"] <= 101, counts


def no_credit_banked_while_idle(make: Make) -> None:
    q = make()
    for i in range(1000):
        q.push("busy", i, 1.0)
    for _ in range(500):
        q.pop()
    for i in range(100):
        q.push("away", i, 1.0)
    assert q.meter("away") == q.virtual_time
    counts: Counter[str] = Counter()
    for _ in range(100):
        counts[q.pop()[0]] += 1
        assert abs(counts["away"] - counts["busy"]) <= 2 * 1.0, counts  # within 2·c_max


def one_at_a_time_gains_nothing(make: Make) -> None:
    """A flow that re-sends only once its queue drained (named to win ties) gets no more."""
    q = make()
    for i in range(1000):
        q.push("b-backlogged", i, 1.0)
    q.push("a-trickle", 0, 1.0)
    served: Counter[str] = Counter()
    for i in range(1, 400):
        flow, _ = q.pop()
        served[flow] += 1
        if flow == "a-trickle":
            q.push("a-trickle", i, 1.0)
        assert served["a-trickle"] <= served["b-backlogged"] + 2 * 1.0, served


def everyone_starts_level_after_global_idle(make: Make) -> None:
    q = make()
    q.push("a", 0, 100.0)
    q.push("b", 0, 1.0)
    q.pop()
    q.pop()
    q.settle("a", 100.0)
    q.settle("b", 1.0)  # nothing waits, nothing runs: the busy period is over
    assert len(q) == 0
    for i in range(1, 5):
        q.push("a", i, 1.0)
        q.push("b", i, 1.0)
    assert q.meter("a") == q.meter("b") == q.virtual_time
    assert [q.pop()[0] for _ in range(8)] == ["a", "b"] * 4


def hidden_cost_gets_its_share(make: Make) -> None:
    """A flow whose requests are estimated at 1 but do 10 (a field the estimator does not
    read, say) gets a tenth of the dispatches once each is trued up at its end, as one whose
    estimate was right would (``ten_times_cost_gets_a_tenth``). One slot: each request ends
    before the next is dispatched."""
    q = make()
    for i in range(300):
        q.push("hidden", i, 1.0)
    for i in range(3000):
        q.push("light", i, 1.0)
    counts: Counter[str] = Counter()
    for _ in range(1100):
        flow, _ = q.pop()
        counts[flow] += 1
        q.settle(flow, 1.0, 10.0 if flow == "hidden" else 1.0)
    # as above, with the hidden flow's charge its debt included: 10 a request
    assert 99 <= counts["hidden"] <= 101, counts


def work_in_service_is_remembered(make: Make) -> None:
    """A request dispatched straight into a free slot leaves its flow's queue empty, yet the
    busy period goes on while it runs: its flow does not start level with the others."""
    q = make()
    q.push("a-big", 0, 2510.0)
    assert q.pop() == ("a-big", 0)
    q.push("b", 0, 10.0)
    q.push("a-big", 1, 10.0)  # named to win ties
    assert [q.pop()[0] for _ in range(2)] == ["b", "a-big"]


PROPERTIES = [
    equal_costs_counts_within_one,
    ten_times_cost_gets_a_tenth,
    no_credit_banked_while_idle,
    one_at_a_time_gains_nothing,
    everyone_starts_level_after_global_idle,
    hidden_cost_gets_its_share,
    work_in_service_is_remembered,
]


@pytest.mark.parametrize("prop", PROPERTIES)
@pytest.mark.parametrize("make", [FairQueue, ReferenceSFQ], ids=["fast", "reference"])
def test_section_7_5_property(prop: Callable[[Make], None], make: Make) -> None:
    prop(make)


@fast
@given(n_flows=st.integers(2, 6), cost=costs, depth=st.integers(1, 40))
def test_equal_costs_any_number_of_flows(n_flows: int, cost: float, depth: int) -> None:
    q: FairQueue[int] = FairQueue()
    names = [f"f{i}" for i in range(n_flows)]
    for name in names:
        for i in range(depth):
            q.push(name, i, cost)
    counts = dict.fromkeys(names, 0)
    while len(q):
        counts[q.pop()[0]] += 1
        assert max(counts.values()) - min(counts.values()) <= 1


# -- the checkers can fail ----------------------------------------------------------------------


BROKEN = {
    "rejoin resets the meter to v": lambda: ReferenceSFQ(join="reset"),
    "no global-idle reset": lambda: ReferenceSFQ(idle_reset=False),
    "charge at push": lambda: ReferenceSFQ(charge_at="push"),
    "estimates are final (no true-up)": lambda: ReferenceSFQ(true_up=False),
    "the busy period ends when the queue empties": lambda: ReferenceSFQ(busy_while_running=False),
}
CAUGHT_BY = {
    "rejoin resets the meter to v": one_at_a_time_gains_nothing,
    "no global-idle reset": everyone_starts_level_after_global_idle,
    "charge at push": equal_costs_counts_within_one,
    "estimates are final (no true-up)": hidden_cost_gets_its_share,
    "the busy period ends when the queue empties": work_in_service_is_remembered,
}


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_variant_is_caught(variant: str) -> None:
    with pytest.raises(AssertionError):
        CAUGHT_BY[variant](BROKEN[variant])


def _fails(check: Callable[[Trace], None], make: Make, ops: list[Op]) -> bool:
    weights = dict.fromkeys(FLOWS, 1.0)
    try:
        check(run(make(), ops, weights))
    except AssertionError:
        return True
    return False


def test_band_checker_finds_charging_at_push_on_its_own() -> None:
    make = BROKEN["charge at push"]
    found = find(
        op_lists, lambda ops: _fails(check_band, make, ops), settings=settings(database=None)
    )
    assert not _fails(check_band, FairQueue, found)


def test_pairwise_checker_judges_a_known_unfair_run_unfair() -> None:
    """Charging at push serves the shorter queue until it drains while the other waits."""
    ops: list[Op] = [("push", "a", 1.0)] * 5 + [("push", "b", 1.0)] * 4 + [("pop",)] * 4
    assert _fails(check_pairwise, BROKEN["charge at push"], ops)
    assert not _fails(check_pairwise, FairQueue, ops)


# -- the details -----------------------------------------------------------------------------


def test_removed_request_is_never_charged() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("a", "big", 50.0)
    q.push("a", "small", 1.0)
    before = q.meter("a")
    assert q.remove("a", "big")
    assert q.meter("a") == before
    assert q.pop() == ("a", "small")
    assert q.meter("a") == before + 1.0
    assert not q.remove("a", "big")
    assert not q.remove("nobody", "big")


def test_ineligible_flow_keeps_its_place_and_rejoins_at_v() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(10):
        q.push("a", i, 1.0)
        q.push("b", i, 1.0)
    q.set_eligible("a", False)
    meter_a = q.meter("a")
    assert [q.pop()[0] for _ in range(4)] == ["b"] * 4
    assert q.meter("a") == meter_a
    assert q.backlog("a") == 10
    q.set_eligible("a", True)
    assert q.meter("a") == q.virtual_time  # max(S, v): no credit for the time it was capped
    assert q.pop() == ("a", 0)


def test_pop_is_none_when_only_ineligible_flows_wait() -> None:
    q: FairQueue[int] = FairQueue()
    q.push("a", 1, 1.0)
    q.set_eligible("a", False)
    assert q.pop() is None
    assert len(q) == 1
    q.set_eligible("a", True)
    assert q.pop() == ("a", 1)
    assert q.pop() is None


def test_ineligibility_outlives_the_flow_state() -> None:
    q: FairQueue[int] = FairQueue()
    q.set_eligible("a", False)
    q.push("a", 1, 1.0)
    assert q.pop() is None
    assert not q.is_eligible("a")


def test_weights_divide_the_charge() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(300):
        q.push("heavy-weight", i, 1.0, weight=2.0)
        q.push("light-weight", i, 1.0, weight=1.0)
    counts = Counter(q.pop()[0] for _ in range(300))
    assert abs(counts["heavy-weight"] - 2 * counts["light-weight"]) <= 3, counts


def test_state_of_idle_flows_is_forgotten_at_global_idle() -> None:
    q: FairQueue[int] = FairQueue()
    for n in range(1000):
        q.push(f"flow-{n}", n, 1.0)
    assert len(q.flows()) == 1000
    while (got := q.pop()) is not None:
        assert q.flows()  # a flow in service is remembered
        q.settle(got[0], 1.0)
    assert q.flows() == []
    assert q.virtual_time == 1.0  # the largest finish tag of the busy period just closed
    assert repr(q) == "<FairQueue v=1 | 0 flows, 0 queued, 0 ineligible>"


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, -math.inf, True, "3", None])
def test_invalid_cost_or_weight_raises_and_changes_nothing(bad: object) -> None:
    q: FairQueue[int] = FairQueue()
    q.push("a", 0, 2.0)
    snapshot = (len(q), q.virtual_time, q.flows())
    with pytest.raises(ValueError, match="cost must be"):
        q.push("a", 1, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight must be"):
        q.push("b", 1, 1.0, weight=bad)  # type: ignore[arg-type]
    assert (len(q), q.virtual_time, q.flows()) == snapshot
    assert Fraction(q.meter("a")) == 0


def test_set_weight_changes_the_charges_still_to_come() -> None:
    q: FairQueue[int] = FairQueue()
    for i in range(3):
        q.push("a", i, 6.0, weight=1.0)
    q.pop()
    assert q.meter("a") == 6.0
    q.set_weight("a", 3.0)  # e.g. a config reload
    q.pop()
    assert q.meter("a") == 6.0 + 2.0
    q.set_weight("nobody", 2.0)  # a flow not tracked: nothing to change
    with pytest.raises(ValueError, match="weight must be"):
        q.set_weight("a", 0)


# -- exception safety: an operation that raises changes nothing ---------------------------------

EXTREMES = [0, -1, -0.0, math.nan, math.inf, -math.inf, 1e305, 10**400, 1e-300, 2e15, True, "1"]
bad_values = st.sampled_from(EXTREMES)
valid_weights = st.sampled_from([MIN_WEIGHT, 0.5, 1.0, 4.0, MAX_WEIGHT])
risky_op = st.one_of(
    op,
    st.tuples(st.just("push"), st.sampled_from(FLOWS), bad_values),
    st.tuples(st.just("push_w"), st.sampled_from(FLOWS), costs, bad_values),
    st.tuples(st.just("weight"), st.sampled_from(FLOWS), bad_values),
    st.tuples(st.just("weight"), st.sampled_from(FLOWS), valid_weights),
    st.tuples(st.just("settle"), st.sampled_from(FLOWS), st.integers(0, 3), bad_values),
)


def _snapshot(q: FairQueue[int]) -> tuple[object, ...]:
    return (len(q), q.virtual_time, q.flows(), q.peek(), repr(q))


def _apply(q: FairQueue[int], step: tuple[object, ...], n: int, popped: list[object]) -> None:
    """One operation of ``risky_op`` on ``q``; ``n`` makes every pushed item distinct."""
    kind, *args = step
    if kind in ("push", "front"):
        q.push(args[0], n, args[1], front=kind == "front")  # type: ignore[arg-type]
    elif kind == "push_w":
        q.push(args[0], n, args[1], weight=args[2])  # type: ignore[arg-type]
    elif kind == "weight":
        q.set_weight(args[0], args[1])  # type: ignore[arg-type]
    elif kind == "pop":
        popped.append(q.pop())
    elif kind == "remove":
        q.remove(args[0], args[1])  # type: ignore[arg-type]
    elif kind == "settle":  # raises unless the flow has a request running
        q.settle(args[0], 1.0, args[2])  # type: ignore[arg-type]
    else:
        q.set_eligible(args[0], args[1])  # type: ignore[arg-type]


@fast
@given(st.lists(risky_op, max_size=200))
def test_an_operation_that_raises_leaves_the_queue_as_it_was(ops: list[tuple]) -> None:
    """Extreme and non-finite values on every operation: each one either succeeds or raises
    ValueError before any change, so the queue then behaves exactly as one that never saw it
    (what a bad request once did to a pool: taken off its flow, then overflowed)."""
    q: FairQueue[int] = FairQueue()
    clean: FairQueue[int] = FairQueue()
    popped: list[object] = []
    clean_popped: list[object] = []
    for n, step in enumerate(ops):
        before = _snapshot(q)
        try:
            _apply(q, step, n, popped)
        except ValueError:
            assert _snapshot(q) == before, step
            continue
        _apply(clean, step, n, clean_popped)
        assert _snapshot(q) == _snapshot(clean)
    while (item := q.pop()) is not None:
        popped.append(item)
    while (item := clean.pop()) is not None:
        clean_popped.append(item)
    assert popped == clean_popped


def test_the_extreme_valid_charge_is_finite_and_orders_as_usual() -> None:
    """The largest cost at the smallest weight still makes an exact integer charge."""
    q: FairQueue[str] = FairQueue()
    q.push("huge", "h1", MAX_COST, weight=MIN_WEIGHT)
    q.push("huge", "h2", MAX_COST, weight=MIN_WEIGHT)
    q.push("tiny", "t1", 1.0, weight=MAX_WEIGHT)
    q.push("tiny", "t2", 1.0, weight=MAX_WEIGHT)
    assert [q.pop() for _ in range(4)] == [
        ("huge", "h1"), ("tiny", "t1"), ("tiny", "t2"), ("huge", "h2")
    ]  # fmt: skip
    assert math.isfinite(q.virtual_time)
    assert len(q) == 0


@pytest.mark.parametrize("bad", [MAX_COST * 2, 10**400, 1e305])
def test_costs_above_the_maximum_are_refused(bad: float) -> None:
    q: FairQueue[int] = FairQueue()
    with pytest.raises(ValueError, match="cost must be"):
        q.push("a", 1, bad)
    assert len(q) == 0
    assert q.flows() == []


@pytest.mark.parametrize("bad", [MIN_WEIGHT / 2, MAX_WEIGHT * 2, 1e-300])
def test_weights_beyond_their_range_are_refused(bad: float) -> None:
    q: FairQueue[int] = FairQueue()
    q.push("a", 1, 1.0)
    with pytest.raises(ValueError, match="weight must be"):
        q.set_weight("a", bad)
    with pytest.raises(ValueError, match="weight must be"):
        q.push("a", 2, 1.0, weight=bad)
    assert q.pop() == ("a", 1)
    assert q.meter("a") == 1.0
