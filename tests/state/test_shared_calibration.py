"""Calibration shared through a real Redis: what one proxy learns, the other charges, as one
process learning every request would (an in-memory proxy sent the same requests, here), and
an outage of Redis loses nothing that was learned meanwhile."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from proxy_lab import MODEL, AccessLines, Lab, Served, eventually, proxy_config
from redis.exceptions import WatchError
from redis_server import RedisServer

from sfq_proxy.config import Config
from sfq_proxy.core.calibration import Calibration
from sfq_proxy.http.proxy import PROXY
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.state.calibration_file import load, save
from sfq_proxy.state.redis_calibration import KEY, CalibrationSync, SharedCalibration

pytestmark = pytest.mark.redis
CALIBRATION = {"half_life_requests": 10, "min_org_samples": 3}  # decay shows in a few requests
SYNC_LOG = "sfq_proxy.state.redis_calibration"
Request = dict[str, Any]  # the keyword arguments of a chat completion


def requests(seed: int, count: int) -> list[tuple[str, Request]]:
    """Chats of 1 to 4 messages, of a length that varies from chat to chat, and each org with
    its own output ratio: the input fit, the pool's ratio and each org's have all something
    to learn."""
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        org = rng.choice("AB")
        chat = [{"role": "user", "content": "x" * rng.randint(4, 400)}] * rng.randint(1, 4)
        max_tokens = rng.randint(8, 64)
        output = max_tokens // {"A": 2, "B": 8}[org]
        made.append((org, {"messages": chat, "max_tokens": max_tokens,
                           "extra_body": {"min_tokens": output}}))  # fmt: skip
    return made


async def send(lab: Lab, served: Served, org: str, request: Request) -> None:
    await lab.client(served, org).chat.completions.create(model=MODEL, **request)


async def send_all(lab: Lab, proxies: list[Served], sent: list[tuple[str, Request]]) -> None:
    """One at a time, in order, to each of ``proxies``: each learns them in that order."""
    for org, request in sent:
        for served in proxies:
            await send(lab, served, org, request)


def learned(served: Served) -> dict[str, Any]:
    """The pool's calibration as ``/admin/state`` shows it, each value by its path."""
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{path}{key}.")
            else:
                flat[f"{path}{key}"] = value

    walk(served.state.pools["sim"].state()["calibration"], "")
    return flat


def same(a: Served, b: Served) -> bool:
    return learned(a) == pytest.approx(learned(b), rel=1e-9)


def samples(served: Served) -> int:
    """Requests the pool's output ratio was learned from: every one of these tests' own."""
    return int(learned(served).get("output_ratio.samples", 0))


def learn(calibration: Calibration, org: str, count: int = 1) -> Calibration:
    """``calibration`` after ``count`` more requests of ``org``, all alike."""
    for _ in range(count):
        calibration.observe("sim", org, chars=400, messages=1, prompt_tokens=100, max_tokens=64,
                            completion_tokens=8)  # fmt: skip
    return calibration


async def untouched(redis_url: str, seconds: float) -> bool:
    """Whether nothing wrote the calibration's document for ``seconds``: any write, even of
    the same bytes, makes a transaction that WATCHed it fail."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with client.pipeline() as pipe:
            await pipe.watch(KEY)
            await asyncio.sleep(seconds)
            pipe.multi()
            pipe.get(KEY)
            try:
                await pipe.execute()
            except WatchError:
                return False
            return True
    finally:
        await client.aclose()


async def proxies(lab: Lab, sim: SimBackend, redis_url: str, **state: Any) -> list[Served]:
    """Two proxies sharing ``redis_url``, and one in memory: the process that learns alone."""
    shared = {"redis": redis_url, **state}
    made = []
    for kind in (shared, shared, "memory"):
        config = proxy_config([sim.url], calibration=CALIBRATION, state=kind)
        made.append(await lab.proxy(config))
    return made


async def test_what_one_proxy_learns_the_other_charges(
    lab: Lab, redis_url: str, access_log: AccessLines
) -> None:
    sim = await lab.backend(output_mode="min_tokens")
    first, second, alone = await proxies(lab, sim, redis_url)
    assert learned(second) == {}
    for batch in range(3):  # later deltas merge into what Redis holds already
        await send_all(lab, [first, alone], requests(batch, 10))
        await eventually(lambda: samples(first) == samples(alone) == 10 * (batch + 1))  # noqa: B023
        await eventually(lambda: same(second, first), within=5)
    assert learned(second)["input.samples"] == 30
    assert learned(second)["orgs.B.samples"] >= CALIBRATION["min_org_samples"]
    assert same(second, alone)

    probe = ("B", requests(99, 1)[0][1])  # charged by what the second proxy never saw itself
    await send_all(lab, [second, alone], [probe])
    charged = [line["cost"] for line in (await access_log())[-2:]]
    assert charged[0] == pytest.approx(charged[1], rel=1e-9)

    await eventually(lambda: same(first, second), within=5)
    assert await untouched(redis_url, 2.5)  # idle: each proxy reads it twice, writes nothing


async def test_redis_stopped_mid_run_loses_no_observation(
    lab: Lab, redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests finish while Redis is down: the first proxy prices with them at once and
    keeps them; Redis comes back empty (no persistence), and the first sync writes what was
    merged before the outage with them. One warning a proxy for the outage."""
    caplog.set_level(logging.WARNING, logger=SYNC_LOG)
    sim = await lab.backend(output_mode="min_tokens", decode_tokens_per_s=40.0)
    first, second, alone = await proxies(lab, sim, redis_url, lease_ttl_s=3)
    await send_all(lab, [first, alone], requests(7, 8))
    await eventually(lambda: samples(first) == samples(alone) == 8)
    await eventually(lambda: same(second, first), within=5)

    # 1,000 tokens at 40 a second, 50 times faster (the lab's time scale): half a second
    org, late = "A", {"messages": [{"role": "user", "content": "late"}], "max_tokens": 1000,
                      "extra_body": {"min_tokens": 1000}}  # fmt: skip
    running = [asyncio.create_task(send(lab, first, org, late)) for _ in range(2)]
    await eventually(lambda: sim.stats.running == 2, within=5)
    redis_server.stop()
    await asyncio.gather(*running)  # half a second of output, well within the lease TTL
    await send_all(lab, [alone], [(org, late)] * 2)  # identical: their order does not matter
    await eventually(lambda: samples(first) == samples(alone) == 10)
    assert same(first, alone)  # priced with at once
    assert samples(second) == 8
    await eventually(lambda: _warnings(caplog, "unreachable") == 2, within=5)
    await asyncio.sleep(2.5)  # attempts fail meanwhile, each period: none is logged again
    assert _warnings(caplog, "unreachable") == 2

    redis_server.start()
    await eventually(lambda: same(second, alone), within=10)
    assert samples(second) == 10
    assert same(first, alone)
    assert _warnings(caplog, "answers again") >= 2


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name == SYNC_LOG)


async def test_replicas_that_sync_at_once_lose_none_of_each_others_observations(
    redis_url: str,
) -> None:
    """Two processes' syncs, at the same instant, five times: of each pair of transactions,
    one finds the document changed since it read it and merges again (WATCH), so Redis ends
    with every observation; had the other overwritten it, half would be gone."""
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
    shared = [SharedCalibration(**CALIBRATION) for _ in clients]
    syncs = [
        CalibrationSync(c, calibration) for c, calibration in zip(clients, shared, strict=True)
    ]
    for _ in range(5):
        for org, calibration in zip("AB", shared, strict=True):
            learn(calibration, org)
        await asyncio.gather(*(sync.sync() for sync in syncs))
    await asyncio.gather(*(sync.sync() for sync in syncs))  # the last merge, adopted by both
    for calibration in shared:
        pool = calibration.snapshot()["sim"]
        assert (pool["output_ratio"]["samples"], pool["orgs"]["A"]["samples"]) == (10, 5)
    for client in clients:
        await client.aclose()


async def test_a_state_file_seeds_redis_only_while_it_holds_none_and_is_its_backup(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    """Redis is the source: the first proxy's state file seeds it (Redis held nothing), the
    second's is not read over it. What the second learns reaches Redis by its shutdown at
    the latest, and its file is then written with the shared state."""
    seed, other = tmp_path / "seed.json", tmp_path / "other.json"
    save(learn(Calibration(**CALIBRATION), "A", 3), seed)
    save(learn(Calibration(**CALIBRATION), "B", 5), other)
    sim = await lab.backend(output_mode="min_tokens")

    def config(state_file: Path) -> Config:
        calibration = {**CALIBRATION, "state_file": str(state_file)}
        return proxy_config([sim.url], calibration=calibration, state={"redis": redis_url})

    first = await lab.proxy(config(seed))
    assert samples(first) == 3
    async with running(config(other)) as runner:
        second = Served(bound_url(runner), runner.app[PROXY])
        assert learned(second) == learned(first)
        await send(lab, second, "B", requests(1, 1)[0][1])
    await eventually(lambda: samples(first) == 4, within=3)
    assert learned(first)["orgs.B.samples"] == 1
    backup = load(other, **CALIBRATION).snapshot()["sim"]
    assert (backup["output_ratio"]["samples"], sorted(backup["orgs"])) == (4, ["A", "B"])
