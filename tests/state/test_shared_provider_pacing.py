"""A provider pool's pacing is shared in Redis (state/dispatch.lua): two proxies on one Redis
pace the provider as one would, where two independent in-memory proxies each give it the
whole rate (shown, as the other "independent proxies" failures are); and a 429 answered to
one proxy pauses the other's dispatch too. With Redis lost (``when_unreachable: local``),
each replica paces the provider at its part of the rate.

The provider is tests/support/provider_double.py's stand-in, noting when each request reaches it
on the loop's clock (the proxies run on the same loop). The assertions are lower bounds on
those times, the least pacing must hold a dispatch back, never tight upper bounds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from provider_double import PROVIDER_KEY, ProviderDouble
from proxy_lab import MODEL, Lab, Served, eventually, proxy_config
from redis_server import RedisServer
from test_shared_state_lost import pool

from sfq_proxy.state.redis_pool import Mode

pytestmark = pytest.mark.redis
CHAT = [{"role": "user", "content": "hi"}]
RPM = 120  # 2 a second, with a second's burst: 2 at once
REQUESTS = 10
PAUSE_S = 1.0
SLACK = 0.05  # a dispatch decided in Redis reaches the provider a little later than the first
TTL_S = 30.0  # heartbeats 10 s apart: only the pump that pacing asks for dispatches in time
SHARED = pytest.mark.parametrize("shared", [True, False], ids=["shared", "independent"])


@dataclass
class TimedProvider(ProviderDouble):
    """The provider stand-in, noting when each chat request reaches it."""

    arrivals: list[float] = field(default_factory=list)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.arrivals.append(asyncio.get_running_loop().time())
        return await super()._chat(request)


def state_of(redis_url: str, shared: bool) -> Any:
    """The proxies' ``state``: one Redis, or each its own memory."""
    return {"redis": redis_url, "lease_ttl_s": TTL_S} if shared else "memory"


async def two_proxies(lab: Lab, state: Any, **options: Any) -> tuple[TimedProvider, list[Served]]:
    """Two proxies with ``state`` whose pool ``sim`` is one provider (with its key, and the
    ``options`` added); a refused request is not retried (the client sees it)."""
    provider = TimedProvider()
    port = await lab.serve(provider.app())
    config = proxy_config(
        [f"http://127.0.0.1:{port}/v1"],
        slots=8,  # never the limit here: the rate is
        pool={"upstream_key_env": "PROVIDER_KEY", **options},
        environ={"PROVIDER_KEY": PROVIDER_KEY},
        state=state,
        retry={"max_attempts": 1},
    )
    return provider, [await lab.proxy(config) for _ in range(2)]


async def spread(lab: Lab, proxies: list[Served], requests: int) -> None:
    """``requests`` sent at once, alternately through each proxy; all answered."""
    replies = await asyncio.gather(
        *(
            lab.client(proxies[i % 2], "AB"[i % 2]).chat.completions.create(
                model=MODEL, messages=CHAT
            )
            for i in range(requests)
        )
    )
    assert all(r.usage is not None for r in replies)


def too_early(arrivals: list[float]) -> list[tuple[int, float]]:
    """The arrivals sooner than one bucket of 2 at 2 a second allows: in any span, at most 2
    plus 2 a second, so the k-th (from 0) comes (k − 1)/2 s after the first at the soonest.
    As (k, seconds after the first)."""
    first = arrivals[0]
    return [
        (k, round(at - first, 3))
        for k, at in enumerate(arrivals)
        if at - first < (k - 1) / 2 - SLACK
    ]


@SHARED
async def test_two_proxies_pace_the_provider_as_one_only_when_shared(
    lab: Lab, redis_url: str, shared: bool
) -> None:
    """A rate of 120 a minute, 10 requests sent at once, alternately through each proxy:
    shared, they reach the provider no faster than the rate (the last 4 s after the first),
    and as soon as it allows (each wait ends in a pump, not at a heartbeat); independent,
    each proxy gives the provider the whole rate, twice it together."""
    rate = {"requests_per_minute": RPM}
    provider, proxies = await two_proxies(lab, state_of(redis_url, shared), rate=rate)
    await spread(lab, proxies, REQUESTS)
    arrivals = provider.arrivals
    assert len(arrivals) == REQUESTS
    span = arrivals[-1] - arrivals[0]
    if shared:
        assert too_early(arrivals) == [], arrivals
        assert span < (REQUESTS - 2) / 2 + 1, arrivals
    else:  # 4 at once, then 4 a second: done in about (10 − 4)/4 s
        assert too_early(arrivals) != []
        assert span < 0.6 * (REQUESTS - 1) / 2, span


async def paused_in_redis(redis_url: str) -> bool:
    """Whether the pool's shared pacing holds a pause (pushed by a proxy's throttle)."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        return bool(await client.hexists("sfq:{sim}:pace", "pause"))
    finally:
        await client.aclose()


@SHARED
async def test_a_429_to_one_proxy_pauses_the_others_dispatch_only_when_shared(
    lab: Lab, redis_url: str, shared: bool
) -> None:
    """The provider refuses a request of the first proxy (``retry-after-ms: 1000``): shared,
    the second proxy's next request reaches the provider only after that pause; independent,
    at once."""
    provider, (first, second) = await two_proxies(lab, state_of(redis_url, shared))
    provider.refuse(retry_after_ms=str(round(PAUSE_S * 1000)))
    with pytest.raises(openai.RateLimitError):
        await lab.client(first, "A").chat.completions.create(model=MODEL, messages=CHAT)
    if shared:  # pushed in the background, as the answer went on to the client
        await eventually(lambda: paused_in_redis(redis_url))
    reply = await lab.client(second, "B").chat.completions.create(model=MODEL, messages=CHAT)
    assert reply.usage is not None
    refused, served = provider.arrivals
    if shared:
        assert served - refused >= PAUSE_S - SLACK
    else:
        assert served - refused < PAUSE_S / 2


async def test_with_redis_lost_each_replica_paces_at_its_part_of_the_rate(
    lab: Lab, redis_server: RedisServer, redis_url: str
) -> None:
    """``when_unreachable: local``: once the two replicas schedule alone, each paces the
    provider at half the rate (60 a minute, a burst of 1), so together they still reach it
    no faster than the rate; with Redis back, each holds the whole rate again (unused: the
    pacing is Redis's)."""
    lost = {"redis": redis_url, "lease_ttl_s": 1.5, "when_unreachable": "local"}
    provider, proxies = await two_proxies(lab, lost, rate={"requests_per_minute": RPM})
    await eventually(lambda: all(len(pool(p).dispatch.holders) == 2 for p in proxies), within=5)
    redis_server.stop()
    try:
        await eventually(lambda: all(pool(p).mode is Mode.LOCAL for p in proxies), within=5)
        assert [local_rpm(p) for p in proxies] == [RPM / 2, RPM / 2]
        await spread(lab, proxies, 6)
    finally:
        redis_server.start()
    assert too_early(provider.arrivals) == [], provider.arrivals
    await eventually(lambda: all(pool(p).mode is Mode.SHARED for p in proxies), within=10)
    assert [local_rpm(p) for p in proxies] == [RPM, RPM]


def local_rpm(proxy: Served) -> float:
    """The requests a minute of the proxy's own scheduler (``/admin/state``)."""
    feedback = pool(proxy).state()["provider_feedback"]
    return float(feedback["effective_requests_per_minute"])
