"""A pool's timers on a controllable loop clock (looptime): deadlines and rate wake-ups are
exact, and a test of a 30-second deadline takes milliseconds.

The pool runs on the event loop's own clock here, which looptime moves forward whenever
every task waits; no backend is needed, since nothing is sent.
"""

from __future__ import annotations

import asyncio

import pytest
from proxy_lab import proxy_config

from sfq_proxy.core.errors import ApiError, Expiry
from sfq_proxy.core.scheduler import Ticket
from sfq_proxy.state.pool import Pool

pytestmark = pytest.mark.looptime


def pool(slots: int = 1, **options: object) -> Pool:
    config = proxy_config(["http://127.0.0.1:9"], slots=slots, **options)  # type: ignore[arg-type]
    return Pool("sim", config, asyncio.get_running_loop().time)


def ticket(org: str) -> Ticket:
    return Ticket(org=org, cls="batch", cost=1.0)


async def test_a_queued_request_leaves_exactly_at_its_deadline_uncharged() -> None:
    loop, pool_ = asyncio.get_running_loop(), pool()
    await pool_.acquire(ticket("A"))  # holds the only slot for the whole test
    late, start = ticket("B"), loop.time()
    expiry = Expiry(429, "waited too long", code="queue_age")
    with pytest.raises(ApiError) as expired:
        await pool_.acquire(late, expires_at=start + 30.0, expiry=expiry)
    assert (expired.value.status, expired.value.code) == (429, "queue_age")
    assert expired.value.message == "waited too long"
    assert loop.time() - start == pytest.approx(30.0, abs=0.01)
    assert pool_.scheduler.queued() == 0
    queue = pool_.scheduler.queue  # only A was ever charged (it runs: the busy period goes on)
    assert {view.flow: view.meter for view in queue.flows()} == {"A/batch": 1.0, "B/batch": 0.0}


async def test_a_paced_pool_wakes_exactly_when_its_rate_allows_the_next_dispatch() -> None:
    """60 requests a minute with a one-second burst: one dispatch a second, each woken by
    the pool's own timer (nothing else happens in between)."""
    loop = asyncio.get_running_loop()
    pool_ = pool(slots=8, pool={"rate": {"requests_per_minute": 60}})
    start = loop.time()
    times = []
    for org in "ABCD":
        backend = await pool_.acquire(ticket(org))
        assert backend.name
        times.append(round(loop.time() - start, 2))
    assert times == [0.0, 1.0, 2.0, 3.0]


async def test_a_request_cancelled_while_queued_leaves_nothing_behind() -> None:
    loop, pool_ = asyncio.get_running_loop(), pool()
    first = ticket("A")
    await pool_.acquire(first)
    waiter = asyncio.create_task(pool_.acquire(ticket("B")))
    await asyncio.sleep(10.0)  # ten seconds of queueing, in no time
    assert pool_.scheduler.queued() == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool_.scheduler.queued() == 0
    pool_.release(first)
    assert pool_.scheduler.running == 0
    assert loop.time() >= 10.0
