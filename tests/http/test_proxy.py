"""The proxy end to end: real sockets, simulated vLLM servers, the openai SDK as client."""

from __future__ import annotations

import asyncio
from collections import Counter

import openai
import pytest
from aiohttp import web
from proxy_lab import (
    KEYS,
    MODEL,
    Lab,
    Served,
    assert_alternate,
    dispatched_behind,
    eventually,
    proxy_config,
)

from sfq_proxy.http.proxy import PROXY
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.server import SimBackend

CHAT = [{"role": "user", "content": "Say something fair."}]


async def test_chat_and_completions_streaming_and_not(lab: Lab) -> None:
    sim = await lab.backend()
    client = lab.client(await lab.proxy(proxy_config([sim.url])))

    chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5
    assert len(chat.choices[0].message.content.split()) == 5

    text = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert text.usage is not None
    assert text.usage.completion_tokens == 3

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    words = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(words.split()) == 4
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4

    stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=6, stream=True)
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert len("".join(pieces).split()) == 6

    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert sim.stats.completed == 4
    assert not any(record.had_authorization for record in sim.stats.log)


async def test_stream_is_relayed_as_it_is_generated(lab: Lab) -> None:
    """The first token reaches the client long before the last is generated."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=50.0)  # 20 ms per token
    client = lab.client(await lab.proxy(proxy_config([sim.url])))
    stream = await client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=25, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert sim.stats.log[0].ended_at is None  # still generating: nothing was buffered
    await stream.close()


async def test_200_concurrent_requests_complete_once_within_slots(lab: Lab) -> None:
    sims = [await lab.backend(max_num_seqs=16) for _ in range(2)]
    served = await lab.proxy(proxy_config([s.url for s in sims], slots=4))
    clients = [lab.client(served, org) for org in "ABC"]

    async def one(i: int) -> int:
        reply = await clients[i % 3].chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=8, user=f"r{i}", stream=i % 2 == 0
        )
        if i % 2 == 0:
            return sum([1 async for c in reply if c.choices and c.choices[0].delta.content])
        return reply.usage.completion_tokens

    tokens = await asyncio.gather(*(one(i) for i in range(200)))
    assert tokens == [8] * 200
    assert sum(s.stats.requests_seen for s in sims) == 200
    assert sum(s.stats.completed for s in sims) == 200
    assert all(s.stats.max_concurrent <= 4 for s in sims)
    assert all(s.stats.requests_seen > 50 for s in sims)  # both used
    users = [record.user for s in sims for record in s.stats.log]
    assert sorted(users) == sorted(f"r{i}" for i in range(200))


async def _flood(lab: Lab, sim: SimBackend, served: Served, per_org: int) -> list[str]:
    """Orgs A and B each queue ``per_org`` identical requests behind C's long stream, which
    holds the only slot; returns A/B in the order the backend then saw them."""
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True, user="C"
    )
    clients = {org: lab.client(served, org) for org in "AB"}
    flood = [
        clients[org].chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, user=org)
        for _ in range(per_org)
        for org in "AB"
    ]
    await dispatched_behind(served, blocker, flood)
    return [r.user for r in sim.stats.log if r.user != "C"]


def _prefix_counts(order: list[str]) -> list[Counter[str]]:
    counts: Counter[str] = Counter()
    prefixes = []
    for org in order:
        counts[org] += 1
        prefixes.append(counts.copy())
    return prefixes


async def test_equal_weights_alternate_through_one_slot(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1))
    order = await _flood(lab, sim, served, per_org=60)
    assert_alternate(order, per_org=60)


async def test_weights_two_to_one_stay_within_the_sfq_bound(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1, orgs={"A": {"weight": 2}}))
    order = await _flood(lab, sim, served, per_org=60)
    for counts in _prefix_counts(order):
        if counts["A"] < 60 and counts["B"] < 60:
            # |W_A/w_A − W_B/w_B| ≤ c/w_A + c/w_B, in units of one request's cost c
            assert abs(counts["A"] / 2 - counts["B"]) <= 1 / 2 + 1, order
    first_half = Counter(order[:60])
    assert 38 <= first_half["A"] <= 42, first_half  # 2:1 while both wait


async def test_disconnect_mid_stream_aborts_upstream_and_frees_the_slot(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1, time_scale=1.0, decode_tokens_per_s=50.0)
    served = await lab.proxy(proxy_config([sim.url], slots=1))
    leaver, stayer = lab.client(served, "A"), lab.client(served, "B")
    stream = await leaver.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=500, stream=True, user="leaver"
    )
    async for _ in stream:
        break
    waiting = asyncio.create_task(
        stayer.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, user="stayer")
    )
    await eventually(lambda: served.queue().backlog("B/batch") == 1)
    await stream.close()
    await eventually(lambda: sim.stats.aborted == 1, within=1.0)
    reply = await asyncio.wait_for(waiting, 5)
    assert reply.usage.completion_tokens == 2
    assert [r.user for r in sim.stats.log] == ["leaver", "stayer"]


async def test_queued_request_whose_client_leaves_is_never_sent_nor_charged(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1))
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True, user="C"
    )
    others = [
        asyncio.create_task(
            lab.client(served, "B").chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, user="B"
            )
        )
        for _ in range(2)
    ]
    leaver = asyncio.create_task(
        lab.client(served, "A").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, user="leaver"
        )
    )
    queue = served.queue()
    await eventually(lambda: queue.backlog("A/batch") == 1 and queue.backlog("B/batch") == 2)
    meter = queue.meter("A/batch")
    leaver.cancel()
    await eventually(lambda: queue.backlog("A/batch") == 0)
    assert queue.meter("A/batch") == meter
    await blocker.close()
    await asyncio.gather(*others)
    assert [r.user for r in sim.stats.log] == ["C", "B", "B"]
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    assert not served.state.metrics.registry.get_sample_value("sfq_cost_charged_total", labels)


async def test_a_killed_backend_is_routed_around_and_used_again_when_back(lab: Lab) -> None:
    steady = await lab.backend(max_num_seqs=2)
    doomed = await lab.backend(max_num_seqs=2)
    retry = {"budget_ratio": 1.0}  # this test is about routing, not about the retry budget
    served = await lab.proxy(proxy_config([steady.url, doomed.url], slots=2, retry=retry))
    client = lab.client(served)

    async def one(i: int) -> int:
        reply = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=20, user=str(i)
        )
        return reply.usage.completion_tokens

    first = [asyncio.create_task(one(i)) for i in range(40)]
    await eventually(lambda: doomed.stats.completed >= 3)
    await doomed.stop()
    assert await asyncio.gather(*first) == [20] * 40  # in-flight ones were retried elsewhere

    port = doomed.port
    back = await lab.backend(port=port, max_num_seqs=2)
    target = served.state.pools["sim"].placement.backends[1]
    await eventually(lambda: target.healthy, within=5)
    assert await asyncio.gather(*(one(i) for i in range(20))) == [20] * 20
    assert back.stats.completed > 0


async def test_shutdown_drains_in_flight_requests(lab: Lab) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=100.0)
    config = proxy_config([sim.url])
    async with running(config) as runner:
        served = Served(url=bound_url(runner), state=runner.app[PROXY])
        client = lab.client(served)
        reply = asyncio.create_task(
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30)
        )
        await eventually(lambda: sim.stats.running == 1)
    # the block exited (as on SIGTERM) while the request was generating: it still completes
    assert (await reply).usage.completion_tokens == 30
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)


async def test_upstream_key_replaces_the_client_key(lab: Lab) -> None:
    sim = await lab.backend()
    config = proxy_config(
        [sim.url], pool={"upstream_key_env": "PROVIDER_KEY"}, environ={"PROVIDER_KEY": "sk-p"}
    )
    served = await lab.proxy(config)
    await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert sim.stats.log[0].had_authorization


async def test_a_backend_that_keeps_dying_costs_max_attempts_then_502(lab: Lab) -> None:
    sim = await lab.backend()
    retry = {"max_attempts": 3, "budget_ratio": 1.0, "backoff_base_s": 0.01}
    served = await lab.proxy(proxy_config([sim.url], retry=retry))
    client = lab.client(served)
    for _ in range(4):  # recent requests, so the retry budget (1.0 × requests) has room
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    await sim.update_faults(die_after_tokens=1)  # hangs up before answering
    with pytest.raises(openai.InternalServerError) as info:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
    assert info.value.status_code == 502
    assert sim.stats.requests_seen == 4 + 3  # retry.max_attempts, each dispatched (and charged)


async def test_first_byte_timeout_is_504(lab: Lab) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=10.0)  # 100 ms per token
    served = await lab.proxy(proxy_config([sim.url], pool={"timeouts": {"first_byte_s": 0.2}}))
    with pytest.raises(openai.APIStatusError) as info:
        await lab.client(served).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20)
    assert info.value.status_code == 504
    await eventually(lambda: sim.stats.aborted == 1)  # the upstream request was closed


async def test_no_key_appears_in_metrics_or_admin_state(lab: Lab) -> None:
    sim = await lab.backend()
    config = proxy_config([sim.url], admin_key_env="ADMIN", environ={"ADMIN": "sk-admin-XYZ"})
    served = await lab.proxy(config)
    for org in "ABC":
        await lab.client(served, org).chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=1
        )
    http = await lab.http()
    async with http.get(f"{served.url}/metrics") as r:
        metrics = await r.text()
    async with http.get(
        f"{served.url}/admin/state", headers={"Authorization": "Bearer sk-admin-XYZ"}
    ) as r:
        assert r.status == 200
        state = await r.json()
    async with http.get(f"{served.url}/admin/state", headers={"Authorization": "Bearer no"}) as r:
        assert r.status == 401
    assert state["pools"]["sim"]["backends"][0]["slots"] == 4
    assert [d["flow"] for d in state["pools"]["sim"]["recent_dispatches"]] == [
        "A/batch",
        "B/batch",
        "C/interactive",
    ]
    assert 'sfq_requests_total{class="batch",org="A",outcome="completed",pool="sim"} 1.0' in metrics
    for secret in [*KEYS.values(), "sk-admin-XYZ"]:
        assert secret not in metrics
        assert secret not in str(state)


async def test_embeddings_are_relayed_and_cost_their_input_only(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    reply = await lab.client(served).embeddings.create(model=MODEL, input=["x" * 40, "y" * 20])
    assert [d.index for d in reply.data] == [0, 1]
    assert reply.usage.prompt_tokens == 15
    labels = {"org": "A", "class": "batch", "pool": "sim"}
    charged = served.state.metrics.registry.get_sample_value("sfq_cost_charged_total", labels)
    assert charged == 15  # input_weight 1 × 60 chars / 4; no output


async def test_a_backends_cookie_is_never_sent_on_anyones_later_request(lab: Lab) -> None:
    """One upstream session serves every client: a cookie kept in it (a load balancer's
    affinity cookie, say) would ride on every other org's requests."""
    cookies: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        cookies.append(request.headers.get("Cookie"))
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        response = web.json_response({"object": "chat.completion", "choices": [], "usage": usage})
        response.set_cookie("affinity", "backend-1")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    port = await lab.serve(app)
    # a host name, not an IP: aiohttp's default jar keeps cookies only for host names
    served = await lab.proxy(proxy_config([f"http://localhost:{port}"]))
    for org in ("A", "B"):
        await lab.client(served, org).chat.completions.create(model=MODEL, messages=CHAT)
    assert cookies == [None, None]


async def test_the_answer_says_what_its_flow_was_charged(lab: Lab) -> None:
    """X-Cost-Charged is the estimate the flow's meter was charged at dispatch; once the
    answer ended, the meter is trued up to the usage the backend reported."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    reply = await lab.client(served).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "12345678"}], max_tokens=5
    )
    assert reply.headers["X-Cost-Charged"] == "7"  # 8 chars / 4 per token + 5 output tokens
    usage = reply.parse().usage
    assert usage is not None
    actual = usage.prompt_tokens + usage.completion_tokens  # the template's tokens too
    assert actual != 7
    assert served.queue().meter("A/batch") == actual


async def test_asking_for_n_choices_is_charged_for_n_choices(lab: Lab) -> None:
    """Through the proxy: n=4 is charged four outputs (it used to cost what n=1 costs)."""
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    client = lab.client(served)
    messages = [{"role": "user", "content": "12345678"}]
    one = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5
    )
    four = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=5, n=4
    )
    assert (one.headers["X-Cost-Charged"], four.headers["X-Cost-Charged"]) == ("7", "22")
