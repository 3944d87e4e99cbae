"""A provider's 429s and rate-limit headers slow its pool (core/throttle.py), on a fake clock.

Sans-I/O: time is a number the test passes in; headers are a plain dict of lower-case names.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec
from sfq_proxy.core.limits import Rate
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket
from sfq_proxy.core.throttle import (
    RATE_LIMITED,
    REQUESTS_EXHAUSTED,
    TOKENS_EXHAUSTED,
    Throttle,
    duration,
    seconds,
)

fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1s", 1.0), ("6m0s", 360.0), ("20ms", 0.02), ("1h2m3.5s", 3723.5), ("0.5", 0.5),
        ("2m59.56s", 179.56), ("7.66s", 7.66), (" 3s ", 3.0), ("0s", 0.0),
    ],
)  # fmt: skip
def test_a_reset_is_read_as_providers_write_it(text: str, expected: float) -> None:
    assert duration(text) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text", [None, "", "abc", "s", "1x", "1s garbage", "-1s", "nan", "inf", "1e999", "1" * 100]
)
def test_a_malformed_reset_is_none(text: str | None) -> None:
    assert duration(text) is None


@pytest.mark.parametrize("text", [None, "", "abc", "-1", "nan", "NaN", "inf", "-inf", "1e400",
                                  "Wed, 21 Oct 2015 07:28:00 GMT"])  # fmt: skip
def test_a_retry_after_that_is_not_a_finite_number_of_seconds_is_none(text: str | None) -> None:
    assert seconds(text) is None


def test_a_429_pauses_until_its_retry_after_ms_which_wins_over_seconds() -> None:
    throttle = Throttle()
    reason = throttle.observe(429, {"retry-after-ms": "300", "retry-after": "5"}, 0.0, 10.0)
    assert reason == RATE_LIMITED
    assert throttle.wait(10.0) == pytest.approx(0.3)
    assert throttle.wait(10.3) == 0.0
    assert throttle.throttled == {RATE_LIMITED: 1}


def test_a_429_with_retry_after_seconds_pauses_that_long() -> None:
    throttle = Throttle()
    throttle.observe(429, {"retry-after": "2"}, 0.0, 10.0)
    assert throttle.wait(10.0) == 2.0


def test_a_429_without_retry_after_backs_off_doubling_per_429_in_a_row_up_to_the_cap() -> None:
    throttle = Throttle(backoff_base_s=1.0, max_pause_s=60.0)
    pauses = []
    now = 0.0
    for _ in range(9):
        throttle.observe(429, {}, now, now)  # each sent after the last cut: all fresh
        pauses.append(throttle.wait(now))
        now = throttle.paused_until
    assert pauses == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    throttle.observe(200, {}, now, now)  # any other answer ends the run
    throttle.observe(429, {}, now, now)
    assert throttle.wait(now) == 1.0


def test_a_pause_is_never_shortened_by_a_later_shorter_one() -> None:
    throttle = Throttle()
    throttle.observe(429, {"retry-after": "10"}, 0.0, 0.0)
    throttle.observe(429, {"retry-after-ms": "100"}, 0.0, 1.0)
    assert throttle.paused_until == 10.0


def test_a_429_halves_the_factor_once_per_round_and_it_grows_back_after_the_pause() -> None:
    throttle = Throttle(recover_per_s=0.05)
    throttle.observe(429, {"retry-after": "1"}, 0.0, 10.0)
    assert throttle.factor(10.0) == 0.5
    # four more 429s of requests sent before the cut (at the old rate): no further cut
    for sent in (1.0, 5.0, 9.0, 9.9):
        throttle.observe(429, {"retry-after": "1"}, sent, 10.5)
    assert throttle.factor(10.5) == 0.5
    assert throttle.factor(11.0) == 0.5  # the pause ends at 11: recovery starts there
    assert throttle.factor(16.0) == pytest.approx(0.75)
    assert throttle.factor(21.0) == 1.0
    assert throttle.factor(1000.0) == 1.0
    # a request sent after the cut and still refused: the rate is still too high
    throttle.observe(429, {"retry-after": "1"}, 10.6, 12.0)
    assert throttle.factor(12.0) == pytest.approx(0.5 * (0.5 + 0.05 * 1.0))


def test_the_factor_never_goes_below_its_floor() -> None:
    throttle = Throttle(min_factor=1 / 16)
    for i in range(20):
        throttle.observe(429, {"retry-after": "0"}, float(i), float(i))
    assert throttle.factor(19.0) == 1 / 16


def test_below_a_factor_of_one_dispatches_are_spaced_at_the_reduced_rate() -> None:
    rate = Rate.of(120, 6000)  # 2 requests a second, 100 tokens a second
    throttle = Throttle(recover_per_s=0.0)
    throttle.dispatched(10, 0.0, rate)
    assert throttle.wait(0.0) == 0.0  # at a factor of 1 the buckets alone pace
    throttle.observe(429, {"retry-after": "0"}, 0.0, 0.0)  # factor 0.5: 1 request a second
    throttle.dispatched(10, 0.0, rate)
    assert throttle.wait(0.0) == 1.0
    throttle.dispatched(300, 1.0, rate)  # 300 tokens at 50 a second: 6 s
    assert throttle.wait(1.0) == 6.0
    throttle.dispatched(10, 7.0, None)  # no configured rate: no spacing
    assert throttle.wait(7.0) == 0.0


@pytest.mark.parametrize(("kind", "why"), [("requests", REQUESTS_EXHAUSTED),
                                           ("tokens", TOKENS_EXHAUSTED)])  # fmt: skip
def test_remaining_zero_holds_until_its_reset(kind: str, why: str) -> None:
    throttle = Throttle()
    headers = {f"x-ratelimit-remaining-{kind}": "0", f"x-ratelimit-reset-{kind}": "200ms"}
    assert throttle.observe(200, headers, 0.0, 5.0) == why
    assert throttle.wait(5.0) == pytest.approx(0.2)
    assert throttle.factor(5.0) == 1.0  # not a refusal: the rate is not cut
    assert throttle.throttled == {why: 1}


def test_remaining_above_zero_or_unreadable_holds_nothing() -> None:
    throttle = Throttle()
    for remaining in ("1", "4999", "abc", "nan", ""):
        headers = {"x-ratelimit-remaining-requests": remaining, "x-ratelimit-reset-requests": "6m"}
        assert throttle.observe(200, headers, 0.0, 0.0) is None
    assert throttle.wait(0.0) == 0.0
    assert not throttle.throttled


def test_remaining_zero_with_a_bad_reset_holds_the_default_and_a_huge_one_the_cap() -> None:
    throttle = Throttle(exhausted_hold_s=1.0, max_pause_s=60.0)
    throttle.observe(200, {"x-ratelimit-remaining-requests": "0",
                           "x-ratelimit-reset-requests": "soon"}, 0.0, 0.0)  # fmt: skip
    assert throttle.wait(0.0) == 1.0
    throttle.observe(200, {"x-ratelimit-remaining-requests": "0",
                           "x-ratelimit-reset-requests": "999999h"}, 0.0, 0.0)  # fmt: skip
    assert throttle.wait(0.0) == 60.0


@pytest.mark.parametrize("value", ["1e308", "inf", "-5", "NaN", "abc", "999999999999999999999",
                                   "-0", "1" * 5000, "\x00", "1e-400"])  # fmt: skip
def test_an_adversarial_retry_after_pauses_at_most_the_cap(value: str) -> None:
    for name in ("retry-after", "retry-after-ms"):
        throttle = Throttle(max_pause_s=60.0)
        throttle.observe(429, {name: value}, 0.0, 0.0)
        assert 0.0 <= throttle.wait(0.0) <= 60.0


header_values = st.one_of(
    st.text(max_size=80),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers().map(str),
    st.builds(
        lambda n, u: f"{n}{u}",
        st.floats(min_value=0, allow_infinity=True),
        st.sampled_from(["h", "m", "s", "ms", "us", "ns", "d"]),
    ),
)
names = st.sampled_from([
    "retry-after", "retry-after-ms", "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens",
])  # fmt: skip


@fast
@given(
    answers=st.lists(
        st.tuples(
            st.sampled_from([200, 429, 500, 503]),
            st.dictionaries(names, header_values, max_size=6),
            st.floats(min_value=0, max_value=1e6),
        ),
        max_size=20,
    )
)
def test_any_headers_give_a_pause_within_the_cap_and_a_factor_within_its_bounds(
    answers: list[tuple[int, dict[str, str], float]],
) -> None:
    throttle = Throttle(max_pause_s=60.0, min_factor=1 / 16)
    rate = Rate.of(60, 1000)
    now = 0.0
    for status, headers, step in answers:
        now += step
        throttle.observe(status, headers, now - step, now)
        wait = throttle.wait(now)
        assert 0.0 <= wait <= 60.0
        assert math.isfinite(wait)
        assert 1 / 16 <= throttle.factor(now) <= 1.0
        throttle.dispatched(1.0, now, rate)
        assert 0.0 <= throttle.wait(now) <= 60.0
    assert throttle.wait(now + 60.0) == 0.0  # never frozen: 60 s on, the pool dispatches


def test_a_pause_at_the_cap_waits_the_cap_not_an_ulp_more() -> None:
    """(now + 60) - now is 60.000000000000114 at this now: the pause is still the cap."""
    now = 970.6836150568391
    throttle = Throttle(max_pause_s=60.0)
    throttle.observe(429, {"retry-after": "3600"}, now, now)
    assert throttle.wait(now) == 60.0


def _scheduler(throttle: Throttle, rate: Rate | None = None) -> Scheduler:
    placement = Placement([BackendSpec(url="http://b", slots=8)])
    return Scheduler(placement, throttle=throttle, rate=rate)


def test_the_scheduler_holds_every_dispatch_during_a_pause_and_keeps_the_order() -> None:
    throttle = Throttle()
    scheduler = _scheduler(throttle)
    first = Ticket(org="A", cls="batch", cost=1.0)
    assert scheduler.submit(first, 0.0) == [first]
    throttle.observe(429, {"retry-after-ms": "300"}, 0.0, 0.1)
    queued = [Ticket(org=o, cls="batch", cost=1.0) for o in "BCB"]
    for ticket in queued:
        assert scheduler.submit(ticket, 0.2) == []
    assert scheduler.wake_at == pytest.approx(0.4)
    assert scheduler.pump(0.39) == []
    out = scheduler.pump(0.4)
    assert [t.org for t in out] == ["B", "C", "B"]  # SFQ's order, only later


def test_the_scheduler_paces_at_the_reduced_rate_after_a_429() -> None:
    throttle = Throttle(recover_per_s=0.0)
    scheduler = _scheduler(throttle, Rate.of(600, None, burst_s=1.0))  # 10 a second
    throttle.observe(429, {"retry-after": "1"}, 0.0, 0.0)  # factor 0.5: 5 a second
    tickets = [Ticket(org="A", cls="batch", cost=1.0) for _ in range(3)]
    for ticket in tickets:
        scheduler.submit(ticket, 0.5)
    assert scheduler.wake_at == 1.0
    assert scheduler.pump(1.0) == tickets[:1]
    assert scheduler.wake_at == pytest.approx(1.2)
    assert scheduler.pump(1.2) == tickets[1:2]


def test_state_shows_the_pause_the_factor_and_the_effective_rate() -> None:
    throttle = Throttle(recover_per_s=0.0)
    throttle.observe(429, {"retry-after": "2"}, 0.0, 0.0)
    state = throttle.state(0.5, Rate.of(600, 60000))
    assert state == {
        "paused_for_s": 1.5,
        "rate_factor": 0.5,
        "effective_requests_per_minute": 300.0,
        "effective_tokens_per_minute": 30000.0,
        "throttled": {"429": 1},
    }
    assert throttle.state(0.0, None)["effective_requests_per_minute"] is None
