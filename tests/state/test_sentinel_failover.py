"""A Redis primary killed (SIGKILL) while two proxy replicas serve a backlogged load of two
orgs, and Sentinel promoting its replica: real redis-server processes (a primary, its
replica) and a real Sentinel with a 1 s ``down-after-milliseconds``, two real proxies on
``state: {sentinel: ...}``, a real simulated backend that counts its concurrency, clients
through the ``openai`` SDK. Checked where it matters: every request gets exactly one answer
(200, or 503 with Retry-After and an OpenAI-style error), the backend sees each request at
most once (and none that was refused), never more than its slots, dispatch resumes on the
new primary, no lease is left behind in it once every request is answered, and the orgs'
shares after it keep the SFQ bound. The replica's link to the primary goes through a relay
that holds back the primary's last writes: the replica lags, as one over a busy network
does, and the primary's death loses them (``state/redis_functions.py`` ``Replicated``)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai
import pytest
import redis.asyncio as aioredis
from proxy_lab import MODEL, Lab, Served, eventually, proxy_config
from redis_server import ReplicatedRedis, running_replicated_redis

from sfq_proxy.state.redis_dispatch import Grant, Grants, pool_prefix
from sfq_proxy.state.redis_pool import SharedPool

pytestmark = pytest.mark.redis
CHAT = [{"role": "user", "content": "hi"}]
SLOTS = 3
WEIGHT_A = 2  # A:B = 2:1
CLIENTS = 8  # per org (4 through each proxy): more than the slots, so both orgs stay backlogged
RESUME_WITHIN_S = 20.0  # a generous correctness bound (local settles a TTL); the figure is printed
AFTER_S = 3.0  # how long the load goes on once dispatch resumed
# the shares are checked from this long after dispatch resumed: by then what waited in both
# replicas has landed in the new primary (with ``local``, each replica moves its line there
# when its own settling ends), so both orgs are backlogged in it
LANDED_S = 0.5
ANSWER_WITHIN_S = 30.0  # a request still unanswered then has been lost
LAG_S = 0.3  # how far behind the replica is when the primary dies


@pytest.fixture
def replicated() -> Iterator[ReplicatedRedis]:
    """Stopped after the proxies (asked for before ``lab``, it is torn down after it)."""
    with running_replicated_redis(down_after_ms=1000) as redis:
        yield redis


@dataclass
class Load:
    """``CLIENTS`` clients per org, each sending one request after another (tagged with a
    unique ``user``) until stopped; after a 503 it waits 0.1 s (not the Retry-After), so that
    both orgs stay backlogged through the failover. Every request's fate, by its tag."""

    lab: Lab
    proxies: list[Served]
    answers: dict[str, str] = field(default_factory=dict)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    async def run(self) -> None:
        clients = [self._client(org, self.proxies[i % 2]) for org in "AB" for i in range(CLIENTS)]
        await asyncio.gather(*clients)

    async def _client(self, org: str, served: Served) -> None:
        client = self.lab.client(served, org)
        while not self.stopped.is_set():
            tag = f"{org}{next(self._ids)}"
            self.answers[tag] = "no answer"
            with contextlib.suppress(TimeoutError):
                self.answers[tag] = await asyncio.wait_for(self._ask(client, tag), ANSWER_WITHIN_S)
            if self.answers[tag] != "200":
                await asyncio.sleep(0.1)

    @staticmethod
    async def _ask(client: openai.AsyncOpenAI, tag: str) -> str:
        try:
            await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, user=tag)
        except openai.APIStatusError as err:
            body = err.body if isinstance(err.body, dict) else {}
            clear = body.get("code") and body.get("message") and body.get("type")
            after = err.response.headers.get("retry-after")
            return f"{err.status_code}" if clear and after else f"{err.status_code} unclear"
        except openai.APIError as err:
            return f"cut: {type(err).__name__}"
        return "200"


@dataclass
class Granted:
    """Every grant a proxy carried out, with its lease number: the order Redis decided them
    in (the backend sees them in the order they reach it, which two proxies reorder)."""

    at: list[tuple[float, int, str]] = field(default_factory=list)  # (monotonic, lease, org)

    def watch(self, served: Served) -> None:
        pool = served.state.pools["sim"]
        assert isinstance(pool, SharedPool)
        carry_out = pool._grant

        def grant(grants: Grants) -> None:
            for g in grants:
                waiting = pool._waiting.get(g.ticket)
                if waiting is not None and not waiting[1].done():
                    self.at.append((time.monotonic(), int(g.lease), waiting[0].org))
            carry_out(grants)

        pool._grant = grant  # type: ignore[method-assign]

    def order(self, since: float, until: float) -> str:
        """The orgs of the grants made between ``since`` and ``until``, in lease order."""
        by_lease = sorted(self.at, key=lambda g: g[1])
        return "".join(org for at, _, org in by_lease if since <= at < until)


def beyond_bound(order: str) -> float:
    """The largest |n_A/2 − n_B/1| over the prefixes of a dispatch order, less the SFQ
    bound for two backlogged flows (c/w_A + c/w_B, c one request): ≤ 0 keeps it."""
    a = b = 0
    worst = 0.0
    for org in order:
        a, b = a + (org == "A"), b + (org == "B")
        worst = max(worst, abs(a / WEIGHT_A - b))
    return worst - (1 / WEIGHT_A + 1)


@pytest.mark.parametrize(
    ("when_unreachable", "ttl_s", "lag_s"),
    [
        # the replica lags: the primary's last writes never reach it. A TTL well over the
        # failover (~2-3 s): the leases outlive it, so what the new primary lacks counts
        ("fail_closed", 10.0, LAG_S),
        ("local", 5.0, LAG_S),  # the default TTL: the replicas settle, then go on in Redis
        ("fail_closed", 1.5, 0.0),  # shorter than the failover: leases lapse, replicas rejoin
    ],
)
async def test_a_primary_killed_under_load_fails_over(
    replicated: ReplicatedRedis, lab: Lab, when_unreachable: str, ttl_s: float, lag_s: float
) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=80.0, max_num_seqs=16)
    state = {
        "sentinel": {"hosts": replicated.hosts, "service": replicated.sentinel.service},
        "lease_ttl_s": ttl_s, "when_unreachable": when_unreachable,
    }  # fmt: skip
    config = proxy_config([sim.url], slots=SLOTS, orgs={"A": {"weight": WEIGHT_A}}, state=state)
    proxies = [await lab.proxy(config) for _ in range(2)]
    granted = Granted()
    for served in proxies:
        granted.watch(served)
    load = Load(lab, proxies)
    running = asyncio.create_task(load.run())
    await eventually(lambda: len(sim.stats.log) >= 20, within=10)  # backlogged, served

    replicated.link.hold()
    await asyncio.sleep(lag_s)
    killed_at = time.monotonic()
    replicated.kill_primary()

    def resumed() -> float | None:  # a request reached the backend after the failover
        late = [r.arrived_at for r in sim.stats.log if r.arrived_at > killed_at + 0.5]
        return min(late, default=None)  # (the dead primary's grants arrive within ms)

    await eventually(lambda: resumed() is not None, within=RESUME_WITHIN_S)
    resumed_at = resumed()
    assert resumed_at is not None
    assert replicated.sentinel.primary() == replicated.replica.port
    await asyncio.sleep(AFTER_S)
    stopped_at = time.monotonic()
    load.stopped.set()
    await asyncio.wait_for(running, ANSWER_WITHIN_S + 5)
    # every request answered: the leases go back (in the background), none is left behind
    # to keep a slot taken for as long as its holder lives
    primary = aioredis.Redis(port=replicated.replica.port)
    try:
        with contextlib.suppress(AssertionError):
            await eventually(lambda: _no_lease(primary), within=3)
        leases = await primary.hlen(pool_prefix("sim") + "lease")
    finally:
        await primary.aclose()

    fates = Counter(load.answers.values())
    seen = Counter(r.user for r in sim.stats.log)
    after = granted.order(resumed_at + LANDED_S, stopped_at)
    print(
        f"\n{when_unreachable}, TTL {ttl_s:g} s, lag {lag_s:g} s: dispatch resumed "
        f"{resumed_at - killed_at:.2f} s after SIGKILL; answers {dict(fates)}; duplicates "
        f"{sum(n - 1 for n in seen.values())}; max concurrent {sim.stats.max_concurrent} of "
        f"{SLOTS} slots; after: A {after.count('A')} B {after.count('B')} (2:1), "
        f"beyond the SFQ bound by {max(0.0, beyond_bound(after)):.2f}; {leases} leases left"
    )
    assert set(fates) <= {"200", "503"}, fates  # one clear answer each, nothing lost
    assert seen.most_common(1)[0][1] == 1  # nothing dispatched twice
    answered = {tag for tag, fate in load.answers.items() if fate == "200"}
    assert set(seen) == answered  # every 200 reached the backend, no refused request did
    assert sim.stats.max_concurrent <= SLOTS
    assert leases == 0
    assert resumed_at - killed_at < RESUME_WITHIN_S
    assert len(after) >= 12, after
    assert beyond_bound(after) <= 0, after


async def _no_lease(primary: aioredis.Redis) -> bool:
    return await primary.hlen(pool_prefix("sim") + "lease") == 0


async def test_a_replica_that_does_not_acknowledge_does_not_stop_the_proxy(
    replicated: ReplicatedRedis, lab: Lab, caplog: pytest.LogCaptureFixture
) -> None:
    """Its writes are no longer acknowledged (its link is held for good): each call waits
    for it at most ACK_MS, then calls go on without waiting for a while; requests are
    served, and the log says it once."""
    sim = await lab.backend()
    state = {"sentinel": {"hosts": replicated.hosts, "service": replicated.sentinel.service}}
    served = await lab.proxy(proxy_config([sim.url], state=state))
    replicated.link.hold()
    client = lab.client(served, "A")
    for _ in range(3):
        await asyncio.wait_for(
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2), 10
        )
    warned = [r for r in caplog.records if "no replica acknowledged" in r.getMessage()]
    assert len(warned) == 1
    assert len(sim.stats.log) == 3


async def test_a_grant_given_twice_does_not_free_the_slot_of_its_running_request(
    lab: Lab, redis_url: str
) -> None:
    """A failover that lost the inbox's read of a grant gives it again while its request
    runs: it is not handed back (that would free a slot in use)."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0)
    served = await lab.proxy(proxy_config([sim.url], slots=1, state={"redis": redis_url}))
    pool = served.state.pools["sim"]
    assert isinstance(pool, SharedPool)
    running = asyncio.create_task(
        lab.client(served, "A").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80)
    )
    await eventually(lambda: sim.stats.running == 1, within=10)
    ((ticket, (lease, _)),) = pool._held.items()
    assert ticket.backend is not None
    pool._grant(Grants([Grant(ticket.payload, lease, ticket.backend.name)]))  # read again
    await asyncio.sleep(0.2)  # a hand-back would have landed
    admin = aioredis.Redis.from_url(redis_url)
    try:
        assert await admin.hexists(pool_prefix("sim") + "lease", lease)
    finally:
        await admin.aclose()
    await running
