"""Health per pool (docs/design.md §5): active probes with a configurable path, method and
upstream key, or passive only, through the real proxy in front of a provider-like double.

The double is tests/support/provider_double.py, what a hosted provider looks like from the proxy:
every path needs its key (401 without), and it has no ``/health``. Cooldown timing is
checked exactly on a pool of its own, on looptime's loop clock (as in test_pool_clock.py),
where 30 s take no time.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from provider_double import CHAT_PATH, PROVIDER_KEY, ProviderDouble
from proxy_lab import KEYS, MODEL, Lab, Served, eventually, proxy_config

from sfq_proxy.core.scheduler import Ticket
from sfq_proxy.state.pool import Pool

ENV = {"PROVIDER_KEY": PROVIDER_KEY}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def provider_proxy(
    lab: Lab, health: dict[str, Any] | None = None
) -> tuple[ProviderDouble, Served]:
    """A proxy whose pool ``sim`` is the provider double, with its upstream key."""
    provider = ProviderDouble()
    url = f"http://127.0.0.1:{await lab.serve(provider.app())}/v1"  # as providers write it
    pool: dict[str, Any] = {"upstream_key_env": "PROVIDER_KEY"}
    if health is not None:
        pool["health"] = health
    served = await lab.proxy(proxy_config([url], pool=pool, environ=ENV))
    return provider, served


async def post(lab: Lab, served: Served) -> tuple[int, dict[str, Any], str | None]:
    """One chat request; (status, body, Retry-After)."""
    http = await lab.http()
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}{CHAT_PATH}", data=json.dumps(CHAT), headers=headers) as r:
        return r.status, await r.json(), r.headers.get("Retry-After")


# --- passive: no probe; failures in a row take a backend out ----------------------------


async def test_a_provider_pool_is_passive_and_serves_without_a_health_endpoint(lab: Lab) -> None:
    provider, served = await provider_proxy(lab, {"interval_s": 0.05, "cooldown_s": 0.2})
    pool = served.state.pools["sim"]
    assert pool.spec.health.mode == "passive"
    for _ in range(3):
        status, body, _ = await post(lab, served)
        assert status == 200, body
    await asyncio.sleep(0.3)  # several probe intervals: a probe would have been sent by now
    assert provider.probes() == []
    assert [r for r in provider.received if not r.keyed] == []  # every request had the key
    assert pool.placement.backends[0].healthy


async def test_probing_a_provider_without_a_health_endpoint_takes_it_out(lab: Lab) -> None:
    """What every provider pool got before health modes: ``mode: active`` still does it."""
    provider, served = await provider_proxy(lab, {"mode": "active", "interval_s": 0.05})
    backend = served.state.pools["sim"].placement.backends[0]
    await eventually(lambda: not backend.healthy)
    assert ("GET", "/health", True) in provider.probes()  # with the key, to a missing path
    status, body, _ = await post(lab, served)
    assert (status, body["error"]["code"]) == (503, "no_healthy_backend")


async def test_consecutive_5xx_take_a_passive_backend_out(lab: Lab) -> None:
    health = {"consecutive_failures": 3, "cooldown_s": 60}
    provider, served = await provider_proxy(lab, health)
    backend = served.state.pools["sim"].placement.backends[0]
    provider.status = 500
    for _ in range(2):
        assert (await post(lab, served))[0] == 500  # passed through; the streak grows
    provider.status = 200
    assert (await post(lab, served))[0] == 200  # a success ends the streak
    provider.status = 500
    for _ in range(2):
        assert (await post(lab, served))[0] == 500
    assert backend.healthy  # two in a row: not yet
    assert (await post(lab, served))[0] == 500
    assert not backend.healthy  # the third in a row took it out, for 60 s
    status, body, retry_after = await post(lab, served)
    assert (status, body["error"]["code"], retry_after) == (503, "no_healthy_backend", "60")
    assert provider.probes() == []


async def test_a_passive_backend_comes_back_after_its_cooldown_without_a_probe(lab: Lab) -> None:
    health = {"consecutive_failures": 2, "cooldown_s": 0.2}
    provider, served = await provider_proxy(lab, health)
    backend = served.state.pools["sim"].placement.backends[0]
    provider.status = 502  # retried, so one request may fail more than once
    for _ in range(2):
        await post(lab, served)
    assert backend.down_until > 0  # it was taken out
    provider.status = 200
    await eventually(lambda: backend.healthy)
    assert backend.failures == 0  # trusted again, with a fresh streak
    assert (await post(lab, served))[0] == 200
    assert provider.probes() == []


# --- active: a probe with a configurable path, method and key ---------------------------


async def test_an_active_probe_sends_the_upstream_key_to_its_path(lab: Lab) -> None:
    health = {"mode": "active", "path": "/v1/models", "method": "HEAD", "interval_s": 0.05}
    provider, served = await provider_proxy(lab, health)
    await eventually(lambda: len(provider.probes()) >= 2)
    assert set(provider.probes()) == {("HEAD", "/v1/models", True)}
    assert served.state.pools["sim"].placement.backends[0].healthy
    assert (await post(lab, served))[0] == 200


async def test_an_active_probe_without_the_key_fails_on_a_provider(lab: Lab) -> None:
    health = {"mode": "active", "path": "/v1/models", "send_key": False, "interval_s": 0.05}
    provider, served = await provider_proxy(lab, health)
    backend = served.state.pools["sim"].placement.backends[0]
    await eventually(lambda: not backend.healthy)
    assert set(provider.probes()) == {("GET", "/v1/models", False)}  # refused with 401


# --- a backend that never sends its headers: a failure in either mode --------------------


def timed_pool(mode: str, streak: int, first_byte_s: float) -> dict[str, Any]:
    """A provider pool's settings: health ``mode``, out for 60 s after ``streak`` failures
    in a row (an active pool probes ``/v1/models``, which the double answers), and
    ``first_byte_s``."""
    health: dict[str, Any] = {"mode": mode, "consecutive_failures": streak, "cooldown_s": 60}
    if mode == "active":
        health |= {"path": "/v1/models", "interval_s": 0.05}
    timeouts = {"connect_s": 1, "first_byte_s": first_byte_s}
    return {"upstream_key_env": "PROVIDER_KEY", "health": health, "timeouts": timeouts}


@pytest.mark.parametrize(
    ("mode", "streak"), [("passive", 3), ("active", 1)], ids=["passive", "active"]
)
async def test_a_backend_hanging_before_its_headers_is_taken_out_after_its_streak(
    lab: Lab, mode: str, streak: int
) -> None:
    """Each request it takes is a 504 ``upstream_timeout`` after ``first_byte_s`` and counts
    as a failure: after ``streak`` of them, placement sends everything to the healthy
    backend (before, the hanging one, listed first and least loaded, got every request).
    The active pool's probes, which the hanging backend answers, do not bring it back
    before its cooldown."""
    hanging, healthy = ProviderDouble(), ProviderDouble()
    urls = [f"http://127.0.0.1:{await lab.serve(p.app())}/v1" for p in (hanging, healthy)]
    served = await lab.proxy(proxy_config(urls, pool=timed_pool(mode, streak, 0.3), environ=ENV))
    backend = served.state.pools["sim"].placement.backends[0]
    hanging.misbehave("hang", times=100)
    for _ in range(streak):
        assert backend.healthy
        status, body, _ = await post(lab, served)
        assert (status, body["error"]["code"]) == (504, "upstream_timeout")
    assert not backend.healthy
    assert [(await post(lab, served))[0] for _ in range(5)] == [200] * 5
    assert (len(hanging.chats()), len(healthy.chats())) == (streak, 5)
    assert not backend.healthy


@pytest.mark.parametrize("mode", ["passive", "active"])
async def test_a_slow_answer_from_a_backend_answering_others_is_not_held_against_it(
    lab: Lab, mode: str
) -> None:
    """A non-streaming request whose headers are late (an engine sends them when its long
    generation ends: the client's ``max_tokens`` decides) is a 504 to its client, but does
    not count while the backend answered other requests meanwhile: otherwise any tenant
    could take backends out with one such request each, whatever the streak of 1. A
    request that times out with no answer since it was sent still counts (a hung backend)."""
    provider = ProviderDouble()
    url = f"http://127.0.0.1:{await lab.serve(provider.app())}/v1"
    served = await lab.proxy(proxy_config([url], pool=timed_pool(mode, 1, 1.0), environ=ENV))
    backend = served.state.pools["sim"].placement.backends[0]
    provider.misbehave("hang")
    slow = asyncio.create_task(post(lab, served))
    await eventually(lambda: provider.in_flight == 1)  # the slow one is at the backend
    assert [(await post(lab, served))[0] for _ in range(3)] == [200] * 3  # the others are not
    status, body, _ = await slow
    assert (status, body["error"]["code"]) == (504, "upstream_timeout")
    assert (backend.healthy, backend.failures) == (True, 0)
    provider.misbehave("hang")  # now nothing else is answered while it waits: a hung backend
    status, body, _ = await post(lab, served)
    assert (status, body["error"]["code"]) == (504, "upstream_timeout")
    assert not backend.healthy


async def test_an_active_probe_that_hangs_past_its_timeout_is_a_failure(lab: Lab) -> None:
    """The probe's side of it: a health path that accepts and never answers."""

    async def hang(_: web.Request) -> web.Response:
        await asyncio.sleep(1)  # five times the probe's timeout (and the server's stop waits)
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", hang)
    url = f"http://127.0.0.1:{await lab.serve(app)}"
    health = {"mode": "active", "interval_s": 0.05, "timeout_s": 0.2, "cooldown_s": 60}
    served = await lab.proxy(proxy_config([url], pool={"health": health}))
    backend = served.state.pools["sim"].placement.backends[0]
    await eventually(lambda: not backend.healthy, within=5)


# --- cooldowns on the loop clock ----------------------------------------------------------


def passive_pool(**health: Any) -> Pool:
    config = proxy_config(
        ["http://127.0.0.1:9"], slots=1, pool={"health": {"mode": "passive", **health}}
    )
    return Pool("sim", config, asyncio.get_running_loop().time)


def ticket(org: str) -> Ticket:
    return Ticket(org=org, cls="batch", cost=1.0)


@pytest.mark.looptime
async def test_a_passive_backend_is_back_exactly_when_its_cooldown_ends() -> None:
    loop = asyncio.get_running_loop()
    pool = passive_pool(cooldown_s=30, consecutive_failures=3)
    (backend,) = pool.placement.backends
    for _ in range(3):
        pool.report_failure(backend)
    assert not backend.healthy
    start = loop.time()
    got = await pool.acquire(ticket("A"))  # waits in line for the backend's return
    assert got is backend
    assert loop.time() - start == pytest.approx(30.0, abs=0.01)
    assert (backend.healthy, backend.failures) == (True, 0)


@pytest.mark.looptime
async def test_a_failure_while_out_pushes_a_passive_backends_return_back() -> None:
    loop = asyncio.get_running_loop()
    pool = passive_pool(cooldown_s=30, consecutive_failures=1)
    (backend,) = pool.placement.backends
    start = loop.time()
    pool.report_failure(backend)
    await asyncio.sleep(10)
    pool.report_failure(backend)  # a request still running on it failed too
    await asyncio.sleep(25)  # past the first cooldown, not the second
    assert not backend.healthy
    await pool.acquire(ticket("A"))
    assert loop.time() - start == pytest.approx(40.0, abs=0.01)


@pytest.mark.looptime
async def test_a_reload_to_passive_lets_down_backends_come_back_on_their_own() -> None:
    """No probe will run, so a backend that waited for one comes back after its cooldown,
    and a backend new in the file is trusted at once, as at start."""
    loop = asyncio.get_running_loop()
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    active = proxy_config(urls[:1], slots=1, pool={"health": {"cooldown_s": 30}})
    pool = Pool("sim", active, loop.time)
    (old,) = pool.placement.backends
    pool.report_failure(old)  # active: one failure, out until a good probe after 30 s
    passive = proxy_config(urls, slots=1, pool={"health": {"mode": "passive", "cooldown_s": 30}})
    pool.reconfigure(passive, pool.cost)
    new = pool.placement.backends[1]
    assert new.healthy
    assert not old.healthy
    await asyncio.sleep(30)
    assert old.healthy
    assert pool.placement.failures_to_down == 5  # the passive default
