"""The acceptance test of the shared state: two proxy processes on one real Redis, as two
replicas of a deployment. Skewed ingress keeps the weights; a replica killed with SIGKILL
gives its slots back within the lease TTL; one paused past the TTL stops what it ran as
soon as it wakes. Slots are checked where they matter: at the backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import redis.asyncio as aioredis
from proxy_lab import KEYS, MODEL, Lab, banner_url, children, config_yaml, eventually
from redis_server import queued_is

from sfq_proxy.runner.workers import METRICS_PREFIX
from sfq_proxy.sim.server import SimBackend

pytestmark = pytest.mark.redis
CHAT = [{"role": "user", "content": "hi"}]
TTL_S = 1.5
SLOTS = 2


class Replica:
    """``sfq-proxy serve`` in a process of its own."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url

    @classmethod
    async def start(cls, config: Path) -> Replica:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(config),
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = banner_url(line)
        return cls(proc, url)

    def client(self, org: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEYS[org], max_retries=0)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def replicas(
    sim: SimBackend, redis_url: str, tmp_path: Path, n: int = 2
) -> AsyncIterator[list[Replica]]:
    state = {"redis": redis_url, "lease_ttl_s": TTL_S}
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml([sim.url], slots=SLOTS, orgs={"A": {"weight": 4}}, state=state))
    started = [await Replica.start(path) for _ in range(n)]
    try:
        yield started
    finally:
        for replica in started:
            await replica.stop()


async def stream(client: openai.AsyncOpenAI, org: str, tokens: int) -> int:
    """A stream of ``tokens`` tokens; how many arrived before it ended (or broke)."""
    got = 0
    try:
        reply = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=tokens, user=org, stream=True
        )
        async for chunk in reply:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
    except openai.APIError:
        pass
    return got


def served_after(sim: SimBackend, start: int) -> list[str]:
    return [r.user for r in sim.stats.log[start:]]


async def test_a_killed_replica_gives_its_slots_back_within_the_ttl(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0, max_num_seqs=8)
    async with replicas(sim, redis_url, tmp_path) as (first, second):
        a, b = first.client("A"), second.client("B")
        # A's long streams hold both slots through the first replica; B queues on the second
        a_streams = [asyncio.create_task(stream(a, "A", 400)) for _ in range(SLOTS)]
        await eventually(lambda: sim.stats.running == SLOTS, within=10)
        b_requests = [asyncio.create_task(stream(b, "B", 20)) for _ in range(6)]
        await eventually(lambda: queued_is(redis_url, 6), within=10)

        killed_at, seen = time.monotonic(), len(sim.stats.log)
        first.proc.kill()  # SIGKILL: no drain, no release; its connections close
        await eventually(lambda: served_after(sim, seen)[:1] == ["B"], within=4 * TTL_S)
        reclaimed_s = time.monotonic() - killed_at
        assert await asyncio.gather(*a_streams) != [400, 400]  # cut with their replica
        assert await asyncio.gather(*b_requests) == [20] * 6  # the second replica serves on

        # A comes back through the second replica: both wait, 4:1
        a2 = second.client("A")
        sim.hold()
        seen = len(sim.stats.log)
        both = [stream(a2, "A", 2) for _ in range(24)] + [stream(b, "B", 2) for _ in range(6)]
        replies = asyncio.gather(*both)
        await eventually(lambda: queued_is(redis_url, 30 - SLOTS), within=10)
        sim.release()
        assert await replies == [2] * 30
        order = served_after(sim, seen)[SLOTS:]  # past the two taken before the queue formed
        assert Counter(order[:15])["A"] in (11, 12, 13), "".join(order)
        assert sim.stats.max_concurrent <= SLOTS  # never exceeded, the kill included
        print(f"slots reclaimed {reclaimed_s:.2f} s after SIGKILL (lease TTL {TTL_S} s)")
        await a.close(), await b.close(), await a2.close()


async def test_a_paused_replica_ends_its_requests_when_it_wakes(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    """SIGSTOP past the TTL: Redis gives its leases to the other replica while its requests
    still run at the backend (the bound: slots + what it ran). At SIGCONT its heartbeat
    learns it lost them, and it ends those requests, within one heartbeat."""
    sim = await lab.backend(time_scale=1.0, decode_tokens_per_s=40.0, max_num_seqs=8)
    async with replicas(sim, redis_url, tmp_path) as (first, second):
        a, b = first.client("A"), second.client("B")
        a_streams = [asyncio.create_task(stream(a, "A", 2000)) for _ in range(SLOTS)]
        await eventually(lambda: sim.stats.running == SLOTS, within=10)
        b_requests = [asyncio.create_task(stream(b, "B", 2000)) for _ in range(SLOTS)]
        first.proc.send_signal(signal.SIGSTOP)
        await eventually(lambda: sim.stats.running == 2 * SLOTS, within=4 * TTL_S)
        first.proc.send_signal(signal.SIGCONT)
        woke = time.monotonic()
        await eventually(lambda: sim.stats.running == SLOTS, within=2 * TTL_S)
        overlap_s = time.monotonic() - woke
        assert [r.user for r in sim.stats.log if r.outcome is None] == ["B"] * SLOTS
        print(f"a paused replica's requests ended {overlap_s:.2f} s after it woke")
        for task in [*a_streams, *b_requests]:
            task.cancel()
        await asyncio.gather(*a_streams, *b_requests, return_exceptions=True)
        await a.close(), await b.close()


async def test_workers_share_the_port_and_one_fairness_domain(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    """``serve --workers 2``: two processes on one port, both in Redis; 60 concurrent
    requests (new connections, spread by the kernel) never exceed the slots; a worker
    killed is started again; SIGTERM ends them all, and their metrics directory goes. The
    directory that a parent killed with SIGKILL left is removed at the next start."""
    sim = await lab.backend(max_num_seqs=8)
    path = tmp_path / "config.yaml"
    state = {"redis": redis_url, "lease_ttl_s": TTL_S}
    path.write_text(config_yaml([sim.url], slots=SLOTS, state=state))
    shm, left = _left_by_a_killed_parent()
    # each client's own connection pool, made before the proxy starts: each costs an SSL
    # context (~60 ms on a busy machine), and 60 at once stalled this loop for seconds, so
    # that its simulated backend missed both workers' health probes (a 503 in CI, once)
    transports = [openai.DefaultAsyncHttpxClient() for _ in range(70)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path), "--workers", "2",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        url = banner_url(line)
        await eventually(lambda: _holders(redis_url, 2), within=15)
        assert not left.exists()
        assert len(list(shm.glob(f"{METRICS_PREFIX}{proc.pid}-*"))) == 1  # the group's

        async def fresh(org: str) -> int:  # a client of its own: a connection of its own
            async with openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key=KEYS[org], max_retries=0,
                http_client=transports.pop(),
            ) as client:  # fmt: skip
                reply = await client.chat.completions.create(
                    model=MODEL, messages=CHAT, max_tokens=5, user=org
                )
                return reply.usage.completion_tokens if reply.usage else 0

        assert await asyncio.gather(*(fresh("AB"[i % 2]) for i in range(60))) == [5] * 60
        assert sim.stats.max_concurrent <= SLOTS

        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        await eventually(lambda: len(set(children(proc.pid)) - set(workers)) == 1, within=10)
        await eventually(lambda: _holders(redis_url, 2), within=15)  # the dead one reaped
        assert await asyncio.gather(*(fresh("A") for _ in range(10))) == [5] * 10
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    assert not list(shm.glob(f"{METRICS_PREFIX}{proc.pid}-*"))


def _left_by_a_killed_parent() -> tuple[Path, Path]:
    """Where a parent makes its workers' metrics directory, and one made there as a parent
    killed with SIGKILL leaves it: named after a pid no longer running, its lock free."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = shm / f"{METRICS_PREFIX}{dead.pid}-{uuid.uuid4().hex[:8]}"
    left.mkdir()
    return shm, left


async def test_workers_without_shared_state_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(["http://127.0.0.1:9"]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path), "--workers", "2",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 1
    assert b"--workers 2 needs state: redis" in err


async def test_a_proxy_that_cannot_reach_redis_does_not_start(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    unreachable = "redis://127.0.0.1:9/0"
    path.write_text(config_yaml(["http://127.0.0.1:9"], state={"redis": unreachable}))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert b"listening" not in out
    assert b"state: cannot reach Redis at redis://127.0.0.1:9/0" in err


async def _holders(redis_url: str, n: int) -> bool:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return bool(await client.zcard("sfq:{sim}:holders") == n)
    finally:
        await client.aclose()
