"""Rate, concurrency and retry limits: token buckets, the retry budget, admission and the
scheduler's strict band, in-flight caps and rate pacing (docs/design.md §3, §5, §6).

Everything here is sans-I/O: time is a number the test passes in. Rates are chosen so
that every wait is exact in binary floating point, and is compared with ``==``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfq_proxy.config import BackendSpec, parse_config
from sfq_proxy.core.admission import Admission
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.fair_queue import MAX_COST, MIN_WEIGHT
from sfq_proxy.core.flows import Flow
from sfq_proxy.core.limits import Rate, RetryBudget, TokenBucket
from sfq_proxy.core.placement import Placement
from sfq_proxy.core.scheduler import Scheduler, Ticket

fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- TokenBucket ------------------------------------------------------------------------------


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


# -- Rate -------------------------------------------------------------------------------------


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


# -- RetryBudget ------------------------------------------------------------------------------


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


# -- Admission --------------------------------------------------------------------------------


def admission(
    orgs: dict[str, dict[str, float]] | None = None,
    pool_rate: dict[str, float] | None = None,
    budget_ratio: float = 0.1,
) -> Admission:
    """An Admission over a config with a rate-limited pool ``prov`` and a free pool ``local``."""
    prov: dict[str, Any] = {"models": ["m-prov"], "backends": [{"url": "http://p:1", "slots": 4}]}
    if pool_rate is not None:
        prov["rate"] = pool_rate
    data: dict[str, Any] = {
        "keys": [
            {"key": f"k-{org}", "org": org, "classes": ["batch", "interactive", "system"]}
            for org in ("a", "b", "c")
        ],
        "classes": {
            "system": {"priority": True, "max_in_flight": 2},
            "interactive": {"weight": 6, "max_queue_len": 3},
            "batch": {"max_queue_len": 5},
        },
        "orgs": orgs or {},
        "pools": {
            "prov": prov,
            "local": {"models": ["m-local"], "backends": [{"url": "http://l:1", "slots": 4}]},
        },
        "retry": {"budget_ratio": budget_ratio},
    }
    return Admission(parse_config(yaml.safe_dump(data), environ={}))


A = Flow("a", "batch", "prov")
A_INTERACTIVE = Flow("a", "interactive", "prov")
A_LOCAL = Flow("a", "batch", "local")
B = Flow("b", "batch", "prov")
C = Flow("c", "batch", "prov")
C_LOCAL = Flow("c", "batch", "local")
C_SYSTEM = Flow("c", "system", "prov")


def rejection(
    adm: Admission,
    flow: Flow,
    tokens: float = 1,
    queued: int = 0,
    key: str | None = None,
    now: float = 0.0,
) -> ApiError:
    """The rejection of one request that must not be admitted."""
    with pytest.raises(ApiError) as caught:
        adm.admit(flow, tokens, queued, key, now)
    return caught.value


def admitted(adm: Admission, flow: Flow, n: int, tokens: float = 1, now: float = 0.0) -> int:
    """How many of ``n`` requests at ``now`` are admitted; the rest must be rate limited."""
    count = 0
    for _ in range(n):
        try:
            adm.admit(flow, tokens, 0, None, now)
        except ApiError as err:
            refused = err
        else:
            count += 1
            continue
        assert (refused.status, refused.code) == (429, "rate_limited")
    return count


def test_duplicate_idempotency_key_of_the_same_org_is_409_while_active() -> None:
    adm = admission()
    adm.admit(A, 1, 0, "key-1", 0.0)
    err = rejection(adm, A, key="key-1")
    assert (err.status, err.retry_after) == (409, None)
    # the key belongs to the org: another class or pool of the same org is a duplicate too
    assert rejection(adm, A_INTERACTIVE, key="key-1").status == 409
    assert rejection(adm, A_LOCAL, key="key-1").status == 409
    adm.admit(B, 1, 0, "key-1", 0.0)  # another org's key of the same name is unrelated
    adm.admit(A, 1, 0, "key-2", 0.0)
    adm.admit(A, 1, 0, None, 0.0)
    adm.admit(A, 1, 0, None, 0.0)  # no key: never a duplicate


def test_idempotency_key_is_free_again_after_done() -> None:
    adm = admission()
    adm.admit(A, 1, 0, "key-1", 0.0)
    adm.done(A, "key-1")
    adm.admit(A, 1, 0, "key-1", 1.0)
    assert rejection(adm, A, key="key-1", now=1.0).status == 409
    adm.done(B, "key-1")  # another org's done frees nothing of a's
    assert rejection(adm, A, key="key-1", now=1.0).status == 409
    adm.done(A, None)  # harmless


def test_a_rejected_request_does_not_hold_its_idempotency_key() -> None:
    adm = admission(orgs={"a": {"rpm": 1}})
    adm.admit(A, 1, 0, None, 0.0)
    assert rejection(adm, A, key="key-1").code == "rate_limited"
    assert rejection(adm, A, queued=5, key="key-2").code == "queue_full"
    adm.admit(A, 1, 0, "key-1", 60.0)  # not a 409: the rejected one never became active
    adm.admit(A, 1, 0, "key-2", 120.0)


def test_queue_full_when_the_flow_queue_reaches_max_queue_len() -> None:
    adm = admission()
    adm.admit(A, 1, 4, None, 0.0)  # batch: max_queue_len 5
    for queued in (5, 6, 1000):
        err = rejection(adm, A, queued=queued)
        assert (err.status, err.code, err.retry_after) == (429, "queue_full", 1.0)
    adm.admit(A_INTERACTIVE, 1, 2, None, 0.0)  # interactive: max_queue_len 3
    assert rejection(adm, A_INTERACTIVE, queued=3).code == "queue_full"
    adm.admit(C_SYSTEM, 1, 10**6, None, 0.0)  # system has no max_queue_len


def test_rejections_are_checked_in_order_409_queue_full_rate() -> None:
    adm = admission(orgs={"a": {"rpm": 1}})
    adm.admit(A, 1, 0, "key-1", 0.0)  # the org's bucket is now empty
    assert rejection(adm, A, queued=5, key="key-1").status == 409
    assert rejection(adm, A, queued=5, key="key-2").code == "queue_full"
    assert rejection(adm, A, queued=4, key="key-2").code == "rate_limited"


def test_org_rate_limit_429_with_the_bucket_wait_as_retry_after() -> None:
    adm = admission(orgs={"a": {"rpm": 10}})
    assert admitted(adm, A, 25) == 10
    err = rejection(adm, A)
    assert (err.status, err.code, err.retry_after) == (429, "rate_limited", 6.0)
    assert rejection(adm, A, now=4.5).retry_after == 1.5
    assert admitted(adm, A, 5, now=6.0) == 1


def test_org_tokens_per_minute_limit_with_retry_after() -> None:
    adm = admission(orgs={"a": {"tpm": 1000}})
    assert admitted(adm, A, 10, tokens=300) == 3
    assert rejection(adm, A, tokens=300).retry_after == 12.0  # 200 missing × 60 / 1000
    assert admitted(adm, A, 10, tokens=100) == 1


def test_retry_after_is_the_longer_of_the_org_and_pool_waits() -> None:
    adm = admission(orgs={"a": {"rpm": 6}}, pool_rate={"requests_per_minute": 5})
    assert admitted(adm, A, 10) == 5  # the pool (5) runs out before the org (6)
    assert rejection(adm, A).retry_after == 12.0  # pool: 60 / 5; the org has one left
    adm = admission(orgs={"a": {"rpm": 6}}, pool_rate={"requests_per_minute": 60})
    assert admitted(adm, A, 10) == 6  # the org runs out first
    assert rejection(adm, A).retry_after == 10.0  # org: 60 / 6
    adm = admission(orgs={"a": {"rpm": 6}}, pool_rate={"requests_per_minute": 6})
    assert admitted(adm, A, 10) == 6  # both empty: the same wait
    assert rejection(adm, A).retry_after == 10.0


def test_a_rejected_request_takes_no_tokens() -> None:
    adm = admission(orgs={"a": {"rpm": 3, "tpm": 1000}})
    for _ in range(10):
        assert rejection(adm, A, queued=5).code == "queue_full"
    adm.admit(A, 1, 0, "dup", 0.0)
    for _ in range(10):
        assert rejection(adm, A, key="dup").status == 409
    # 999 tokens left: a 1000-token request is refused by tpm and takes no request either
    assert rejection(adm, A, tokens=1000).retry_after == 0.06
    assert admitted(adm, A, 10) == 2  # 3 per minute, one spent by "dup" only


def test_a_request_refused_by_one_bucket_takes_nothing_from_the_other() -> None:
    adm = admission(orgs={"a": {"rpm": 2}}, pool_rate={"requests_per_minute": 5})
    assert admitted(adm, A, 10) == 2  # org a's bucket refuses the other 8
    assert admitted(adm, C, 10) == 3  # so the pool still had 3 for org c
    adm = admission(orgs={"a": {"rpm": 5}}, pool_rate={"requests_per_minute": 2})
    assert admitted(adm, A, 10) == 2  # the pool refuses a's other 8
    assert admitted(adm, A_LOCAL, 10) == 3  # so a's own bucket lost 2, not 10


def test_org_buckets_are_per_org() -> None:
    adm = admission(orgs={"a": {"rpm": 2}, "b": {"rpm": 3}})
    assert admitted(adm, A, 10) == 2
    assert admitted(adm, B, 10) == 3
    assert admitted(adm, C, 50) == 50  # c has no limit
    # an org's bucket covers all its classes and pools
    assert admitted(adm, A_INTERACTIVE, 5) == 0
    assert admitted(adm, A_LOCAL, 5) == 0


def test_the_pool_bucket_is_shared_by_every_org_of_the_pool() -> None:
    adm = admission(pool_rate={"requests_per_minute": 30, "tokens_per_minute": 100000})
    total = sum(admitted(adm, flow, 1) for _ in range(20) for flow in (A, B, C))
    assert total == 30
    for flow in (A, B, C, C_SYSTEM):
        assert rejection(adm, flow).retry_after == 2.0
    assert admitted(adm, C_LOCAL, 100) == 100  # another pool is not limited by it


def test_pool_tokens_per_minute_are_shared_too() -> None:
    adm = admission(pool_rate={"tokens_per_minute": 1000})
    assert admitted(adm, A, 1, tokens=400) == 1
    assert admitted(adm, B, 1, tokens=400) == 1
    assert rejection(adm, C, tokens=400).retry_after == 12.0


def test_may_retry_follows_the_flow_budget() -> None:
    adm = admission(budget_ratio=0.1)
    assert admitted(adm, A, 10) == 10
    assert adm.may_retry(A, 1.0) is True
    assert adm.may_retry(A, 1.0) is False
    assert adm.may_retry(B, 1.0) is False  # b sent nothing
    assert adm.may_retry(A_INTERACTIVE, 1.0) is False  # another class: another flow
    assert admitted(adm, A, 10, now=2.0) == 10
    assert adm.may_retry(A, 2.0) is True
    assert adm.may_retry(A, 61.0) is False  # 10 requests of 2.0 s, 1 retry of 2.0 s left


def test_may_retry_uses_the_configured_ratio() -> None:
    adm = admission(budget_ratio=0.5)
    assert admitted(adm, A, 4) == 4
    assert [adm.may_retry(A, 0.0) for _ in range(3)] == [True, True, False]
    never = admission(budget_ratio=0.0)
    assert admitted(never, A, 100) == 100
    assert never.may_retry(A, 0.0) is False


def test_rejected_requests_do_not_count_for_the_retry_budget() -> None:
    adm = admission(orgs={"a": {"rpm": 9}})
    assert admitted(adm, A, 20) == 9
    for _ in range(10):
        rejection(adm, A, queued=5)
    assert adm.may_retry(A, 0.0) is False  # 9 admitted: 0.9 of a retry
    adm.admit(A, 1, 0, None, 30.0)
    assert adm.may_retry(A, 30.0) is True


def test_retry_budget_is_per_pool_flow() -> None:
    adm = admission()
    assert admitted(adm, A_LOCAL, 10) == 10
    assert adm.may_retry(A, 0.0) is False  # nothing was sent to pool prov


# -- Scheduler --------------------------------------------------------------------------------


def placement(*slots: int) -> Placement:
    return Placement(
        [BackendSpec(url=f"http://10.0.0.{i}:8000", slots=n) for i, n in enumerate(slots, 1)]
    )


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
    # the band moved no meter: a and b still wait at the baseline v = 1 set by the idle
    assert (q.virtual_time, q.meter("a/batch"), q.meter("b/batch")) == (1.0, 1.0, 1.0)
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
    assert (q.meter("a/batch"), q.virtual_time, q.meter("b/batch")) == (2.0, 5.0, 6.0)
    assert not q.is_eligible("a/batch")
    # a drops below its cap: it rejoins at max(S, v) = v = 5 and goes before b (6)
    assert sched.finish(a[0], 0.0) == [a[2]]
    assert (q.meter("a/batch"), q.virtual_time) == (6.0, 5.0)
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
    assert (q.meter("a/batch"), q.meter("b/batch"), q.virtual_time) == (2.0, 2.0, 3.0)
    assert sched.finish(i1, 0.0) == []
    # both rejoin at max(S, v) = 3, not at their older meters; the tie goes to a
    assert sched.finish(a1, 0.0) == [a3]
    assert (q.meter("a/batch"), q.meter("b/batch")) == (4.0, 3.0)
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
    """By design (README): a health check must not wait behind its own team's batch."""
    sched = Scheduler(placement(10), org_caps={"ops": 2}, class_caps={"system": 4})
    tickets = [band("ops") for _ in range(3)]
    dispatched = [t for ticket in tickets for t in sched.submit(ticket, 0.0)]
    assert dispatched == tickets
    batch = Ticket(org="ops", cls="batch", cost=1.0)
    assert sched.submit(batch, 0.0) == []  # the org is over its cap for SFQ work
    assert not sched.queue.is_eligible(batch.flow)


# -- property: caps hold and no slot idles while uncapped work waits -----------------------------

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


# -- bounded amounts: one request can neither break a bucket nor overdraw it for years -------


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


def test_a_request_larger_than_a_full_tokens_bucket_is_400_naming_the_limit() -> None:
    """Taken, it would overdraw the bucket: ``max_tokens: 1e7`` against 1,000 tokens a minute
    locked every org of the pool out for hours. It could never fit, so it is refused."""
    adm = admission(orgs={"a": {"tpm": 1000}}, pool_rate={"tokens_per_minute": 5000})
    err = rejection(adm, A, tokens=1001)
    assert (err.status, err.code) == (400, "tokens_exceed_limit")
    assert "1000 tokens per minute of org a" in err.message
    err = rejection(adm, B, tokens=10_000_000)
    assert "5000 tokens per minute of pool prov" in err.message
    assert admitted(adm, B, 5, tokens=1000) == 5  # nothing was taken by the refusals
    assert admitted(adm, A, 1, tokens=1000) == 0  # b used the pool's bucket up


def test_a_refund_gives_the_org_and_the_pool_their_tokens_back() -> None:
    adm = admission(orgs={"a": {"tpm": 1000}}, pool_rate={"tokens_per_minute": 1000})
    adm.admit(A, 1000, 0, None, 0.0)
    assert rejection(adm, A, tokens=500).code == "rate_limited"
    assert rejection(adm, B, tokens=500).code == "rate_limited"  # the pool's is empty too
    adm.refund(A, 1000, 0.0)  # e.g. the backend answered 400 at once
    adm.admit(A, 1000, 0, None, 0.0)


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
