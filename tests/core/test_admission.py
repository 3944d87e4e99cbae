"""Admission (core/admission.py): whether a request may wait at all, in the order of
docs/design.md §6, and what a refused one takes (nothing).
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from sfq_proxy.config import parse_config
from sfq_proxy.core.admission import Admission
from sfq_proxy.core.errors import ApiError
from sfq_proxy.core.flows import Flow


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
            "system": {
                "priority": True,
                "max_in_flight": 2,
                "max_queue_age_s": 5,
                "max_queue_len": 2,
            },
            "bulk": {},  # no max_queue_len
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
        assert (refused.status, refused.code in ("rpm", "tpm")) == (429, True)
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
    assert rejection(adm, A, key="key-1").code == "rpm"
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
    adm.admit(C_SYSTEM, 1, 1, None, 0.0)  # system: max_queue_len 2, counted in the band
    assert rejection(adm, C_SYSTEM, queued=2).code == "queue_full"
    adm.admit(Flow("c", "bulk", "prov"), 1, 10**6, None, 0.0)  # bulk has no max_queue_len


def test_rejections_are_checked_in_order_409_queue_full_rate() -> None:
    adm = admission(orgs={"a": {"rpm": 1}})
    adm.admit(A, 1, 0, "key-1", 0.0)  # the org's bucket is now empty
    assert rejection(adm, A, queued=5, key="key-1").status == 409
    assert rejection(adm, A, queued=5, key="key-2").code == "queue_full"
    assert rejection(adm, A, queued=4, key="key-2").code == "rpm"


def test_org_rate_limit_429_with_the_bucket_wait_as_retry_after() -> None:
    adm = admission(orgs={"a": {"rpm": 10}})
    assert admitted(adm, A, 25) == 10
    err = rejection(adm, A)
    assert (err.status, err.code, err.retry_after) == (429, "rpm", 6.0)
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
    assert adm.may_retry(A, 1, 1.0) is True
    assert adm.may_retry(A, 1, 1.0) is False
    assert adm.may_retry(B, 1, 1.0) is False  # b sent nothing
    assert adm.may_retry(A_INTERACTIVE, 1, 1.0) is False  # another class: another flow
    assert admitted(adm, A, 10, now=2.0) == 10
    assert adm.may_retry(A, 1, 2.0) is True
    assert adm.may_retry(A, 1, 61.0) is False  # 10 requests of 2.0 s, 1 retry of 2.0 s left


def test_may_retry_uses_the_configured_ratio() -> None:
    adm = admission(budget_ratio=0.5)
    assert admitted(adm, A, 4) == 4
    assert [adm.may_retry(A, 1, 0.0) for _ in range(3)] == [True, True, False]
    never = admission(budget_ratio=0.0)
    assert admitted(never, A, 100) == 100
    assert never.may_retry(A, 1, 0.0) is False


def test_rejected_requests_do_not_count_for_the_retry_budget() -> None:
    adm = admission(orgs={"a": {"rpm": 9}})
    assert admitted(adm, A, 20) == 9
    for _ in range(10):
        rejection(adm, A, queued=5)
    assert adm.may_retry(A, 1, 0.0) is False  # 9 admitted: 0.9 of a retry
    adm.admit(A, 1, 0, None, 30.0)
    assert adm.may_retry(A, 1, 30.0) is True


def test_retry_budget_is_per_pool_flow() -> None:
    adm = admission()
    assert admitted(adm, A_LOCAL, 10) == 10
    assert adm.may_retry(A, 1, 0.0) is False  # nothing was sent to pool prov


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
    assert rejection(adm, A, tokens=500).code == "tpm"
    assert rejection(adm, B, tokens=500).code == "tpm"  # the pool's is empty too
    adm.refund(A, 1000, 0.0)  # e.g. the backend answered 400 at once
    adm.admit(A, 1000, 0, None, 0.0)


def test_a_million_admitted_requests_keep_the_retry_budget_bounded() -> None:
    """O(1) memory per flow: what admission keeps for the retry budget does not grow with
    the requests it has seen (one timestamp each, never dropped without a retry, did)."""
    adm = admission()
    for n in range(1_000_000):
        adm.admit(A, 1, 0, None, n / 1000)  # 1,000 a second for 1,000 s
    assert len(adm._budgets[A]) <= 62
    assert adm.may_retry(A, 1, 1000.0)


def test_a_retry_pays_like_a_request_from_the_orgs_and_the_pools_buckets() -> None:
    """A retry used to skip the org's rpm/tpm and the pool's intake: a flow could multiply
    its rate by retrying. Now it takes its tokens too, all at once or not at all."""
    adm = admission(orgs={"a": {"rpm": 3}}, budget_ratio=1.0)
    adm.admit(A, 1, 0, None, 0.0)
    adm.admit(A, 1, 0, None, 0.0)  # room for two retries in the budget
    assert adm.may_retry(A, 1, 0.0) is True  # the org's third request this minute
    assert adm.may_retry(A, 1, 0.0) is False  # out of rpm, though the budget has room
    assert rejection(adm, A).code == "rpm"  # the retry used the org's rate
    assert adm.may_retry(A, 1, 20.0) is True  # a token back after 20 s
    tpm = admission(orgs={"a": {"tpm": 1000}}, pool_rate={"tokens_per_minute": 1500},
                    budget_ratio=1.0)  # fmt: skip
    tpm.admit(A, 600, 0, None, 0.0)
    assert tpm.may_retry(A, 600, 0.0) is False  # the org's 400 left are not enough
    assert tpm.admit(B, 900, 0, None, 0.0) == {}  # the refused retry took nothing
    assert tpm.may_retry(B, 100, 0.0) is False  # the pool has none left for b either


def test_an_admitted_request_is_told_its_orgs_limits_after_its_take() -> None:
    adm = admission(orgs={"a": {"rpm": 60, "tpm": 6000}})
    assert adm.admit(A, 300, 0, None, 0.0) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5700",
        "x-ratelimit-reset-tokens": "3s",
    }
    assert adm.admit(B, 300, 0, None, 0.0) == {}  # an org without limits: no headers
    only_rpm = admission(orgs={"a": {"rpm": 60}}, pool_rate={"tokens_per_minute": 900})
    assert set(only_rpm.admit(A, 300, 0, None, 0.0)) == {  # the pool's are not the org's
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }


def test_a_429_names_the_bucket_that_refused_and_carries_its_headers() -> None:
    adm = admission(orgs={"a": {"rpm": 60, "tpm": 600}})
    adm.admit(A, 590, 0, None, 0.0)
    err = rejection(adm, A, tokens=20)  # 10 tokens short: 1 s; requests are plenty
    assert (err.code, err.retry_after, err.reason) == ("tpm", 1.0, "rate")
    assert "org 'a' allows 600 tokens per minute (tpm)" in err.message
    assert err.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "600",
        "x-ratelimit-remaining-tokens": "10",
        "x-ratelimit-reset-tokens": "59s",
        "Retry-After": "1",
    }


def test_a_pools_bucket_refuses_in_its_own_name() -> None:
    adm = admission(orgs={"a": {"rpm": 600}}, pool_rate={"requests_per_minute": 1})
    adm.admit(B, 1, 0, None, 0.0)
    err = rejection(adm, A)
    assert (err.code, err.retry_after) == ("rpm", 60.0)
    assert "pool 'prov' allows 1 requests per minute (rate.requests_per_minute)" in err.message
    assert err.headers()["x-ratelimit-limit-requests"] == "1"  # the pool's, which refused
