"""A provider's 429s and rate-limit headers slow its pool's dispatch (docs/design.md §6,
"Provider feedback"; sfq_proxy/core/throttle.py).

Through the real proxy, a provider double records when each request arrives and when it
refused one; the assertions are lower bounds on those times (the proxy must hold its
dispatch at least that long), never tight upper bounds. The pool-level tests run on a
controllable loop clock (looptime), where the hold is exact.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families
from proxy_lab import KEYS, MODEL, Lab, eventually, proxy_config

from sfq_proxy.core.scheduler import Ticket
from sfq_proxy.state.pool import Pool

CHAT = [{"role": "user", "content": "Say something fair."}]
SLACK = 0.01  # the double's and the proxy's clocks are the same loop's; timers may run early
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": MODEL,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}


class Provider:
    """A hosted API double: ``answers`` (status, headers) in turn, then 200s; it records
    each request's arrival and each answer's moment on the loop's clock."""

    def __init__(self, answers: list[tuple[int, dict[str, str]]], ok: dict[str, str]) -> None:
        self.answers = list(answers)
        self.ok = ok
        self.arrivals: list[float] = []
        self.answered: list[tuple[float, int]] = []  # (when, status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        self.arrivals.append(loop.time())
        await request.read()
        status, headers = self.answers.pop(0) if self.answers else (200, self.ok)
        body: dict[str, Any] = ANSWER if status == 200 else {"error": {"message": "slow down"}}
        self.answered.append((loop.time(), status))
        return web.json_response(body, status=status, headers=headers)

    def held_after(self, status: int, hold: float) -> None:
        """No request arrived within ``hold`` seconds after an answer of ``status``."""
        for moment, answered in self.answered:
            if answered == status:
                early = [a - moment for a in self.arrivals if moment < a < moment + hold - SLACK]
                assert not early, f"arrived {early} s after a {status}, within its {hold} s hold"


async def provider_pool(lab: Lab, provider: Provider, **pool: Any) -> Any:
    port = await lab.serve(provider.app())
    config = proxy_config(
        [f"http://127.0.0.1:{port}"],
        slots=1,
        pool={"family": "openai", **pool},  # passive health: the stand-in has no /health
        admin_key_env="ADMIN",
        environ={"ADMIN": "sk-admin"},
        retry={"max_attempts": 3, "budget_ratio": 1.0},
    )
    return await lab.proxy(config)


async def admin_state(lab: Lab, served: Any) -> dict[str, Any]:
    http = await lab.http()
    headers = {"Authorization": "Bearer sk-admin"}
    async with http.get(f"{served.url}/admin/state", headers=headers) as r:
        state: dict[str, Any] = (await r.json())["pools"]["sim"]
    return state


async def throttled(lab: Lab, served: Any) -> dict[str, float]:
    http = await lab.http()
    async with http.get(f"{served.url}/metrics") as r:
        text = await r.text()
    return {
        s.labels["reason"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sfq_upstream_throttled_total" and s.labels["pool"] == "sim"
    }


async def test_a_429_with_retry_after_ms_holds_the_pool_then_it_recovers(lab: Lab) -> None:
    """The first two requests are refused with ``retry-after-ms: 300``: no request reaches
    the provider within 300 ms of either refusal, then every request is served, and the
    pool's rate factor was cut (it grows back)."""
    refusal = (429, {"retry-after-ms": "300"})
    ok = {"x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99",
          "x-ratelimit-reset-requests": "600ms"}  # fmt: skip
    provider = Provider([refusal, refusal], ok)
    served = await provider_pool(lab, provider, rate={"requests_per_minute": 6000})
    replies = await asyncio.gather(
        *(
            lab.client(served, org).chat.completions.create(model=MODEL, messages=CHAT)
            for org in "ABC"
        )
    )
    assert [r.choices[0].message.content for r in replies] == ["ok"] * 3
    assert [status for _, status in provider.answered].count(429) == 2
    assert len(provider.arrivals) == 5  # three requests, two of them retried once
    provider.held_after(429, 0.3)
    state = (await admin_state(lab, served))["provider_feedback"]
    assert state["throttled"] == {"429": 2}
    assert 0 < state["rate_factor"] < 1  # cut, and growing back
    assert state["effective_requests_per_minute"] == pytest.approx(6000 * state["rate_factor"])
    assert await throttled(lab, served) == {"429": 2.0}


async def test_remaining_requests_zero_holds_the_next_dispatch_until_the_reset(lab: Lab) -> None:
    """An answer with ``x-ratelimit-remaining-requests: 0`` and a reset of 200 ms: the next
    request reaches the provider no sooner than 200 ms later; answers with requests left
    hold nothing."""
    exhausted = (200, {"x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": "200ms"})  # fmt: skip
    provider = Provider([exhausted], {"x-ratelimit-remaining-requests": "10"})
    served = await provider_pool(lab, provider)
    client = lab.client(served, "A")
    first = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=CHAT))
    await eventually(lambda: len(provider.arrivals) == 1)
    others = [
        lab.client(served, org).chat.completions.create(model=MODEL, messages=CHAT) for org in "BC"
    ]
    await asyncio.gather(first, *others)
    assert len(provider.arrivals) == 3
    exhausted_at = provider.answered[0][0]
    assert provider.arrivals[1] >= exhausted_at + 0.2 - SLACK
    state = (await admin_state(lab, served))["provider_feedback"]
    assert state["throttled"] == {"remaining_requests": 1}
    assert state["rate_factor"] == 1.0  # not a refusal: the rate is not cut
    assert state["effective_requests_per_minute"] is None  # the pool sets no rate
    assert await throttled(lab, served) == {"remaining_requests": 1.0}


async def test_a_huge_retry_after_holds_the_pool_for_at_most_its_cap(lab: Lab) -> None:
    """``retry-after: 1e308`` pauses the pool for at most its cap (60 s), not forever, and
    the retry it asks for would start past the client's deadline: the client gets the 429
    at once."""
    provider = Provider([(429, {"retry-after": "1e308"})], {})
    served = await provider_pool(lab, provider)
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}", "X-Request-Timeout": "5"}
    body = {"model": MODEL, "messages": CHAT}
    async with http.post(f"{served.url}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 429
    state = (await admin_state(lab, served))["provider_feedback"]
    assert 50 < state["paused_for_s"] <= 60
    assert state["throttled"] == {"429": 1}


# -- the pool alone, on a controllable loop clock ------------------------------------------


def loop_pool(**pool: Any) -> Pool:
    config = proxy_config(["http://127.0.0.1:9"], slots=8, pool=pool)
    return Pool("sim", config, asyncio.get_running_loop().time)


def ticket(org: str) -> Ticket:
    return Ticket(org=org, cls="batch", cost=1.0)


@pytest.mark.looptime
async def test_on_the_pool_clock_a_429_holds_exactly_its_retry_after_ms() -> None:
    loop, pool = asyncio.get_running_loop(), loop_pool()
    start = loop.time()
    await pool.acquire(ticket("A"))
    pool.observe_answer(429, CIMultiDict({"Retry-After-Ms": "300", "Retry-After": "1"}), start)
    await pool.acquire(ticket("B"))
    assert loop.time() - start == pytest.approx(0.3, abs=1e-6)
    headers = CIMultiDict({"X-RateLimit-Remaining-Requests": "0",
                           "X-RateLimit-Reset-Requests": "1m30s"})  # fmt: skip
    pool.observe_answer(200, headers, loop.time())
    held_at = loop.time()
    await pool.acquire(ticket("C"))
    assert loop.time() - held_at == pytest.approx(60.0, abs=1e-6)  # 90 s, capped at 60


@pytest.mark.looptime
async def test_on_the_pool_clock_a_429_slows_a_paced_pool_which_recovers_gradually() -> None:
    """60 requests a minute: one a second. A 429 halves it (a dispatch every 2 s); the factor
    grows back by 0.05 a second, so the gaps shrink back to 1 s."""
    loop, pool = asyncio.get_running_loop(), loop_pool(rate={"requests_per_minute": 60})
    start = loop.time()
    await pool.acquire(ticket("A"))
    pool.observe_answer(429, {"retry-after": "0"}, start)
    times = []
    for _ in range(12):
        held = ticket("B")
        await pool.acquire(held)
        times.append(loop.time() - start)
        pool.release(held)
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(times)]
    assert times[0] == pytest.approx(1.0)  # the bucket's own one-second pacing
    assert gaps[0] == pytest.approx(1 / (0.5 + 0.05 * 1.0), abs=1e-3)  # halved, growing back
    assert all(1.0 <= g <= 2.0 for g in gaps)
    assert gaps == sorted(gaps, reverse=True)
    assert gaps[-1] == 1.0  # whole again
