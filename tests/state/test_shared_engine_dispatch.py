"""Engine dispatch with the state in Redis (docs/design.md §5 "Engine-aware dispatch",
docs/shared-state.md): each replica's gate reads the engine, and what it concludes bounds
the leases in Redis, which count every replica's dispatches; a class below 1 and a full
KV cache bound a class's leases on the backend (dispatch.lua's ``free``).

Real Redis, real proxies in front of a simulated vLLM, the ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis
from engine_lab import engine_config, sampled
from proxy_lab import MODEL, Lab, Served, eventually, leftovers
from redis_server import queued_is

from sfq_proxy.sim.server import SimBackend
from sfq_proxy.state.redis_dispatch import Grants, RedisDispatch, SharedTicket, pool_prefix
from sfq_proxy.state.redis_pool import SharedPool
from sfq_proxy.state.redis_resp import Pipe

pytestmark = pytest.mark.redis

CHAT = [{"role": "user", "content": "hi"}]
PER_ORG = 20
TTL_S = 30  # no lease lapses here: a loaded machine may stall a loop for a while


async def test_a_class_limit_bounds_that_class_on_the_backend_alone(redis_url: str) -> None:
    """``b0`` has 4 slots and ``batch`` may fill 1 of them (affinity's choice bound as the
    fallback's): one batch ticket goes, the others wait, an interactive one still goes; once
    the limit is lifted, the batch tickets fill the free slots."""
    client, pipe = aioredis.Redis.from_url(redis_url), Pipe.from_url(redis_url)
    assert pipe is not None
    try:
        holder = RedisDispatch(client, f"limits-{uuid.uuid4().hex}", "h0", pipe)
        await holder.heartbeat(TTL_S, new=True)
        await holder.configure([("b0", 4, {"batch": 1})], {}, {}, load_factor=1.25, slack=2)
        batch = SharedTicket("a", "batch", 1.0, 1.0, affinity="k")
        granted = [await holder.submit(f"b{i}", batch) for i in range(3)]
        assert [[g.ticket for g in grants] for grants in granted] == [["b0"], [], []]
        chat = SharedTicket("a", "interactive", 1.0, 1.0)
        assert [g.ticket for g in await holder.submit("i0", chat)] == ["i0"]
        assert await holder.pump() == []
        lifted = await holder.configure([("b0", 4)], {}, {}, load_factor=1.25, slack=2)
        assert sorted(g.ticket for g in lifted) == ["b1", "b2"]
    finally:
        await client.aclose()
        await pipe.aclose()


async def two_replicas(lab: Lab, sim: SimBackend, redis_url: str, **options: Any) -> list[Served]:
    state = {"redis": redis_url, "lease_ttl_s": TTL_S}
    return [await lab.proxy(engine_config([sim.url], state=state, **options)) for _ in range(2)]


async def flood(lab: Lab, proxies: list[Served], orgs: str, per_org: int, tokens: int) -> None:
    """``per_org`` requests of each org at once, each org through its own replica in turn
    (skewed ingress: A's through the first, B's through the second)."""
    asks = [
        lab.client(proxies[i % len(proxies)], org).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=tokens, user=org
        )
        for _ in range(per_org)
        for i, org in enumerate(orgs)
    ]
    for answer in await asyncio.gather(*asks):
        assert answer.choices[0].finish_reason == "length"


def record_grants(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """The grants every replica started from now on carries out, as (lease, org): sorted,
    Redis's order (the leases' numbers grow with each grant); the backend's arrival order
    may differ, as a grant for the other replica goes through its inbox. Patched before the
    replicas start: a loop waiting on its inbox already holds the method it will call."""
    granted: list[tuple[int, str]] = []
    carry_out = SharedPool._grant

    def record(pool: SharedPool, grants: Grants) -> None:
        for grant in grants:
            waiting = pool._waiting.get(grant.ticket)
            if waiting is not None:
                granted.append((int(grant.lease), waiting[0].org))
        carry_out(pool, grants)

    monkeypatch.setattr(SharedPool, "_grant", record)
    return granted


def within_the_bound(order: list[str], skip: int) -> bool:
    """Whether orgs A and B, of equal weight and cost, were served within SFQ's bound
    (|W_A − W_B| ≤ 2 requests, docs/design.md §3) while both waited: from the ``skip``
    first on, which took the free leases in the order they arrived, while the rest waited."""
    assert Counter(order) == {"A": PER_ORG, "B": PER_ORG}, order
    total, served = Counter(order[:skip]), Counter[str]()
    for org in order[skip:]:
        total[org] += 1
        served[org] += 1
        if total["A"] < PER_ORG and total["B"] < PER_ORG and abs(served["A"] - served["B"]) > 2:
            raise AssertionError(order)
    return True


@pytest.mark.parametrize("mode", ["static", "engine"])
async def test_two_replicas_keep_one_engine_queue_within_the_allowance(
    lab: Lab, redis_url: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas, 32 slots on an engine of 4: static dispatch lets the engine queue what
    the slots allow; engine dispatch, each replica reading the engine and both bound by the
    leases, keeps its waiting queue at the allowance (1) while it runs full, and the orgs,
    each entering through its own replica, are served within SFQ's bound."""
    dispatch = {} if mode == "engine" else None
    sim = await lab.backend(max_num_seqs=4, time_scale=2.0)
    granted = record_grants(monkeypatch)
    proxies = await two_replicas(lab, sim, redis_url, slots=32, dispatch=dispatch)
    await flood(lab, proxies, "CC", 4, tokens=60)  # saturated: the gates learn 4
    gates = [p.state.pools["sim"].placement.backends[0].gate for p in proxies]
    if dispatch is not None:
        await eventually(lambda: all(g is not None and g.capacity() == 4 for g in gates))
    granted.clear()
    leases = 32 if dispatch is None else 4 + 1
    sim.hold()  # until every request that does not hold a lease waits in Redis
    flooded = asyncio.ensure_future(flood(lab, proxies, "AB", PER_ORG, tokens=12))
    await eventually(lambda: queued_is(redis_url, 2 * PER_ORG - leases), within=10)
    async with sampled(lab, sim) as samples:
        sim.release()
        await flooded
    assert all(not leftovers(p) for p in proxies)
    assert within_the_bound([org for _, org in sorted(granted)], skip=leases)
    waiting = max(w for _, w in samples)
    if dispatch is None:
        assert waiting >= 24, samples  # of the 40 − 4 it cannot run: the slots bind
    else:
        assert waiting <= 1, samples
        assert max(r for r, _ in samples) == 4, samples  # and it runs full


async def backends_in_redis(redis_url: str) -> list[list[Any]]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return json.loads(await client.get(pool_prefix("sim") + "backends") or "[]")
    finally:
        await client.aclose()


async def test_a_replica_that_cannot_read_the_engine_leaves_the_limit_told(
    lab: Lab, redis_url: str
) -> None:
    """Replica B reads the engine (capacity 4: 5 leases); replica A cannot (its metrics path
    answers 404: stale, its fallback the static 32). A's join and its stale readings leave
    B's 5 in Redis, and a flood through A waits in the proxy, not in the engine (before, A's
    join told 32 and the engine queued what it could not run)."""
    sim = await lab.backend(max_num_seqs=4, time_scale=2.0)
    state = {"redis": redis_url, "lease_ttl_s": TTL_S}
    seeing = await lab.proxy(engine_config([sim.url], 32, dispatch={}, state=state))
    await flood(lab, [seeing], "CC", 4, tokens=60)  # saturated: B's gate learns 4
    await eventually(lambda: _slots_are(redis_url, 5))
    blind = engine_config([sim.url], 32, dispatch={"metrics_path": "/missing"}, state=state)
    proxy = await lab.proxy(blind)
    gate = proxy.state.pools["sim"].placement.backends[0].gate
    assert gate is not None
    await eventually(lambda: gate.problem == "no_metrics")
    assert [b[1] for b in await backends_in_redis(redis_url)] == [5]
    async with sampled(lab, sim) as samples:
        await flood(lab, [proxy], "AB", 10, tokens=12)
    assert max(w for _, w in samples) <= 1, samples


async def _slots_are(redis_url: str, slots: int) -> bool:
    return [b[1] for b in await backends_in_redis(redis_url)] == [slots]
