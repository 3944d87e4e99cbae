"""Placement (core/placement.py): which backend of a pool, within its slots and health."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.placement import Backend, Placement, share


def placement(*slots: int) -> Placement:
    return Placement(
        [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots, 1)]
    )


def fill(p: Placement, backend: Backend, n: int) -> None:
    for _ in range(n):
        p.acquire(backend)


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


# --- failure streaks (health.consecutive_failures) --------------------------------------


def test_a_streak_below_the_threshold_keeps_the_backend_in() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=3)
    (a,) = p.backends
    assert p.record_failure(a, until=10.0) is False
    assert p.record_failure(a, until=11.0) is False
    assert (a.healthy, a.failures, a.down_until) == (True, 2, 0.0)
    assert p.choose() is a
    assert p.record_failure(a, until=12.0) is True  # the third in a row takes it out
    assert (a.healthy, a.down_until) == (False, 12.0)
    assert p.choose() is None


def test_a_success_ends_the_streak() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=2)
    (a,) = p.backends
    for _ in range(5):  # failure, success, failure, ...: never two in a row
        assert p.record_failure(a, until=10.0) is False
        p.record_success(a)
    assert (a.healthy, a.failures) == (True, 0)


def test_one_failure_is_enough_by_default() -> None:
    p = placement(1)
    (a,) = p.backends
    assert p.record_failure(a, until=5.0) is True
    assert p.record_failure(a, until=7.0) is False  # already out: not taken out again
    assert (a.healthy, a.down_until) == (False, 7.0)  # but its cooldown runs from the last


def test_failures_while_out_push_the_cooldown_back() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=2)
    (a,) = p.backends
    p.record_failure(a, until=1.0)
    p.record_failure(a, until=2.0)
    assert a.down_until == 2.0
    p.record_failure(a, until=9.0)  # a request still running on it failed too
    assert a.down_until == 9.0
    assert p.mark_up(a, now=8.0) is False


def test_a_success_while_out_does_not_bring_it_back_early() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=2)
    (a,) = p.backends
    p.record_failure(a, until=1.0)
    p.record_failure(a, until=10.0)
    p.record_success(a)  # an answer from a request that was still running on it
    assert (a.healthy, a.failures) == (False, 0)
    assert p.record_failure(a, until=20.0) is False  # the new streak is too short to
    assert a.down_until == 10.0  # push the cooldown back
    assert p.mark_up(a, now=10.0) is True


def test_back_after_the_cooldown_with_a_fresh_streak() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=2)
    (a,) = p.backends
    p.record_failure(a, until=1.0)
    p.record_failure(a, until=5.0)
    assert p.mark_up(a, now=5.0) is True
    assert (a.healthy, a.failures) == (True, 0)
    assert p.record_failure(a, until=6.0) is False  # one failure is not a streak of two
    assert p.record_failure(a, until=7.0) is True


def test_the_threshold_can_change_on_a_reload() -> None:
    p = Placement([BackendSpec(url="http://a:1", slots=1)], failures_to_down=5)
    (a,) = p.backends
    assert p.record_failure(a, until=1.0) is False
    p.failures_to_down = 2
    assert p.record_failure(a, until=1.0) is True  # the streak so far counts


@given(slots=st.integers(1, 1000), index=st.integers(0, 50), holders=st.integers(1, 64))
def test_the_shares_of_a_backend_add_up_to_its_slots_evenly(
    slots: int, index: int, holders: int
) -> None:
    """Redis lost: every replica fills its share alone, so the shares must never add up to
    more than the slots (nor, wasting them, less), and no replica gets more than one above
    another."""
    parts = [share(slots, index, holders, rank) for rank in range(holders)]
    assert sum(parts) == slots
    assert max(parts) - min(parts) <= 1


def test_the_remainders_go_to_different_replicas_on_different_backends() -> None:
    """Three 1-slot backends and three replicas: one each, not all to the first."""
    assert [[share(1, i, 3, rank) for i in range(3)] for rank in range(3)] == [
        [1, 0, 0],
        [0, 1, 0],
        [0, 0, 1],
    ]


def test_a_share_limits_choose_and_acquire() -> None:
    """The local scheduler of a shared pool dispatches within its share: 0 is none."""
    p = placement(4)
    (b,) = p.backends
    b.share = 0
    assert p.choose() is None
    b.share = 2
    fill(p, b, 2)
    assert p.choose() is None
    with pytest.raises(RuntimeError):
        p.acquire(b)
    b.share = None  # all of its slots again
    assert p.choose() is b
