"""Metrics, /admin/state and the access log after known workloads (docs/design.md §8–§9)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from proxy_lab import (
    KEYS,
    MODEL,
    AccessLines,
    Lab,
    Served,
    eventually,
    proxy_config,
    sample,
    scrape,
)

from sfq_proxy.observability.metrics import OTHER, Metrics

SECRET_PROMPT = "my-secret-prompt-text"
CHAT = [{"role": "user", "content": "hi"}]  # 1 input token by chars/4


async def test_counters_and_histograms_after_a_known_workload(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1))
    a, c = lab.client(served, "A"), lab.client(served, "C")
    for _ in range(3):
        await a.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    stream = await a.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    [chunk async for chunk in stream]
    with pytest.raises(openai.NotFoundError):
        await lab.client(served, "B").chat.completions.create(model="nope", messages=CHAT)
    bad = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="sk-bad", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(model=MODEL, messages=CHAT)
    await bad.close()
    # C's stream runs and is dropped; A's next request waits behind it and is dropped too
    running = await c.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True
    )
    async for _ in running:
        break
    queued = asyncio.create_task(a.chat.completions.create(model=MODEL, messages=CHAT))
    await eventually(lambda: served.queue().backlog("A/batch") == 1)
    queued.cancel()
    await eventually(lambda: served.queue().backlog("A/batch") == 0)  # left before a slot frees
    await running.close()
    await eventually(lambda: sim.stats.aborted == 1)

    async def settled() -> bool:  # the proxy counts the cancellations as its handlers end
        got = await scrape(lab, served)
        return sample(got, "sfq_requests_total", org="C", **{"class": "interactive"},
                      pool="sim", outcome="cancelled_running") == 1  # fmt: skip

    await eventually(settled)
    got = await scrape(lab, served)
    a_flow = {"org": "A", "class": "batch", "pool": "sim"}
    c_flow = {"org": "C", "class": "interactive", "pool": "sim"}
    assert sample(got, "sfq_requests_total", **a_flow, outcome="completed") == 4
    assert sample(got, "sfq_requests_total", **a_flow, outcome="cancelled_queued") == 1
    assert sample(got, "sfq_requests_total", org="B", **{"class": ""}, pool="",
                  outcome="rejected") == 1  # fmt: skip
    assert sample(got, "sfq_rejections_total", org="B", **{"class": ""}, pool="",
                  reason="invalid") == 1  # fmt: skip
    assert sample(got, "sfq_rejections_total", org="", **{"class": ""}, pool="",
                  reason="auth") == 1  # fmt: skip
    # cost = input 1 + output 4 (max_tokens) with weights 1: 5 per dispatched request
    assert sample(got, "sfq_cost_charged_total", **a_flow) == 4 * 5
    assert sample(got, "sfq_cost_charged_total", **c_flow) == 1 + 4000
    # the simulated server's usage: 4 overhead + 1 prompt token, and the max_tokens asked
    assert sample(got, "sfq_prompt_tokens_total", **a_flow) == 4 * 5
    assert sample(got, "sfq_completion_tokens_total", **a_flow) == 4 * 4
    # what they really cost, by the same formula on that usage, beside what was charged
    assert sample(got, "sfq_cost_actual_total", **a_flow) == 4 * (5 + 4)
    assert sample(got, "sfq_queue_wait_seconds_count", **a_flow) == 4  # once per dispatch
    assert sample(got, "sfq_queue_wait_seconds_count", **c_flow) == 1
    assert sample(got, "sfq_time_to_first_token_seconds_count", **a_flow) == 1  # one stream
    first_byte = sample(got, "sfq_upstream_first_byte_seconds_count", pool="sim",
                        backend=sim.url.removeprefix("http://"))  # fmt: skip
    assert first_byte == 5
    assert sample(got, "sfq_backend_healthy", pool="sim", backend=sim.url[7:]) == 1
    assert all(SECRET_PROMPT not in str(k) for k in got)


async def test_flow_gauges_follow_the_queue_and_vanish_when_it_is_forgotten(lab: Lab) -> None:
    sim = await lab.backend(max_num_seqs=1)
    served = await lab.proxy(proxy_config([sim.url], slots=1))
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True
    )
    waiting = [
        asyncio.create_task(lab.client(served, "A").chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2))
        for _ in range(3)
    ]  # fmt: skip
    await eventually(lambda: served.queue().backlog("A/batch") == 3)
    got = await scrape(lab, served)
    a_flow = {"org": "A", "class": "batch", "pool": "sim"}
    assert sample(got, "sfq_queue_length", **a_flow) == 3
    assert sample(got, "sfq_in_flight", org="C", **{"class": "interactive"}, pool="sim") == 1
    assert sample(got, "sfq_meter_lag", **a_flow) == 0  # joined at v
    assert sample(got, "sfq_backend_in_flight", pool="sim", backend=sim.url[7:]) == 1
    await blocker.close()
    await asyncio.gather(*waiting)
    await eventually(lambda: served.state.pools["sim"].scheduler.running == 0)
    got = await scrape(lab, served)
    assert sample(got, "sfq_queue_length", **a_flow) is None  # forgotten at the global idle
    assert sample(got, "sfq_requests_total", **a_flow, outcome="completed") == 3  # counters stay


def test_orgs_beyond_the_cap_are_folded_into_other_and_nothing_is_lost() -> None:
    metrics = Metrics({}, max_labelled_orgs=50)
    for n in range(1000):
        for _ in range(n % 3 + 1):
            metrics.count((f"org-{n}", "batch", "p"), "requests", "completed")
        metrics.observe((f"org-{n}", "batch", "p"), "queue_wait_seconds", 0.2)
    families = {f.name: f for f in metrics.registry.collect()}
    requests = families["sfq_requests"].samples
    orgs = {s.labels["org"] for s in requests}
    assert len(orgs) <= 51
    assert OTHER in orgs
    assert {f"org-{n}" for n in range(950, 1000)} <= orgs  # the most recently active
    assert sum(s.value for s in requests) == sum(n % 3 + 1 for n in range(1000))
    counts = [s for s in families["sfq_queue_wait_seconds"].samples if s.name.endswith("_count")]
    assert sum(s.value for s in counts) == 1000


async def test_admin_state_reflects_a_known_state_and_needs_the_admin_key(lab: Lab) -> None:
    up, down = await lab.backend(max_num_seqs=1), await lab.backend()
    config = proxy_config(
        [up.url, down.url], slots=1, admin_key_env="ADMIN", environ={"ADMIN": "sk-admin"}
    )
    served = await lab.proxy(config)
    await down.update_faults(health_status=503)
    await eventually(lambda: not served.state.pools["sim"].placement.backends[1].healthy)
    blocker = await lab.client(served, "C").chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4000, stream=True
    )
    waiting = asyncio.create_task(
        lab.client(served, "A").chat.completions.create(model=MODEL, messages=CHAT)
    )
    await eventually(lambda: served.queue().backlog("A/batch") == 1)
    http = await lab.http()
    async with http.get(f"{served.url}/admin/state") as r:
        assert r.status == 401
    async with http.get(
        f"{served.url}/admin/state", headers={"Authorization": f"Bearer {KEYS['A']}"}
    ) as r:
        assert r.status == 401  # a client key is not the admin key
    async with http.get(
        f"{served.url}/admin/state", headers={"Authorization": "Bearer sk-admin"}
    ) as r:
        state = (await r.json())["pools"]["sim"]
    assert (state["queued"], state["running"]) == (1, 1)
    flows = {f["flow"]: f for f in state["flows"]}
    assert flows["A/batch"]["queued"] == 1
    assert flows["A/batch"]["meter"] == state["virtual_time"]
    assert flows["A/batch"]["eligible"] is True
    backends = [(b["slots"], b["in_flight"], b["healthy"]) for b in state["backends"]]
    assert backends == [(1, 1, True), (1, 0, False)]
    assert [d["flow"] for d in state["recent_dispatches"]] == ["C/interactive"]
    await blocker.close()
    await waiting


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_metrics_can_require_a_key_and_are_open_without_one(lab: Lab, method: str) -> None:
    """With ``metrics_key_env``, /metrics answers only the key it names (a client's key, the
    admin key or none get an OpenAI-style 401); without it, anyone, whatever they send."""
    sim = await lab.backend()
    environ = {"METRICS": "sk-metrics-scraper", "ADMIN": "sk-admin"}
    guarded = await lab.proxy(
        proxy_config([sim.url], metrics_key_env="METRICS", admin_key_env="ADMIN", environ=environ)
    )
    open_ = await lab.proxy(proxy_config([sim.url]))
    http = await lab.http()

    async def ask(served: Served, key: str | None) -> tuple[int, bytes]:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        async with http.request(method, f"{served.url}/metrics", headers=headers) as r:
            return r.status, await r.read()

    for key in (None, KEYS["A"], "sk-admin", "sk-metrics-scrape", "sk-metrics-scraper2"):
        status, body = await ask(guarded, key)
        assert status == 401
        if method == "GET":
            error = json.loads(body)["error"]
            assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
            assert "metrics_key_env" in error["message"]
    status, body = await ask(guarded, "sk-metrics-scraper")
    assert status == 200
    assert method == "HEAD" or b"sfq_build_info" in body
    for key in (None, KEYS["A"], "sk-anything"):
        status, body = await ask(open_, key)
        assert status == 200
        assert method == "HEAD" or b"sfq_build_info" in body


async def test_access_log_line_per_request_with_ids_and_no_secrets(
    lab: Lab, access_log: AccessLines
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    http = await lab.http()
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
    }
    headers = {"Authorization": f"Bearer {KEYS['A']}", "X-Request-Id": "trace-123"}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        assert r.headers["X-Request-Id"] == "trace-123"
    async with http.post(f"{served.url}/v1/chat/completions", json={**body, "model": "x"},
                         headers={"Authorization": f"Bearer {KEYS['B']}"}) as r:  # fmt: skip
        assert r.status == 404
        generated = r.headers["X-Request-Id"]
    lines = await access_log()
    assert [line["request_id"] for line in lines] == ["trace-123", generated]
    ok, rejected = lines
    fields = ("org", "class", "pool", "model", "status", "outcome", "retries")
    assert {k: ok[k] for k in fields} == {
        "org": "A", "class": "batch", "pool": "sim", "model": MODEL, "status": 200,
        "outcome": "completed", "retries": 0,
    }  # fmt: skip
    assert ok["backend"] == sim.url[7:]
    assert (ok["prompt_tokens"], ok["completion_tokens"]) == (4 + 6, 3)
    assert ok["cost"] == 6 + 3  # 21 chars / 4 → 6 input tokens, plus max_tokens
    assert ok["cost_actual"] == (4 + 6) + 3  # the usage reported: the template's 4 tokens too
    assert rejected["cost_actual"] is None
    assert ok["queue_wait_s"] >= 0
    assert ok["upstream_s"] > 0
    assert (rejected["org"], rejected["status"], rejected["outcome"]) == ("B", 404, "rejected")
    text = json.dumps(lines)
    assert SECRET_PROMPT not in text
    assert all(key not in text for key in KEYS.values())


async def test_a_stream_cut_by_a_dying_backend_is_counted_and_logged_as_failed(
    lab: Lab, access_log: AccessLines
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    await sim.update_faults(die_after_tokens=3)
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200
        events = (await r.read()).split(b"\n\n")  # ended cleanly, with the reason last
    assert events[-2:] == [b"data: [DONE]", b""], events
    error = json.loads(events[-3].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("upstream_error", "upstream_cut")
    assert len(events) == 3 + 3 + 1  # role event and 2 tokens, then the error and [DONE]

    async def counted() -> bool:
        got = await scrape(lab, served)
        flow = {"org": "A", "class": "batch", "pool": "sim"}
        return sample(got, "sfq_requests_total", **flow, outcome="failed") == 1

    await eventually(counted)
    # its 200 had been sent, but the answer is not what was asked for
    assert [(line["outcome"], line["status"]) for line in await access_log()] == [("failed", 200)]
