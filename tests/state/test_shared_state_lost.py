"""Redis lost while serving, with ``when_unreachable: local``: the replicas go on alone,
each on its share of every backend's slots, and form one fairness domain again once Redis
is back. Run against a real Redis stopped and started again (empty, as a restart without
persistence leaves it), behind real proxies and a real simulated backend that counts its
concurrency; every client gets an answer or an error, and nothing is sent twice."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
from proxy_lab import Lab, Served, eventually, proxy_config
from redis_server import RedisServer, queued_is
from test_shared_state import outcome

from sfq_proxy.state.redis_dispatch import pool_prefix
from sfq_proxy.state.redis_pool import Mode, SharedPool

pytestmark = pytest.mark.redis
CHAT = [{"role": "user", "content": "hi"}]
TTL_S = 1.5


@pytest.fixture(autouse=True)
def redis_restarted(redis_server: RedisServer) -> Iterator[None]:
    """A test that fails while Redis is stopped leaves it running for the next ones."""
    yield
    if not redis_server.pings():
        redis_server.start()


def pool(served: Served) -> SharedPool:
    shared = served.state.pools["sim"]
    assert isinstance(shared, SharedPool)
    return shared


async def test_redis_lost_the_replicas_go_on_on_their_shares_and_join_again(
    lab: Lab, redis_server: RedisServer, redis_url: str
) -> None:
    """Two replicas, one backend of 2 slots, both held by replica 0 when Redis stops. No
    request is refused: the waiting move to their replica's own line. Replica 0 ends the
    newer of its two (its share is 1), then each schedules alone on its 1 slot: the backend
    never runs more than 2. Redis back: each registers what it runs, settles, and the lines
    move back to Redis; a request then goes through the shared state again."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0, max_num_seqs=8)
    shared = {"redis": redis_url, "lease_ttl_s": TTL_S, "when_unreachable": "local"}
    proxies = [await lab.proxy(proxy_config([sim.url], slots=2, state=shared)) for _ in range(2)]
    await eventually(lambda: all(len(pool(p).dispatch.holders) == 2 for p in proxies), within=5)

    running = [asyncio.create_task(outcome(lab, proxies[0], f"run{i}", 160)) for i in range(2)]
    await eventually(lambda: sim.stats.running == 2, within=10)
    waiting = [
        asyncio.create_task(outcome(lab, p, f"wait{j}.{i}", 5))
        for j, p in enumerate(proxies)
        for i in range(2)
    ]
    await eventually(lambda: queued_is(redis_url, 4), within=10)

    redis_server.stop()
    during = [asyncio.create_task(outcome(lab, p, f"down{j}", 5)) for j, p in enumerate(proxies)]
    await eventually(lambda: all(pool(p).mode is Mode.LOCAL for p in proxies), within=3 * TTL_S)
    http = await lab.http()
    for served in proxies:
        async with http.get(f"{served.url}/readyz") as r:
            assert r.status == 200  # it serves: a load balancer keeps sending

    def split() -> bool:  # (each zero for the instant its attempt to reach Redis is on its way)
        return [b.limit for p in proxies for b in pool(p).placement.backends] == [1, 1]

    await eventually(split, within=2)
    proxies[0].state.reload(proxies[0].state.config)  # no await since the check: no
    assert split()  # attempt began meanwhile, and the reload kept the split
    served_alone = await asyncio.wait_for(asyncio.gather(*waiting, *during), 20)
    assert served_alone == ["answered"] * 6
    assert sorted(await asyncio.gather(*running)) == ["answered", "cut"]

    redis_server.start()
    await eventually(lambda: all(pool(p).mode is Mode.SHARED for p in proxies), within=4 * TTL_S)
    assert await asyncio.wait_for(outcome(lab, proxies[1], "after", 5), 20) == "answered"
    admin = aioredis.Redis.from_url(redis_url)
    try:  # Redis came back empty, and nothing ran when they registered: this lease (its
        # number) is the one Redis granted "after"
        assert await admin.hexists(pool_prefix("sim") + "meta", "fence")
    finally:
        await admin.aclose()
    assert all(b.share == 0 for p in proxies for b in pool(p).placement.backends)

    users = [r.user for r in sim.stats.log]
    assert Counter(users).most_common(1)[0][1] == 1  # nothing sent twice
    expected = {"run0", "run1", "after", "down0", "down1"}
    assert set(users) == expected | {f"wait{j}.{i}" for j in range(2) for i in range(2)}
    assert sim.stats.max_concurrent <= 2


async def test_requests_wait_out_a_blip_and_go_through_redis(
    lab: Lab, redis_server: RedisServer, redis_url: str
) -> None:
    """Redis gone for less than the time before anyone decides alone: the requests that
    came meanwhile wait (no 503), nothing runs outside the shared state, and once Redis
    answers they are dispatched by it."""
    sim = await lab.backend(max_num_seqs=8)
    shared = {"redis": redis_url, "lease_ttl_s": 3, "when_unreachable": "local"}
    served = await lab.proxy(proxy_config([sim.url], slots=2, state=shared))
    redis_server.stop()
    blip = asyncio.create_task(outcome(lab, served, "blip", 5))
    await eventually(lambda: pool(served).mode is Mode.HOLDING, within=3)
    assert sim.stats.log == []  # waiting, not refused, not sent
    redis_server.start()
    assert await asyncio.wait_for(blip, 10) == "answered"
    assert pool(served).mode is not Mode.LOCAL
    assert [r.user for r in sim.stats.log] == ["blip"]


async def test_an_orgs_rate_is_divided_among_the_replicas_while_redis_is_lost(
    lab: Lab, redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """rpm 4 shared by two replicas: with Redis lost each admits 2 (429 + Retry-After for
    the third), so the org still gets at most its rate in all; each replica says so once,
    not at every request."""
    sim = await lab.backend(max_num_seqs=8)
    shared = {"redis": redis_url, "lease_ttl_s": TTL_S, "when_unreachable": "local"}
    config = proxy_config([sim.url], slots=4, state=shared, orgs={"A": {"rpm": 4}})
    proxies = [await lab.proxy(config) for _ in range(2)]
    await eventually(lambda: all(len(pool(p).dispatch.holders) == 2 for p in proxies), within=5)
    redis_server.stop()
    answers = [
        await outcome(lab, p, f"u{j}.{i}", 5) for j, p in enumerate(proxies) for i in range(3)
    ]
    assert answers == ["answered", "answered", "429 rpm"] * 2
    lost = [r for r in caplog.records if "org limits in Redis unreachable" in r.getMessage()]
    assert len(lost) == 2
    redis_server.start()


class SilentRedis:
    """A listener on Redis's port that takes connections and never answers: a Redis that
    hangs, so a call to it stays on its way until ``close`` resets its connection (as a
    Redis killed then would). A paused redis-server answers the moment it is thawed."""

    def __init__(self) -> None:
        self.connections: list[asyncio.Transport] = []
        self._server: asyncio.Server | None = None

    async def open(self, port: int) -> None:
        async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            transport = writer.transport
            assert isinstance(transport, asyncio.Transport)
            self.connections.append(transport)

        self._server = await asyncio.start_server(hold, "127.0.0.1", port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for transport in self.connections:
            transport.abort()


@pytest.mark.parametrize("reload_meanwhile", [False, True])
async def test_a_slot_freed_while_local_mode_tries_redis_again_goes_to_the_next_in_line(
    lab: Lab, redis_server: RedisServer, redis_url: str, reload_meanwhile: bool
) -> None:
    """In local mode each heartbeat tries Redis again, and while that call is on its way the
    pool's own scheduler starts nothing (its shares are 0). A request that ends in that
    window frees its slot without a dispatch; when the call fails, the shares come back and
    the request that waits behind it is dispatched then (it waited for good before). A
    reload meanwhile leaves the shares at 0 (it gave them back, and the waiting request
    started while Redis might take the list and decide without it)."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0, max_num_seqs=8)
    shared = {"redis": redis_url, "lease_ttl_s": TTL_S, "when_unreachable": "local"}
    served = await lab.proxy(proxy_config([sim.url], slots=1, state=shared))
    shared_pool = pool(served)
    backend = shared_pool.placement.backends[0]
    silent = SilentRedis()
    redis_server.stop()
    try:
        await eventually(lambda: shared_pool.mode is Mode.LOCAL and backend.share == 1, within=5)
        first = asyncio.create_task(outcome(lab, served, "first", 400))
        await eventually(lambda: sim.stats.running == 1, within=10)
        second = asyncio.create_task(outcome(lab, served, "second", 5))
        await eventually(lambda: shared_pool.scheduler.queued() == 1, within=10)

        await silent.open(redis_server.port)  # the next attempt to reach Redis hangs
        await eventually(lambda: bool(silent.connections) and backend.share == 0, within=5)
        first.cancel()  # its client leaves: the proxy ends it and frees its slot
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await eventually(lambda: shared_pool.scheduler.running == 0, within=5)
        assert shared_pool.scheduler.queued() == 1  # freed while the shares were 0
        if reload_meanwhile:
            served.state.reload(served.state.config)
            assert (backend.share, shared_pool.scheduler.queued()) == (0, 1)
        await silent.close()  # the attempt fails: the shares come back
        assert await asyncio.wait_for(second, 20) == "answered"
    finally:
        await silent.close()
        redis_server.start()
    assert [r.user for r in sim.stats.log] == ["first", "second"]
    await eventually(lambda: shared_pool.mode is Mode.SHARED, within=4 * TTL_S)
