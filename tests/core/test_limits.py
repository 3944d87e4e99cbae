"""Rate limits and the retry budget (core/limits.py): token buckets and a sliding window.

Sans-I/O: time is a number the test passes in. Rates are chosen so that every wait is
exact in binary floating point, and is compared with ``==``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.core.limits import (
    BucketState,
    Rate,
    RetryBudget,
    TokenBucket,
    format_reset,
    rate_limited,
)
from sfq_proxy.core.throttle import duration

fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_bucket_starts_full_with_a_minute_of_tokens() -> None:
    bucket = TokenBucket(120)
    assert bucket.capacity == bucket.level == 120
    assert bucket.wait(120, 0.0) == 0.0
    bucket.take(120, 0.0)
    assert bucket.level == 0
    assert bucket.wait(1, 0.0) == 0.5  # 1 token × 60 s / 120 per minute


def test_bucket_wait_is_zero_while_enough_then_the_exact_refill_time() -> None:
    bucket = TokenBucket(60)  # one token a second
    bucket.take(50, 0.0)
    assert bucket.wait(10, 0.0) == 0.0
    assert bucket.wait(11, 0.0) == 1.0
    assert bucket.wait(30, 0.0) == 20.0
    big = TokenBucket(600)
    big.take(600, 0.0)
    assert big.wait(1, 0.0) == 0.1
    assert big.wait(450, 0.0) == 45.0


def test_bucket_refills_linearly_up_to_its_capacity() -> None:
    bucket = TokenBucket(60)
    bucket.take(60, 0.0)
    levels = []
    for now in (0.0, 1.0, 2.5, 10.0, 59.0, 60.0, 61.0, 1000.0):
        bucket.wait(0, now)  # refills up to ``now``
        levels.append(bucket.level)
    assert levels == [0.0, 1.0, 2.5, 10.0, 59.0, 60.0, 60.0, 60.0]
    # nothing was banked above the capacity during the long idle
    bucket.take(60, 1000.0)
    assert bucket.wait(1, 1000.0) == 1.0


def test_take_then_wait_then_take_keeps_the_average_rate() -> None:
    bucket = TokenBucket(60)
    bucket.take(60, 0.0)
    now, taken = 0.0, 0
    for _ in range(30):  # take one token as soon as it is there, 30 times
        now += bucket.wait(1, now)
        bucket.take(1, now)
        taken += 1
    assert (now, taken) == (30.0, 30)


def test_an_oversized_take_needs_a_full_bucket_not_an_infinite_wait() -> None:
    bucket = TokenBucket(60)
    bucket.take(20, 0.0)  # 40 left
    assert bucket.wait(1000, 0.0) == 20.0  # until full (60), not until 1000 tokens
    assert bucket.wait(1000, 20.0) == 0.0
    bucket.take(1000, 20.0)
    # the take is paid in full: the bucket is in debt, so the average rate holds
    assert bucket.level == 60 - 1000
    assert bucket.wait(1, 20.0) == 941.0


def test_oversized_requests_are_paced_at_the_average_rate() -> None:
    bucket = TokenBucket(600, burst_s=1.0)  # 10 tokens a second, at most 10 at once
    assert bucket.capacity == 10
    now, starts = 0.0, []
    for _ in range(4):  # 100-token requests: far more than one burst
        now += bucket.wait(100, now)
        bucket.take(100, now)
        starts.append(now)
    assert starts == [0.0, 10.0, 20.0, 30.0]


def test_burst_capacity_is_at_least_one_token() -> None:
    assert TokenBucket(60, burst_s=1.0).capacity == 1
    assert TokenBucket(30, burst_s=1.0).capacity == 1  # half a token would never admit one
    assert TokenBucket(30, burst_s=1.0).wait(1, 0.0) == 0.0


def test_time_going_backwards_adds_no_tokens() -> None:
    bucket = TokenBucket(60)
    bucket.take(60, 10.0)
    assert bucket.wait(1, 5.0) == 1.0  # still one full second of refill missing
    assert (bucket.level, bucket.updated) == (0.0, 10.0)
    bucket.wait(0, 11.0)
    assert bucket.level == 1.0  # refilled from 10 s, not from the earlier 5 s


def test_rate_waits_for_the_slower_of_its_two_buckets() -> None:
    rate = Rate.of(60, 6000)
    for _ in range(60):
        rate.take(50, 0.0)  # requests bucket empty, 3000 tokens left
    assert rate.wait(50, 0.0) == 1.0  # requests dominate
    assert rate.wait(3500, 0.0) == 5.0  # tokens dominate: 500 × 60 / 6000
    assert rate.wait(50, 1.0) == 0.0


def test_rate_take_takes_from_both_buckets() -> None:
    rate = Rate.of(10, 1000)
    assert rate.requests is not None
    assert rate.tokens is not None
    rate.take(300, 0.0)
    assert (rate.requests.level, rate.tokens.level) == (9, 700)


def test_rate_with_only_one_limit_uses_only_that_bucket() -> None:
    requests_only = Rate.of(60, None)
    assert requests_only.tokens is None
    assert requests_only.wait(10**9, 0.0) == 0.0
    tokens_only = Rate.of(None, 600)
    assert tokens_only.requests is None
    for _ in range(100):
        tokens_only.take(6, 0.0)
    assert tokens_only.wait(0, 0.0) == 0.0  # no request count limits it
    assert tokens_only.wait(6, 0.0) == 0.6


def test_rate_without_limits_never_waits() -> None:
    rate = Rate.of(None, None)
    assert (rate.requests, rate.tokens) == (None, None)
    for now in (0.0, 0.0, 1.0, 1e9):
        for _ in range(1000):
            assert rate.wait(10**9, now) == 0.0
            rate.take(10**9, now)


def admit_burst(rate: Rate, n: int, tokens: float, now: float) -> int:
    """How many of ``n`` instantaneous requests the rate admits (checking before taking)."""
    admitted = 0
    for _ in range(n):
        if rate.wait(tokens, now) == 0:
            rate.take(tokens, now)
            admitted += 1
    return admitted


def test_rate_admits_exactly_its_requests_per_minute_in_a_burst() -> None:
    rate = Rate.of(10, None)
    assert admit_burst(rate, 25, 0, 0.0) == 10
    assert rate.wait(0, 0.0) == 6.0
    assert rate.wait(0, 3.0) == 3.0
    assert admit_burst(rate, 25, 0, 3.0) == 0
    assert admit_burst(rate, 25, 0, 6.0) == 1
    assert admit_burst(rate, 25, 0, 18.0) == 2


def test_rate_admits_exactly_its_tokens_per_minute_in_a_burst() -> None:
    rate = Rate.of(None, 1000)
    assert admit_burst(rate, 10, 300, 0.0) == 3
    assert rate.wait(300, 0.0) == 12.0  # 200 missing × 60 / 1000
    assert admit_burst(rate, 10, 100, 0.0) == 1  # the 100 left over from the burst
    assert rate.wait(300, 0.0) == 18.0
    assert admit_burst(rate, 10, 300, 18.0) == 1


def test_rate_burst_seconds_limit_what_goes_at_once() -> None:
    rate = Rate.of(60, 6000, burst_s=1.0)  # 1 request and 100 tokens at once
    assert admit_burst(rate, 10, 10, 0.0) == 1
    assert rate.wait(10, 0.0) == 1.0
    assert admit_burst(rate, 10, 10, 1.0) == 1


def budget_with_requests(n: int, now: float = 0.0, ratio: float = 0.1) -> RetryBudget:
    budget = RetryBudget(ratio, window_s=60.0)
    for _ in range(n):
        budget.record_request(now)
    return budget


def grants(budget: RetryBudget, attempts: int, now: float) -> int:
    return sum(budget.try_retry(now) for _ in range(attempts))


def test_retry_budget_allows_a_tenth_of_the_requests() -> None:
    assert grants(budget_with_requests(9), 5, 1.0) == 0
    ten = budget_with_requests(10)
    assert ten.try_retry(1.0) is True
    assert ten.try_retry(1.0) is False
    assert grants(budget_with_requests(20), 5, 1.0) == 2
    assert grants(budget_with_requests(35), 10, 1.0) == 3


def test_retry_budget_without_requests_allows_nothing() -> None:
    assert grants(RetryBudget(0.1), 3, 0.0) == 0
    assert grants(RetryBudget(1.0), 3, 0.0) == 0
    assert grants(budget_with_requests(100, ratio=0.0), 3, 0.0) == 0


def test_requests_older_than_the_window_leave_the_budget() -> None:
    budget = budget_with_requests(10, now=0.0)
    assert grants(budget, 1, 59.5) == 1
    budget = budget_with_requests(10, now=0.0)
    assert grants(budget, 3, 60.0) == 0  # 60 s old: out of the window
    assert grants(budget, 3, 61.0) == 0  # and it stays gone
    for _ in range(10):
        budget.record_request(61.0)
    assert grants(budget, 3, 61.0) == 1


def test_granted_retries_leave_the_window_too() -> None:
    budget = budget_with_requests(10, now=0.0)
    assert grants(budget, 3, 0.0) == 1
    for _ in range(10):
        budget.record_request(30.0)
    assert grants(budget, 3, 30.0) == 1  # 20 requests, 2 retries in the window
    # at 60 s the first 10 requests and the first retry leave: 10 requests, 1 retry
    assert grants(budget, 3, 60.0) == 0
    # at 90 s everything of 30 s leaves too
    assert grants(budget, 3, 90.0) == 0
    for _ in range(10):
        budget.record_request(90.0)
    assert grants(budget, 3, 90.0) == 1


events = st.lists(
    st.tuples(st.sampled_from(["request", "request", "retry"]), st.integers(0, 25)),
    max_size=300,
)


@fast
@given(ratio=st.sampled_from([0.1, 0.2, 0.25, 0.5, 1.0]), steps=events)
def test_granted_retries_never_exceed_the_ratio_of_the_trailing_window(
    ratio: float, steps: list[tuple[str, int]]
) -> None:
    """Checked at each grant against a log of every event; refusals must be justified too."""
    window = 60
    budget = RetryBudget(ratio, window_s=window)
    requests: list[int] = []
    granted: list[int] = []
    now = 0
    for kind, elapsed in steps:
        now += elapsed  # whole seconds: window edges are exact
        if kind == "request":
            budget.record_request(now)
            requests.append(now)
            continue
        in_window_requests = sum(now - t < window for t in requests)
        in_window_retries = sum(now - t < window for t in granted)
        if budget.try_retry(now):
            granted.append(now)
            assert in_window_retries + 1 <= ratio * in_window_requests
        else:  # a refusal happens only when one more retry would break the ratio
            assert in_window_retries + 1 > ratio * in_window_requests


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 1e19, 10**400, True])
def test_a_bucket_refuses_amounts_it_cannot_count_and_stays_as_it_was(bad: Any) -> None:
    bucket = TokenBucket(600)
    bucket.take(100, 0.0)
    for step in (bucket.wait, bucket.take, bucket.give_back):
        with pytest.raises(ValueError, match="token amount"):
            step(bad, 1.0)
    assert (bucket.level, bucket.updated) == (500, 0.0)


def test_give_back_returns_tokens_up_to_a_full_bucket() -> None:
    bucket = TokenBucket(60)
    bucket.take(50, 0.0)
    bucket.give_back(20, 0.0)
    assert bucket.level == 30
    bucket.give_back(1000, 0.0)
    assert bucket.level == bucket.capacity == 60


@fast
@given(
    ratio=st.sampled_from([0.1, 0.25, 1.0]),
    steps=st.lists(
        st.tuples(st.sampled_from(["request", "request", "retry"]), st.floats(0, 30)),
        max_size=300,
    ),
)
def test_with_fractional_times_the_buckets_never_grant_more_than_the_ratio(
    ratio: float, steps: list[tuple[str, float]]
) -> None:
    """Between whole seconds the one-second buckets may refuse a retry an exact window
    would grant, never the reverse."""
    window = 60.0
    budget = RetryBudget(ratio, window_s=window)
    requests: list[float] = []
    granted: list[float] = []
    now = 0.0
    for kind, elapsed in steps:
        now += elapsed
        if kind == "request":
            budget.record_request(now)
            requests.append(now)
        elif budget.try_retry(now):
            granted.append(now)
            in_window_requests = sum(now - t < window for t in requests)
            in_window_retries = sum(now - t < window for t in granted)
            assert in_window_retries <= ratio * in_window_requests + 1e-9


def test_a_flow_that_never_retries_keeps_a_window_of_buckets_not_a_timestamp_a_request() -> None:
    """A million requests over about 17 minutes: the budget holds one bucket a second of
    its window (it held a million timestamps), and still grants its share."""
    budget = RetryBudget(0.1, window_s=60.0)
    for n in range(1_000_000):
        budget.record_request(n / 1000)  # 1,000 a second
        assert len(budget) <= 62
    assert budget.try_retry(1000.0)


# -- what a client is told: x-ratelimit-* (docs/design.md §6, Rate limits) --------------------


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0.0, "0s"), (-1.0, "0s"), (0.0001, "1ms"), (0.12, "120ms"), (0.9999, "1s"), (1.0, "1s"),
        (1.5, "1.5s"), (59.56, "59.56s"), (60.0, "1m0s"), (179.56, "2m59.56s"), (360.0, "6m0s"),
        (3600.0, "1h0m0s"), (3723.004, "1h2m3.004s"),
    ],
)  # fmt: skip
def test_a_reset_is_written_as_openai_writes_it(seconds: float, written: str) -> None:
    assert format_reset(seconds) == written


@fast
@given(st.floats(min_value=0, max_value=1e7, allow_nan=False))
def test_a_written_reset_reads_back_as_at_least_the_wait_within_a_millisecond(s: float) -> None:
    """The proxy's own reader of providers' resets (core/throttle.py) reads ours."""
    read = duration(format_reset(s))
    assert read is not None
    assert s - 1e-6 <= read + 1e-9
    assert read <= s + 0.001 + 1e-6


def test_a_buckets_state_is_its_limit_whole_tokens_left_and_time_to_full() -> None:
    bucket = TokenBucket(60)  # one a second
    bucket.take(10.5, 0.0)
    assert bucket.state(0.0) == BucketState(60, 49, 10.5)
    assert bucket.state(4.0) == BucketState(60, 53, 6.5)
    assert bucket.state(100.0) == BucketState(60, 60, 0.0)


def test_headers_say_only_the_buckets_there_are() -> None:
    rate = Rate.of(120, None)
    rate.take(1, 0.0)
    assert rate.headers(0.0) == {
        "x-ratelimit-limit-requests": "120",
        "x-ratelimit-remaining-requests": "119",
        "x-ratelimit-reset-requests": "500ms",
    }
    both = Rate.of(0.5, 1500.25)
    assert set(both.headers(0.0)) == {
        f"x-ratelimit-{what}-{which}"
        for what in ("limit", "remaining", "reset")
        for which in ("requests", "tokens")
    }
    assert both.headers(0.0)["x-ratelimit-limit-requests"] == "0.5"
    assert both.headers(0.0)["x-ratelimit-limit-tokens"] == "1500.25"


def test_the_binding_bucket_is_the_one_with_the_longest_wait() -> None:
    rate = Rate.of(60, 600)  # 1 request, 10 tokens a second
    assert rate.binding(10, 0.0) is None
    rate.take(595, 0.0)
    assert rate.binding(10, 0.0) == (0.5, "tokens")  # 5 tokens short: 0.5 s
    for _ in range(59):
        rate.requests.take(1, 0.0)  # type: ignore[union-attr]
    assert rate.binding(10, 0.0) == (1.0, "requests")  # 1 request short: 1 s


def test_a_429_names_its_limit_and_says_the_wait() -> None:
    err = rate_limited("tokens", "org 'a'", "tpm", 1000, 1.25, {"x-ratelimit-limit-tokens": "1"})
    assert (err.status, err.code, err.type, err.retry_after) == (
        429,
        "tpm",
        "rate_limit_error",
        1.25,
    )
    assert err.message == (
        "Rate limit reached: org 'a' allows 1000 tokens per minute (tpm). Try again in 1.25s."
    )
    assert err.headers() == {"x-ratelimit-limit-tokens": "1", "Retry-After": "2"}
    assert rate_limited("requests", "pool 'p'", "rate.requests_per_minute", 5, 1, {}).code == "rpm"
