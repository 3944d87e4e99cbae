"""The admin page's history (``observability/history.py``): bounded whatever the uptime,
merged without losing a unit of cost, and wait quantiles within a bucket of the truth."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from typing import Any

import pytest
from proxy_lab import proxy_config

from sfq_proxy.core.flows import org_and_class
from sfq_proxy.observability.history import (
    LONG_POINTS,
    MAX_FLOWS,
    OTHER,
    RECENT_POINTS,
    SAMPLE_S,
    Point,
    PoolHistory,
    entitlement,
    sample_forever,
    wait_bucket,
    wait_quantile,
)
from sfq_proxy.state.pool import Dispatch, Pool

START = 1_760_000_000.0


def point(i: int, flows: int = 2) -> Point:
    """The ``i``-th second's sample: flow org0 served 3, the others 1 each; backend b1 down
    one sample in a hundred, b2 in every other sample only (a reload added it)."""
    served = {f"org{n}/batch": 3.0 if n == 0 else 1.0 for n in range(flows)}
    entitled = entitlement(served, dict.fromkeys(served, 1.0))
    backends = {"b1": (1, i % 3, 4, int(i % 100 != 0))}
    if i % 2:
        backends["b2"] = (1, 2, 2, 1)
    waits = Counter({wait_bucket(i % 5 / 10): 2})
    return Point(START + i, 1.0, 1, served, entitled, i % 7, waits, backends)


def test_a_day_of_samples_keeps_a_bounded_series_that_still_adds_up() -> None:
    history = PoolHistory()
    seconds = 86_400
    for i in range(seconds):
        history.add(point(i))
    assert len(history.recent) == RECENT_POINTS
    assert [p.end for p in history.recent] == [START + i for i in range(seconds - 300, seconds)]
    view = history.view()
    since_start = view["since_start"]
    assert LONG_POINTS // 2 <= len(since_start) <= LONG_POINTS  # bounded, and not collapsed
    assert sum(p["span_s"] for p in since_start) == seconds  # every second, once
    assert sum(p["dispatches"] for p in since_start) == 2 * seconds
    assert since_start[-1]["end"] == START + seconds - 1
    widths = {p["span_s"] for p in since_start[:-1]}
    assert len(widths) == 1  # neighbours merged pairwise: every closed point is as wide
    served = Counter[str]()
    for p in since_start:
        served.update(p["served"])
        assert p["queued"] == 6  # the most waiting at one of its samples
        assert sum(p["entitled"].values()) == pytest.approx(sum(p["served"].values()))
    assert served == {"org0/batch": 3 * seconds, "org1/batch": seconds}
    b1 = since_start[0]["backends"]["b1"]
    assert b1["slots"] == 4
    assert b1["in_flight"] == pytest.approx(1, abs=0.01)  # the mean of 0, 1, 2
    assert 0.98 < b1["healthy"] < 1  # down one sample in a hundred
    b2 = since_start[0]["backends"]["b2"]  # in every other sample: its means are of those
    assert (b2["in_flight"], b2["slots"], b2["healthy"]) == (2, 2, 1)


def test_many_flows_are_capped_and_the_rest_summed_as_other() -> None:
    history = PoolHistory()
    for i in range(4):
        history.add(point(i, flows=40))
    first, merged = history.view()["recent"][0], history.view()["since_start"]
    for p in [first, *merged]:
        assert len(p["served"]) == MAX_FLOWS
        assert OTHER in p["served"]
    assert first["served"]["org0/batch"] == 3
    assert sum(first["served"].values()) == 3 + 39
    assert sum(sum(p["served"].values()) for p in merged) == 4 * 42


def test_the_flows_that_waited_are_entitled_to_what_they_had_together_by_weight() -> None:
    waiting = {"A/batch": 3.0, "B/batch": 1.0}
    assert entitlement({"A/batch": 4.0, "B/batch": 4.0}, waiting) == {
        "A/batch": 6.0, "B/batch": 2.0,
    }  # fmt: skip
    # B waited and had nothing: it was entitled to a quarter of what A had
    assert entitlement({"A/batch": 8.0}, waiting) == {"A/batch": 6.0, "B/batch": 2.0}
    # C never waited: it had what it asked for, and A and B share the rest
    served = {"A/batch": 5.0, "B/batch": 3.0, "C/batch": 9.0}
    assert entitlement(served, waiting) == {"A/batch": 6.0, "B/batch": 2.0, "C/batch": 9.0}
    # nobody waited (a pool with room): everyone is entitled to what it had
    assert entitlement(served, {}) == served


def test_a_sample_entitles_the_flows_waiting_at_its_start_or_end_and_no_other() -> None:
    """Nobody waiting (a pool with room): each flow is entitled to what it had. A and C
    waiting at the end of the next interval: they split what they had by weight."""
    config = proxy_config(["http://127.0.0.1:9"], orgs={"A": {"weight": 3}})
    pool = Pool("sim", config, clock=lambda: 0.0)
    history = PoolHistory()

    def second(at: float, costs: dict[str, float]) -> dict[str, Any]:
        for flow, cost in costs.items():
            pool.recent.append(Dispatch(flow, "b", cost, 1.0, None, None, at - 0.5, 0.2))
        history.sample(pool, at, START + at)
        view: dict[str, Any] = history.view()["recent"][-1]
        return view

    room = second(1.0, {"A/batch": 3.0, "C/interactive": 9.0})
    assert room["served"] == room["entitled"] == {"A/batch": 3.0, "C/interactive": 9.0}
    for flow in ("A/batch", "C/interactive"):
        pool.scheduler.queue.push(flow, object(), 1.0, config.flow_weight(*org_and_class(flow)))
    busy = second(2.0, {"A/batch": 2.0, "C/interactive": 6.0})
    weights = {f: config.flow_weight(*org_and_class(f)) for f in ("A/batch", "C/interactive")}
    assert busy["entitled"] == {
        f: pytest.approx(8.0 * w / sum(weights.values()), abs=1e-3) for f, w in weights.items()
    }
    assert busy["wait_p50_s"] == pytest.approx(0.2, rel=0.19)


@pytest.mark.looptime
async def test_a_pool_whose_sample_fails_is_logged_and_sampled_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sample that raises (a bug) costs its second's point, not the charts for the rest
    of the process: ``once`` fails its first sample and has every later one; ``always``
    fails each of its 200 and is logged once a minute, with the count since the last line,
    not 200 times; each pool's failures leave the other's samples alone."""
    loop = asyncio.get_running_loop()
    config = proxy_config(["http://127.0.0.1:9"])
    pools = {name: Pool("sim", config, loop.time) for name in ("once", "always")}
    histories = {name: PoolHistory() for name in pools}
    failures = [RuntimeError("sampling broke")]

    def fails_once() -> list[Any]:
        if failures:
            raise failures.pop()
        return []

    def fails_always() -> list[Any]:
        raise KeyError("sampling broke again")

    monkeypatch.setattr(pools["once"], "flow_views", fails_once)
    monkeypatch.setattr(pools["always"], "flow_views", fails_always)
    caplog.set_level(logging.ERROR, "sfq_proxy.observability.history")
    sampler = asyncio.create_task(sample_forever(pools, histories, time.time))
    await asyncio.sleep(200.5 * SAMPLE_S)
    sampler.cancel()
    assert len(histories["once"].recent) == 199  # all but the first second's
    assert not histories["always"].recent
    once = [r for r in caplog.records if r.args and r.args[0] == "once"]
    assert [str(r.exc_info[1]) for r in once if r.exc_info] == ["sampling broke"]
    always = [r for r in caplog.records if r.args and r.args[0] == "always"]
    # at 1, 61, 121 and 181 s, each with the failures since the line before; not 200 lines
    assert [r.args[1] for r in always if r.exc_info] == [1, 60, 60, 60]


def test_wait_quantiles_are_within_a_bucket_above_the_truth() -> None:
    rng = random.Random(7)
    waits = [rng.lognormvariate(-1, 1.5) for _ in range(5000)]
    counts = Counter(wait_bucket(w) for w in waits)
    ordered = sorted(waits)
    for q in (0.5, 0.99):
        truth = ordered[math.ceil(q * len(waits)) - 1]
        found = wait_quantile(counts, q)
        assert found is not None
        assert truth <= found <= truth * 2**0.25 * 1.000001
    assert wait_quantile(Counter(), 0.5) is None
    assert wait_quantile(Counter({wait_bucket(0.0): 3}), 0.99) == 0.001  # under a millisecond
