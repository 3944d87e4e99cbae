"""A flood cannot take the process's memory (docs/design.md §6, Queue memory): one org
floods a real ``sfq-proxy serve`` process whose backend has one slot; the requests waiting
stay within ``limits.queue_memory_mb`` (their count, and the process's RSS read from
``/proc``), another org is still admitted at once (the flood's newest request gives up its
place, with a 429), and every request of the flood gets an answer: none is dropped.

No timing is asserted. The RSS bound is generous (the budget plus 48 MiB of slack, against
~120 MiB that the same flood takes without a bound); each run prints its figures.
"""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from proxy_lab import KEYS, MODEL, Lab, config_yaml, eventually, proxy_config, serve_process
from redis_server import queued_in_redis

from sfq_proxy.config import MIB, REQUEST_OVERHEAD_BYTES, Config

BUDGET_MB = 16
BODY_CHARS = 16 * 1024
FLOOD = 4000
BATCH = 250
SLACK_MB = 48
WARM = [{"role": "user", "content": "hi"}]


def _evicted(task: asyncio.Task[tuple[int, Any]]) -> bool:
    """Whether a request of the flood gave its place in line to another flow's."""
    if not task.done():
        return False
    error = task.result()[1]
    return error is not None and "gave its place" in error["message"]


def rss_mib(pid: int) -> float:
    """The process's resident set, from the kernel (``VmRSS`` of ``/proc/<pid>/status``)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _queue_length(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(f"{url}/metrics") as reply:
        text = await reply.text()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sfq_queue_length{")
        )
    )


async def _flood_one(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    """One request of the flood: its status and its error, if it is one."""
    headers = {"Authorization": f"Bearer {KEYS['A']}", "Content-Type": "application/json"}
    async with http.post(f"{url}/v1/chat/completions", data=body, headers=headers) as reply:
        data = await reply.json()
        error = data.get("error") if reply.status != 200 else None
        if error is not None:
            assert set(error) == {"message", "type", "code"}  # the OpenAI error shape
            assert reply.headers.get("Retry-After") == "1", (reply.status, error)
        return reply.status, error


async def flood(lab: Lab, tmp_path: Path, budget_mb: int, *, other: bool = True) -> dict[str, Any]:
    """Flood org A's batch flow into a proxy with ``budget_mb`` of queue memory, then (if
    ``other``) send a request of org B; returns what was seen."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=100.0)
    config = config_yaml(
        [sim.url], slots=1, pool={"timeouts": {"connect_s": 1, "first_byte_s": 300}},
        limits={"max_body_bytes": 256 * 1024, "queue_memory_mb": budget_mb},
        classes={"batch": {"max_queue_len": 100_000, "max_queue_age_s": 600}},
    )  # fmt: skip
    data = yaml.safe_load(config)
    data["keys"] = [
        {"key": KEYS["A"], "org": "A", "classes": ["batch"]},
        {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
    ]
    proc, url = await serve_process(yaml.safe_dump(data), tmp_path)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # a refused one lets go
    http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["B"], max_retries=0)
    text = "x" * BODY_CHARS
    body = (
        f'{{"model": "{MODEL}", "max_tokens": 50, '
        f'"messages": [{{"role": "user", "content": "{text}"}}]}}'
    ).encode()
    results: list[asyncio.Task[tuple[int, Any]]] = []
    seen: dict[str, Any] = {}
    try:
        await client.chat.completions.create(model=MODEL, messages=WARM, max_tokens=2)
        seen["before"] = seen["peak"] = rss_mib(proc.pid)
        sim.hold()  # nothing is served meanwhile: the flood's line stays at the bound
        for _ in range(0, FLOOD, BATCH):  # in steps, so that what it holds is measured
            for _ in range(BATCH):
                results.append(asyncio.create_task(_flood_one(http, url, body)))
            sent = len(results)

            async def settled(sent: int = sent) -> bool:
                done = sum(task.done() for task in results)
                return done + await _queue_length(http, url) + 1 >= sent

            await eventually(settled, within=60)
            seen["peak"] = max(seen["peak"], rss_mib(proc.pid))
        seen["queued"] = await _queue_length(http, url)
        seen["held"] = rss_mib(proc.pid)
        seen["peak"] = max(seen["peak"], seen["held"])
        if other:
            # another org's request as large as the flood's, at the bound (what the flood
            # left is less than one of its own): admitted, the flood's newest giving its place
            asked = asyncio.create_task(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2
                )
            )
            await eventually(lambda: any(_evicted(task) for task in results), within=30)
            sim.release()
            seen["b_reply"] = await asked  # and served, next: its flow's meter is the lowest
            seen["evicted"] = sum(_evicted(task) for task in results)
    finally:
        proc.send_signal(signal.SIGTERM)  # what still waits is answered 503
        await asyncio.wait_for(proc.wait(), 30)
        sim.release()
    outcomes: Counter[tuple[int, str | None]] = Counter()
    for task in results:
        status, error = await task  # raises if a request was dropped (no answer)
        outcomes[(status, error and error["code"])] += 1
    seen["outcomes"] = outcomes
    await http.close()
    await client.close()
    return seen


async def test_a_flood_stays_within_the_queue_memory_and_others_are_still_admitted(
    lab: Lab, tmp_path: Path
) -> None:
    seen = await flood(lab, tmp_path, BUDGET_MB)
    per_request = REQUEST_OVERHEAD_BYTES + BODY_CHARS + 80  # its charge, the JSON around
    most = BUDGET_MB * MIB // per_request
    print(
        f"\nqueue memory {BUDGET_MB} MiB: {seen['queued']} of A's {FLOOD} requests queued "
        f"(at most {most}); RSS {seen['before']:.1f} MiB before, {seen['held']:.1f} MiB "
        f"with the flood queued, peak {seen['peak']:.1f} MiB; outcomes {dict(seen['outcomes'])}"
    )
    assert 0 < seen["queued"] <= most
    assert seen["peak"] - seen["before"] <= BUDGET_MB + SLACK_MB
    # B was admitted at the bound (and served): the flood's newest gave up its place
    assert seen["b_reply"].choices[0].message.content is not None
    assert seen["evicted"] >= 1  # B's request took the place of A's newest
    # every request of the flood got an answer: served, 429 queue_full, or 503 at the drain
    assert set(seen["outcomes"]) <= {(200, None), (429, "queue_full"), (503, "shutting_down")}
    assert sum(seen["outcomes"].values()) == FLOOD
    assert seen["outcomes"][(429, "queue_full")] >= FLOOD - most - 1


@pytest.mark.redis
async def test_with_redis_the_bound_is_the_processes_and_an_evicted_ticket_leaves_redis(
    lab: Lab, redis_url: str
) -> None:
    """With ``state: redis`` the lines are in Redis but the bodies and connections wait in
    the process: the same per-process bound holds, and a request pushed out of its line is
    taken out of Redis's too (uncharged), so that Redis's line is what the process holds."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=100.0)
    served = await lab.proxy(_one_mib_on_redis(sim.url, redis_url))
    most = MIB // REQUEST_OVERHEAD_BYTES
    sim.hold()
    a, b = lab.client(served, "A"), lab.client(served, "B")
    flood = [_ask(a) for _ in range(most + 20)]

    async def settled() -> bool:  # each refused, queued in Redis, or the one running
        done = sum(task.done() for task in flood)
        return done >= 20 and done + await queued_in_redis(redis_url) + 1 == len(flood)

    await eventually(settled, within=30)
    assert 0 < await queued_in_redis(redis_url) <= most
    refused = sum(task.done() for task in flood)
    # B's requests, as large as A's: once what A left is used, each pushes out A's newest
    others = [_ask(b) for _ in range(3)]
    await eventually(lambda: sum(task.done() for task in flood) > refused, within=30)

    async def agrees() -> bool:  # Redis's line is what waits in the process (one runs)
        waiting = sum(not task.done() for task in [*flood, *others]) - 1
        return await queued_in_redis(redis_url) == waiting

    await eventually(agrees, within=10)
    sim.release()
    for task in others:
        assert (await task).choices[0].message.content is not None
    codes: Counter[str] = Counter()
    for task in flood:  # every one answered: served, or 429 with Retry-After
        try:
            await task
            codes["ok"] += 1
        except openai.APIStatusError as err:
            error, after = err.response.json()["error"], err.response.headers["Retry-After"]
            codes[f"{err.status_code} {error['code']} {after}"] += 1
    assert set(codes) == {"ok", "429 queue_full 1"}
    assert codes["429 queue_full 1"] > refused  # pushed out for B's
    assert await queued_in_redis(redis_url) == 0


@pytest.mark.redis
async def test_with_redis_a_request_its_orgs_rate_refuses_pushes_nobody_out(
    lab: Lab, redis_url: str
) -> None:
    """The queue memory is full of A's waiting requests, and B's org has spent its rpm: B's
    next request is refused (429 rpm) and all of A's stay in line. On one Redis a submit
    carries its org's admission (one round trip instead of two), but not for a request that
    would take someone's place: refused after, it would have pushed out A's newest for
    nothing."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=100.0)
    served = await lab.proxy(_one_mib_on_redis(sim.url, redis_url, orgs={"B": {"rpm": 1}}))
    most = MIB // REQUEST_OVERHEAD_BYTES
    sim.hold()
    a, b = lab.client(served, "A"), lab.client(served, "B")
    first_b = _ask(b)  # B's one request a minute: it takes the slot, and holds it
    await eventually(lambda: sim.stats.waiting == 1, within=10)
    flood = [_ask(a) for _ in range(most + 20)]

    async def settled() -> bool:  # each refused or queued in Redis
        done = sum(task.done() for task in flood)
        return done >= 20 and done + await queued_in_redis(redis_url) == len(flood)

    await eventually(settled, within=30)
    refused = sum(task.done() for task in flood)
    with pytest.raises(openai.RateLimitError) as limited:
        await b.chat.completions.create(model=MODEL, messages=WARM, max_tokens=5)
    assert "rpm" in limited.value.message
    assert await queued_in_redis(redis_url) == len(flood) - refused  # nobody pushed out
    sim.release()
    assert (await first_b).choices[0].message.content is not None
    await asyncio.wait_for(asyncio.wait(flood), 60)
    errors = [task.exception() for task in flood]
    outcomes = Counter("ok" if e is None else getattr(e, "status_code", repr(e)) for e in errors)
    assert outcomes == {"ok": len(flood) - refused, 429: refused}


def _one_mib_on_redis(sim_url: str, redis_url: str, **options: Any) -> Config:
    """One slot, a queue memory of 1 MiB, the lines in Redis."""
    return proxy_config(
        [sim_url], slots=1, state={"redis": redis_url, "lease_ttl_s": 5},
        limits={"max_body_bytes": 256 * 1024, "queue_memory_mb": 1},
        pool={"timeouts": {"connect_s": 1, "first_byte_s": 300}}, **options,
    )  # fmt: skip


def _ask(client: openai.AsyncOpenAI) -> asyncio.Task[Any]:
    return asyncio.create_task(
        client.chat.completions.create(model=MODEL, messages=WARM, max_tokens=5)
    )
