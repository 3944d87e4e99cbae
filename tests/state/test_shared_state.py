"""Proxies sharing their pools' dispatch state in a real Redis form one fairness domain:
skewed ingress keeps the weights, and a backend's slots hold across proxies. Two
independent in-memory proxies fail both (shown, as the FIFO variants are in the lab)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, proxy_config
from redis_server import (
    RedisSentinel,
    RedisServer,
    fcalls,
    queued_in_redis,
    queued_is,
    running_redis,
)

from sfq_proxy.config import Config
from sfq_proxy.core.flows import Flow
from sfq_proxy.http.proxy import PROXY
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.state.redis_dispatch import (
    Grants,
    NotAdmitted,
    QueueFull,
    RedisDispatch,
    SharedTicket,
    pool_prefix,
)
from sfq_proxy.state.redis_functions import ADMISSION
from sfq_proxy.state.redis_limits import SharedLimits
from sfq_proxy.state.redis_pool import SharedPool
from sfq_proxy.state.redis_resp import Pipe

pytestmark = pytest.mark.redis
CHAT = [{"role": "user", "content": "hi"}]
PER_ORG = 40
TTL_S = 1.5  # where a test waits for a lease to lapse
CALM_TTL_S = 30  # elsewhere: a loaded machine may stall the loop (shared with clients) 1.5 s


def weighted(sims: list[SimBackend], state: Any, **options: Any) -> Config:
    """A 4:1 between orgs A and B, one slot per backend."""
    orgs = {"A": {"weight": 4}}
    return proxy_config([s.url for s in sims], slots=1, orgs=orgs, state=state, **options)


async def skewed_flood(lab: Lab, sim: SimBackend, proxies: list[Served], queued: Any) -> list[str]:
    """A's requests enter only the first proxy, B's only the second, while the backend is
    held; once ``queued()`` says all wait, it is let go. The orgs in the order it served them."""
    sim.hold()
    flood = [
        lab.client(proxy, org).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=10, user=org
        )
        for _ in range(PER_ORG)
        for proxy, org in zip(proxies, "AB", strict=True)
    ]
    replies = asyncio.gather(*flood)
    await eventually(queued, within=10)
    sim.release()
    await replies
    return [r.user for r in sim.stats.log]


async def outcome(lab: Lab, served: Served, user: str, tokens: int) -> str:
    """A streamed request's fate: answered, cut mid-stream, or refused (status and code)."""
    try:
        reply = await lab.client(served, "A").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=tokens, user=user, stream=True
        )
        async for _ in reply:
            pass
        return "answered"
    except openai.APIStatusError as err:
        return f"{err.status_code} {err.body and err.body.get('code')}"  # type: ignore[union-attr]
    except openai.APIError:
        return "cut"


def out_of_bound(order: list[str], skip: int) -> list[str]:
    """Where a 4:1 order breaks the SFQ bound |W_A/4 − W_B/1| ≤ c/4 + c (c: one request)
    while both orgs wait: from the ``skip`` first, which went before anything queued,
    until either org has nothing left. Empty when it never does."""
    total: Counter[str] = Counter(order[:skip])
    served: Counter[str] = Counter()
    broken = []
    for org in order[skip:]:
        total[org] += 1
        served[org] += 1
        both_wait = total["A"] < PER_ORG and total["B"] < PER_ORG
        if both_wait and abs(served["A"] / 4 - served["B"]) > 1 / 4 + 1:
            broken.append(f"after {served['A']} A and {served['B']} B")
    return broken


async def test_skewed_ingress_keeps_the_weights_across_two_proxies(
    lab: Lab, redis_url: str
) -> None:
    sim = await lab.backend(max_num_seqs=4)
    shared = {"redis": redis_url, "lease_ttl_s": CALM_TTL_S}
    proxies = [await lab.proxy(weighted([sim], shared)) for _ in range(2)]

    async def all_wait() -> bool:  # the first one holds the slot, in the held backend
        return await queued_is(redis_url, 2 * PER_ORG - 1) and all(
            sum(v.backlog for v in p.state.pools["sim"].flow_views()) == 2 * PER_ORG - 1
            for p in proxies
        )  # and each proxy shows the whole pool's lines (as of its last heartbeat)

    order = await skewed_flood(lab, sim, proxies, all_wait)
    assert Counter(order) == {"A": PER_ORG, "B": PER_ORG}
    assert out_of_bound(order, skip=1) == [], "".join(order)
    assert 31 <= Counter(order[1:41])["A"] <= 33, "".join(order)  # 4:1 while both wait
    assert sim.stats.max_concurrent == 1  # one slot, whichever proxy dispatched
    print(f"shared: A {Counter(order[1:41])['A']} of 40 while both waited, at most 1 running")


async def test_two_independent_proxies_split_the_slot_and_the_share(lab: Lab) -> None:
    """The failure the shared state exists for: each in-memory proxy is its own fairness
    domain, so the backend gets one request from each (2 on 1 slot) and A gets 1:1."""
    sim = await lab.backend(max_num_seqs=4)
    proxies = [await lab.proxy(weighted([sim], "memory")) for _ in range(2)]

    def all_wait() -> bool:
        return sum(len(p.queue()) for p in proxies) == 2 * PER_ORG - 2

    order = await skewed_flood(lab, sim, proxies, all_wait)
    assert sim.stats.max_concurrent == 2  # one slot, exceeded
    assert out_of_bound(order, skip=2) != []
    assert abs(Counter(order[:40])["A"] - 20) <= 2  # 1:1, not 4:1
    broken = len(out_of_bound(order, skip=2))
    print(f"independent: A {Counter(order[:40])['A']} of 40, bound broken at {broken} steps")


async def test_redis_lost_mid_run_fails_closed_and_every_client_hears(
    lab: Lab, redis_server: RedisServer, redis_url: str
) -> None:
    """Redis stopped while requests run and wait, then started again (empty, as a restart
    without persistence leaves it): new requests get 503 + Retry-After at once; after the
    lease TTL, waiting ones get 503 and running ones end (another replica could hold their
    slots by then); once Redis is back the proxy joins again and serves. Every client gets
    an answer or an error, nothing is sent twice, the slots hold throughout."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0, max_num_seqs=8)
    shared = {"redis": redis_url, "lease_ttl_s": TTL_S}
    served = await lab.proxy(proxy_config([sim.url], slots=2, state=shared))
    http = await lab.http()

    def one(user: str, tokens: int) -> Coroutine[Any, Any, str]:
        return outcome(lab, served, user, tokens)

    running = [asyncio.create_task(one(f"run{i}", 2000)) for i in range(2)]
    await eventually(lambda: sim.stats.running == 2, within=10)
    waiting = [asyncio.create_task(one(f"wait{i}", 5)) for i in range(3)]
    await eventually(lambda: queued_in_redis(redis_url), within=10)

    redis_server.stop()
    assert await one("while-down", 5) == "503 state_unavailable"
    await eventually(lambda: not served.state.pools["sim"].ready(), within=TTL_S)
    async with http.get(f"{served.url}/readyz") as r:
        assert r.status == 503
    async with http.post(
        f"{served.url}/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT},
        headers={"Authorization": f"Bearer {KEYS['A']}"},
    ) as r:
        assert (r.status, r.headers.get("Retry-After")) == (503, "1")
    outcomes = await asyncio.wait_for(asyncio.gather(*running, *waiting), 4 * TTL_S)
    assert outcomes == ["cut"] * 2 + ["503 state_unavailable"] * 3
    await eventually(lambda: sim.stats.running == 0, within=2)

    redis_server.start()
    await eventually(lambda: served.state.pools["sim"].ready(), within=3 * TTL_S)
    assert await one("after", 5) == "answered"
    users = [r.user for r in sim.stats.log]
    assert sorted(users) == sorted(["run0", "run1", "after"])  # the waiting never went
    assert sim.stats.max_concurrent <= 2


async def test_on_shutdown_the_queued_leave_and_the_running_drain(lab: Lab, redis_url: str) -> None:
    """SIGTERM's drain hands no slot to a process on its way out: its queued requests leave
    the shared line at once with 503 + Retry-After (a client retries on a replica that
    stays), its running ones finish, and Redis holds nothing of it afterwards."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0)
    config = proxy_config([sim.url], slots=1, state={"redis": redis_url, "lease_ttl_s": 2})
    async with running(config) as runner:
        url = bound_url(runner)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0)
        first = asyncio.create_task(
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40)
        )
        await eventually(lambda: sim.stats.running == 1, within=10)
        queued = [
            asyncio.create_task(
                client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
            )
            for _ in range(3)
        ]
        await eventually(lambda: queued_is(redis_url, 3), within=10)
        own = runner.app[PROXY].state()["sim"]
        assert (own["queued"], own["running"], own["shared"]["joined"]) == (3, 1, True)
        shutdown = asyncio.create_task(runner.cleanup())
        for task in queued:
            with pytest.raises(openai.APIStatusError) as refused:
                await task
            assert refused.value.status_code == 503
            assert refused.value.response.headers["Retry-After"] == "1"
        assert (await first).usage.completion_tokens == 40  # drained, not cut
        await shutdown
        await client.close()
    assert [r.outcome for r in sim.stats.log] == ["completed"]
    assert await queued_in_redis(redis_url) == 0
    check = aioredis.Redis.from_url(redis_url)
    assert await check.hgetall("sfq:{sim}:lease") == {}
    await check.aclose()


@pytest.mark.parametrize("shared", [True, False])
async def test_an_orgs_rpm_holds_across_proxies_only_when_shared(
    lab: Lab, redis_url: str, shared: bool
) -> None:
    """rpm 6 (a minute's burst: 6 at once), 4 requests through each of two proxies: shared,
    6 pass and 2 get 429 with the wait; two independent proxies let all 8 through, each
    giving the org its whole rate (the failure seen with several instances of a gateway)."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": CALM_TTL_S} if shared else "memory"
    config = proxy_config([sim.url], state=state, orgs={"A": {"rpm": 6}})
    proxies = [await lab.proxy(config) for _ in range(2)]

    remaining: list[int] = []  # what each answer's x-ratelimit-remaining-requests said

    async def one(proxy: Served) -> str:
        try:
            answer = await lab.client(proxy, "A").chat.completions.with_raw_response.create(
                model=MODEL, messages=CHAT, max_tokens=2
            )
            assert answer.headers["x-ratelimit-limit-requests"] == "6"
            remaining.append(int(answer.headers["x-ratelimit-remaining-requests"]))
            return "ok"
        except openai.RateLimitError as err:
            left = err.response.headers["x-ratelimit-remaining-requests"]
            wait = float(err.response.headers["Retry-After"])
            return f"429 {err.body['code']} {left}" if wait >= 1 else "429 without a wait"  # type: ignore[index]

    outcomes = Counter([await one(p) for p in proxies for _ in range(4)])
    assert outcomes == ({"ok": 6, "429 rpm 0": 2} if shared else {"ok": 8})
    # the headers say the org's buckets as Redis holds them, across both proxies; each
    # proxy's own when they are not shared
    assert remaining == ([5, 4, 3, 2, 1, 0] if shared else [5, 4, 3, 2] * 2)


async def test_an_orgs_rpm_holds_for_requests_that_come_at_once(lab: Lab, redis_url: str) -> None:
    """rpm 6, twelve requests at once through each of two proxies: their admissions leave
    each proxy together (``state/redis_batcher.py``), and still exactly 6 pass."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": CALM_TTL_S}
    config = proxy_config([sim.url], state=state, orgs={"A": {"rpm": 6}})
    proxies = [await lab.proxy(config) for _ in range(2)]

    async def one(proxy: Served) -> str:
        try:
            await lab.client(proxy, "A").chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2
            )
            return "ok"
        except openai.RateLimitError as err:
            return f"429 {err.body['code']}"  # type: ignore[index]

    outcomes = Counter(await asyncio.gather(*(one(p) for p in proxies for _ in range(12))))
    assert outcomes == {"ok": 6, "429 rpm": 18}


async def test_admissions_sent_as_one_call_decide_in_order(redis_url: str) -> None:
    """admission.lua's ``batch``: each operation decides as it would on its own, in order:
    an Idempotency-Key taken by the first is refused to the second, rpm 2 lets two through."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        key = f"sfq:{{org:batch-{uuid.uuid4().hex}}}:"
        admit = ("admit", "2", "", "1")
        calls = [(*admit, "d1", 5000), (*admit, "d1", 5000), (*admit, "", 5000), admit]
        replies = await ADMISSION.call_all(client, key, calls)
        assert [reply[0] for reply in replies] == [1, 409, 1, 429]
        assert await client.exists(key + "idem:d1") == 1
    finally:
        await client.aclose()


async def test_an_orgs_buckets_in_redis_take_give_back_and_name_the_limit(redis_url: str) -> None:
    """admission.lua with rpm and tpm: an admit takes a request and its tokens, a refund gives
    them back; a 429 says how long and which bucket waits the longest (1: requests, 2: tokens);
    every reply says what each bucket holds (the x-ratelimit-* headers). Sent one by one or as
    one batch (one instant of Redis's clock: exact), they decide alike."""
    admit, refund = ("admit", "100", "1000", "400"), ("refund", "100", "1000", "400")
    # reply: status[, wait ms, which], then per bucket: whole left, ms until full again
    expected = [
        [1, 99, 600, 600, 24000],
        [1, 98, 1200, 200, 48000],
        [429, 12000, 2, 98, 1200, 200, 48000],  # 400 tokens asked, 200 left: 12 s at 1000/min
        [1],
        [1, 98, 1200, 200, 48000],  # the refund gave back one request and 400 tokens
    ]
    requests_first = [("admit", "1", "1000", "10"), ("admit", "1", "1000", "990")]
    client = aioredis.Redis.from_url(redis_url)
    try:
        key = f"sfq:{{org:tpm-{uuid.uuid4().hex}}}:"
        together = await ADMISSION.call_all(client, key, [admit, admit, admit, refund, admit])
        assert together == expected
        key = f"sfq:{{org:rpm-{uuid.uuid4().hex}}}:"
        second = (await ADMISSION.call_all(client, key, requests_first))[1]
        assert second[:3] == [429, 60000, 1]  # both wait: the requests' bucket, a minute
        key = f"sfq:{{org:apart-{uuid.uuid4().hex}}}:"
        apart = [await ADMISSION.call_all(client, key, [call]) for call in
                 (admit, admit, admit, refund, admit)]  # fmt: skip
        for (reply,), exact in zip(apart, expected, strict=True):
            assert reply[0] == exact[0]
            assert len(reply) == len(exact)
            assert reply[0] != 429 or reply[2] == exact[2]  # which bucket
            # milliseconds pass between calls: the buckets refill by a little
            pairs = zip(reply[1:], exact[1:], strict=True)
            assert all(abs(got - want) <= want * 0.01 + 1 for got, want in pairs)
    finally:
        await client.aclose()


async def test_a_submit_decides_the_admission_it_carries_in_the_same_call(redis_url: str) -> None:
    """On one Redis a pool's submit carries its org's admission (admission.lua's admit): one
    FCALL. Admitted: the ticket is granted or queued, and the reply says what the buckets
    hold. Refused (429 with the wait and the bucket, 409 for a live Idempotency-Key): nothing
    queued, nothing taken. Its line full: the admission stands, for the caller to refund."""
    client, pipe = aioredis.Redis.from_url(redis_url), Pipe.from_url(redis_url)
    assert pipe is not None
    try:
        run = uuid.uuid4().hex
        pool, org = f"carry-{run}", f"sfq:{{org:carry-{run}}}:"
        holder = RedisDispatch(client, pool, "h0", pipe)
        await holder.heartbeat(CALM_TTL_S, new=True)
        await holder.configure([("b0", 1)], {}, {})
        ticket = SharedTicket("a", "x", 1.0, 1.0, tokens=400)
        admit = (org, "2", "1000", "400", "", "5000")  # rpm 2, tpm 1000, 400 tokens
        before = await fcalls(client)
        granted = await holder.submit("t1", ticket, admit=admit)
        assert await fcalls(client) - before == 1
        assert [grant.ticket for grant in granted] == ["t1"]
        assert granted.admitted == [1, 1, 30000, 600, 24000]  # left, ms until full: r, then t
        keyed = await holder.submit("t2", ticket, admit=(*admit[:4], "d1", "5000"))
        assert (list(keyed), keyed.admitted and keyed.admitted[0]) == ([], 1)  # queued
        assert await client.exists(org + "idem:d1") == 1
        held = await client.hgetall(org + "bucket:r"), await client.hgetall(org + "bucket:t")
        with pytest.raises(NotAdmitted) as spent:  # rpm 2: a third waits ~30 s
            await holder.submit("t3", ticket, admit=admit)
        status, wait_ms, which = spent.value.reply[:3]
        assert (status, which, 29000 < wait_ms <= 30000) == (429, 1, True)
        with pytest.raises(NotAdmitted) as twice:
            await holder.submit("t4", ticket, admit=(*admit[:4], "d1", "5000"))
        assert twice.value.reply == [409]
        assert await client.hkeys(pool_prefix(pool) + "ticket") == [b"t2"]  # t3, t4: not in
        assert (
            await client.hgetall(org + "bucket:r"),
            await client.hgetall(org + "bucket:t"),
        ) == held
        other = f"sfq:{{org:carry-other-{run}}}:"
        with pytest.raises(QueueFull) as full:  # t2 waits in a/x: one is its max
            await holder.submit("t5", ticket, max_ahead=1, admit=(other, *admit[1:]))
        assert (full.value.ahead, full.value.admitted) == (1, [1, 1, 30000, 600, 24000])
        # sent together (one call after the first), each its own org's buckets, in order
        orgs = [f"sfq:{{org:carry-{i}-{run}}}:" for i in range(3)]
        before = await fcalls(client)
        replies = await asyncio.gather(
            *(holder.submit(f"u{i}", ticket, admit=(orgs[i % 3], *admit[1:])) for i in range(7)),
            return_exceptions=True,
        )
        assert await fcalls(client) - before == 2
        left = [r.admitted[1] if isinstance(r, Grants) and r.admitted else r for r in replies]
        assert left[:6] == [1, 1, 1, 0, 0, 0]  # rpm 2 each: the seventh, org 0's third, waits
        assert isinstance(left[6], NotAdmitted)
    finally:
        await client.aclose()
        await pipe.aclose()


async def test_an_orgs_admission_rides_with_its_submit_through_the_proxy(
    lab: Lab, redis_url: str
) -> None:
    """An org with rpm and tpm on one Redis: each request makes two function calls, its
    submit (which decides its admission too) and its finish, not three; its answer says the
    org's buckets as Redis holds them after its own take."""
    sim = await lab.backend()
    state = {"redis": redis_url, "lease_ttl_s": CALM_TTL_S}
    config = proxy_config([sim.url], state=state, orgs={"A": {"rpm": 100, "tpm": 10**6}})
    served = await lab.proxy(config)
    client, redis = lab.client(served, "A"), aioredis.Redis.from_url(redis_url)
    try:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        before = await fcalls(redis)
        remaining = []
        for _ in range(6):
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=CHAT, max_tokens=2
            )
            remaining.append(raw.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["98", "97", "96", "95", "94", "93"]  # one taken by each

        async def finished() -> bool:  # the finishes are handed back after the answers
            return await fcalls(redis) - before >= 12

        await eventually(finished, within=10)
        assert await fcalls(redis) - before <= 12 + 2  # a heartbeat and its view may fall in
    finally:
        await redis.aclose()


async def test_an_admission_that_lands_after_its_request_ended_is_undone(
    redis_url: str,
) -> None:
    """Its client left while the submit that carried its admission was on its way: the
    admission lands after the request ended, and is undone at once, its tokens given back
    and its Idempotency-Key free again."""
    pipe = Pipe.from_url(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    assert pipe is not None
    try:
        state = {"redis": redis_url}
        config = proxy_config(["http://127.0.0.1:9"], state=state, orgs={"A": {"rpm": 60}})
        intake = SharedLimits(pipe, config, lambda: 1).intake(Flow("A", "x", "sim"), 10, "order-7")
        intake.end()  # the client left before its admission was decided
        holder = RedisDispatch(client, "sim", "h0", pipe)
        await holder.heartbeat(CALM_TTL_S, new=True)
        await holder.configure([("b0", 1)], {}, {})
        ticket = SharedTicket("A", "x", 1.0, 1.0)
        granted = await holder.submit("t1", ticket, admit=intake.carried())
        assert granted.admitted is not None
        assert granted.admitted[:2] == [1, 59]  # taken
        intake.settle(granted.admitted)
        prefix = "sfq:{org:A}:"

        async def undone() -> bool:
            level = await client.hget(prefix + "bucket:r", "level")
            return float(level or 0) == 60 and not await client.exists(prefix + "idem:" + DIGEST_7)

        await eventually(undone, within=5)
    finally:
        await client.aclose()
        await pipe.aclose()


DIGEST_7 = hashlib.sha256(b"order-7").hexdigest()


async def test_an_idempotency_key_is_one_request_across_proxies(lab: Lab, redis_url: str) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0)
    config = proxy_config([sim.url], state={"redis": redis_url, "lease_ttl_s": CALM_TTL_S})
    first, second = [await lab.proxy(config) for _ in range(2)]
    key = {"Idempotency-Key": "order-42"}
    running = asyncio.create_task(
        lab.client(first, "A").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, extra_headers=key
        )
    )
    await eventually(lambda: sim.stats.running == 1, within=10)
    with pytest.raises(openai.ConflictError):
        await lab.client(second, "A").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_headers=key
        )
    # another org's key of the same name is its own
    other = await lab.client(second, "B").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_headers=key
    )
    assert other.usage is not None
    assert (await running).usage.completion_tokens == 20  # type: ignore[union-attr]

    async def free_again() -> bool:
        try:
            await lab.client(second, "A").chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, extra_headers=key
            )
            return True
        except openai.ConflictError:
            return False

    await eventually(free_again, within=2)  # released once the first is done


async def test_a_lease_that_could_not_be_handed_back_is_handed_back_later(
    lab: Lab, redis_url: str
) -> None:
    """Redis refuses the call that hands a finished request's lease back (its ACL, for a
    moment): the lease is tried again at the next heartbeat, rather than kept held by a
    heartbeat that renews it for as long as the process lives."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0)
    served = await lab.proxy(
        proxy_config([sim.url], slots=1, state={"redis": redis_url, "lease_ttl_s": 3})
    )
    client = lab.client(served, "A")
    admin = aioredis.Redis.from_url(redis_url)
    first = asyncio.create_task(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20)
    )
    await eventually(lambda: sim.stats.running == 1, within=10)
    await admin.execute_command("ACL", "SETUSER", "default", "-fcall")
    try:
        await first  # its lease's hand-back is refused (NOPERM)
    finally:
        await admin.execute_command("ACL", "SETUSER", "default", "+fcall")
    second = await asyncio.wait_for(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2), 5
    )
    assert second.usage is not None
    await eventually(lambda: _no_lease(admin), within=3)
    assert sim.stats.max_concurrent == 1
    await admin.aclose()


async def _no_lease(admin: aioredis.Redis) -> bool:
    return await admin.hlen("sfq:{sim}:lease") == 0


async def test_a_redis_behind_sentinel_is_found_through_it(lab: Lab) -> None:
    """``state: {sentinel: ...}``: the proxy asks the sentinels for the primary, and its
    pool's state lives there."""
    with running_redis() as primary:
        sentinel = RedisSentinel(primary_port=primary.port)
        sentinel.start()
        try:
            sim = await lab.backend()
            hosts = [f"127.0.0.1:{sentinel.port}"]
            state = {"sentinel": {"hosts": hosts, "service": "mymaster"}, "lease_ttl_s": TTL_S}
            served = await lab.proxy(proxy_config([sim.url], state=state))
            reply = await lab.client(served, "A").chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=3
            )
            assert reply.usage is not None
            check = aioredis.Redis.from_url(primary.url)
            assert await check.zcard("sfq:{sim}:holders") == 1
            await check.aclose()
        finally:
            sentinel.stop()


async def test_a_grant_on_a_backend_the_replica_does_not_know_is_a_clear_503(
    lab: Lab, redis_url: str
) -> None:
    """Mid-rollout, two replicas list different backends and the last to join is what Redis
    places on: a request through the other replica granted a backend it does not know hands
    its lease back and is answered 503 ``backend_unknown`` with Retry-After, at once (it
    waited for its deadline before), and the slot is free again."""
    first, second = await lab.backend(), await lab.backend()
    shared = {"redis": redis_url, "lease_ttl_s": CALM_TTL_S}
    old = await lab.proxy(proxy_config([first.url], slots=1, state=shared))
    await lab.proxy(proxy_config([second.url], slots=1, state=shared))  # Redis now lists it
    client = lab.client(old, "A", timeout=10)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "backend_unknown"  # type: ignore[index]
    client = aioredis.Redis.from_url(redis_url)
    try:
        await eventually(lambda: _no_lease(client), within=5)
    finally:
        await client.aclose()


async def _no_lease(client: aioredis.Redis) -> bool:
    return await client.hlen(pool_prefix("sim") + "lease") == 0


async def test_a_fenced_replica_joins_again_at_once_when_redis_answers(
    lab: Lab, redis_url: str
) -> None:
    """Redis forgets this replica (restarted empty: FLUSHALL), ``fail_closed``: at the next
    heartbeat its leases are gone and it is fenced. Redis answers, so it joins again in the
    same step, not a heartbeat later: requests sent every 50 ms meanwhile are refused for a
    moment, not for the third of the TTL (1 s here) until the next beat and the one after.
    A submit that finds the replica fenced wakes the heartbeat."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], state={"redis": redis_url, "lease_ttl_s": 3}))
    pool = served.state.pools["sim"]
    assert isinstance(pool, SharedPool)
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    outcomes: Counter[str] = Counter()
    for _ in range(60):  # 3 s: the fence comes within a beat (1 s)
        try:
            await lab.client(served, "A").chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=1
            )
            outcomes["answered"] += 1
        except openai.APIStatusError as err:
            outcomes[str(err.status_code)] += 1
        await asyncio.sleep(0.05)
    assert set(outcomes) <= {"answered", "503"}, outcomes
    assert outcomes["503"] <= 5, outcomes  # before: 36 (the beat, and the one after)
    print(f"after Redis forgot the replica: {dict(outcomes)}")
