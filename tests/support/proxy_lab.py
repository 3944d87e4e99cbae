"""End-to-end test helpers: real simulated LLM servers and a real proxy on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sfq_proxy.config import Config, default_classes, parse_config
from sfq_proxy.core.fair_queue import FairQueue
from sfq_proxy.core.flows import org_and_class
from sfq_proxy.http.proxy import PROXY, Proxy
from sfq_proxy.runner.server import bound_url, running
from sfq_proxy.sim.server import SimBackend
from sfq_proxy.sim.settings import SimConfig

MODEL = "sim-llama"
_HEALTHY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
# what the ``access_log`` fixture gives: the access lines so far, parsed
AccessLines = Callable[[], Awaitable[list[dict[str, Any]]]]
KEYS = {"A": "sk-test-org-a", "B": "sk-test-org-b", "C": "sk-test-org-c", "OPS": "sk-test-ops"}


BANNER_URL = re.compile(r'http://[^\s",]+')


def banner_url(line: str) -> str:
    """The URL a first line of ``serve`` (or ``demo``) names, written as text or JSON."""
    found = BANNER_URL.search(line)
    assert found, line
    return found[0]


def proxy_config(
    backend_urls: list[str], *, environ: dict[str, str] | None = None, **options: Any
) -> Config:
    """A config with orgs A, B, C (keys in ``KEYS``) and one pool ``sim`` of ``backend_urls``;
    ``options`` as for :func:`config_yaml`."""
    return parse_config(config_yaml(backend_urls, **options), environ=environ or {})


def config_yaml(
    backend_urls: list[str],
    *,
    slots: int = 4,
    pool: dict[str, Any] | None = None,
    **overrides: Any,
) -> str:
    """The YAML of :func:`proxy_config`: ``pool`` adds settings to the pool, ``overrides``
    replaces top-level sections. The OPS key has the priority class ``system`` only where
    the band fits (see :func:`_band_only_where_it_fits`)."""
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "keys": [
            {"key": KEYS["A"], "org": "A", "classes": ["batch", "interactive"]},
            {"key": KEYS["B"], "org": "B", "classes": ["batch"]},
            {"key": KEYS["C"], "org": "C", "classes": ["interactive"]},
            {"key": KEYS["OPS"], "org": "ops", "classes": ["system", "interactive"]},
        ],
        "pools": {
            "sim": {
                "models": [MODEL],
                "health": {"interval_s": 0.1, "cooldown_s": 0.2, "timeout_s": 5},
                "timeouts": {"connect_s": 1, "first_byte_s": 10},
                "backends": [{"url": url, "slots": slots} for url in backend_urls],
                **(pool or {}),
            }
        },
        "drain_timeout_s": 5,
    }
    data.update(overrides)
    _band_only_where_it_fits(data)
    return yaml.safe_dump(data)


def _band_only_where_it_fits(data: dict[str, Any]) -> None:
    """Take ``system`` from the OPS key when the smallest pool has no more slots than the
    class's ``max_in_flight``: the config refuses a priority band that could fill a pool
    (docs/design.md §3), so a 1-slot pool, or a 4-slot one with the default cap 4, has none."""
    classes = data.get("classes") or {n: c.model_dump() for n, c in default_classes().items()}
    cap = classes.get("system", {}).get("max_in_flight")
    slots = min(sum(_slots(b) for b in pool["backends"]) for pool in data["pools"].values())
    if cap is not None and cap >= slots:
        for key in data["keys"]:
            if key.get("key") == KEYS["OPS"]:
                key["classes"] = [c for c in key["classes"] if c != "system"]


def _slots(backend: dict[str, Any]) -> int:
    """A backend's slots as the band's check counts them: ``slots: auto`` as its capacity,
    else 1 (``dispatch.fallback_slots``' default)."""
    slots = backend["slots"]
    return slots if isinstance(slots, int) else backend.get("capacity", 1)


@dataclass(frozen=True)
class Served:
    """A running proxy: where it listens, and its live state for white-box assertions."""

    url: str
    state: Proxy

    def queue(self, pool: str = "sim") -> FairQueue[Any]:
        return self.state.pools[pool].scheduler.queue


class Lab:
    """Starts simulated backends and proxies; stops them all when the test ends."""

    def __init__(self, stack: contextlib.AsyncExitStack) -> None:
        self._stack = stack
        self._clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}

    async def backend(self, port: int = 0, **options: Any) -> SimBackend:
        options = {"models": [MODEL], "time_scale": 50.0, **options}
        sim = SimBackend(SimConfig(**options))
        await sim.start(host="127.0.0.1", port=port)
        self._stack.push_async_callback(sim.stop)
        return sim

    async def proxy(self, config: Config, **app_options: Any) -> Served:
        runner = await self._stack.enter_async_context(running(config, **app_options))
        return Served(url=bound_url(runner), state=runner.app[PROXY])

    def client(self, served: Served, org: str = "A", **options: Any) -> openai.AsyncOpenAI:
        """An SDK client with ``org``'s key; one per (proxy, org) unless options are given."""
        cache_key = (served.url, org)
        if not options and cache_key in self._clients:
            return self._clients[cache_key]
        client = openai.AsyncOpenAI(
            base_url=f"{served.url}/v1", api_key=KEYS[org], max_retries=0, **options
        )
        self._stack.push_async_callback(client.close)
        if not options:
            self._clients[cache_key] = client
        return client

    async def serve(self, app: web.Application) -> int:
        """Run ``app`` on a free loopback port (a hand-made backend); returns the port."""
        runner = web.AppRunner(app)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner.addresses[0][1]

    async def raw(self, *answer: bytes | float) -> str:
        """A backend that speaks garbage: it answers ``GET /health`` with a good 200, and any
        other request with the parts of ``answer`` (anything at all, HTTP or not), a moment
        apart so each arrives on its own, then hangs up; a number in ``answer`` is that many
        seconds of silence. Returns its URL."""

        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                for part in (_HEALTHY,) if head.startswith(b"GET /health ") else answer:
                    if isinstance(part, bytes):
                        writer.write(part)
                        await writer.drain()
                    await asyncio.sleep(0.05 if isinstance(part, bytes) else part)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(reply, "127.0.0.1", 0)
        self._stack.push_async_callback(server.wait_closed)
        self._stack.callback(server.close)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def http(self) -> aiohttp.ClientSession:
        session = aiohttp.ClientSession()
        self._stack.push_async_callback(session.close)
        return session


def leftovers(served: Served) -> list[str]:
    """What finished requests left behind in the proxy's pools: nothing, when they are whole
    (no queue entry, no request counted as running, no slot held, no live idempotency key)."""
    found = []
    for name, pool in served.state.pools.items():
        scheduler = pool.scheduler
        if scheduler.queued() or scheduler.running or scheduler.flow_running:
            found.append(f"{name}: {scheduler.queued()} queued, {scheduler.running} running")
        found += [f"{name}/{b.name}: {b.in_flight} slots held" for b in pool.placement.backends
                  if b.in_flight]  # fmt: skip
    if served.state.admission._active:
        found.append(f"idempotency keys still live: {len(served.state.admission._active)}")
    return found


async def dispatched_behind(
    served: Served, blocker: Any, flood: list[Awaitable[Any]], *, within: float = 10
) -> list[str]:
    """Queue ``flood`` behind ``blocker`` (a stream holding the pool's only slot), close it
    once all of ``flood`` waits, and return the orgs dispatched after that, in order: the
    order is then the scheduler's alone, not the order the requests happened to arrive in."""
    replies = asyncio.gather(*flood)
    await eventually(lambda: len(served.queue()) == len(flood), within=within)
    recent = served.state.pools["sim"].recent
    start = len(recent)
    await blocker.close()
    await replies
    return [org_and_class(d.flow)[0] for d in list(recent)[start:]]


async def keep_asking(
    lab: Lab, served: Served, org: str, clients: int, until: asyncio.Event, **ask: Any
) -> int:
    """``clients`` chat calls of ``org`` at a time through the SDK, each sent again as soon
    as it is answered, until ``until`` is set; returns how many were answered."""
    create = lab.client(served, org).chat.completions.create

    async def one() -> int:
        answered = 0
        while not until.is_set():
            await create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **ask)
            answered += 1
        return answered

    return sum(await asyncio.gather(*(one() for _ in range(clients))))


async def eventually(predicate: Callable[[], bool | Awaitable[bool]], within: float = 2.0) -> None:
    """Poll ``predicate`` (state in another server) until it holds; fail after ``within`` s."""
    for _ in range(round(within / 0.01)):
        result = predicate()
        if await result if inspect.isawaitable(result) else result:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still false after {within} s: {predicate}")


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(lab: Lab, served: Served) -> Samples:
    """The proxy's ``/metrics``: each sample by (name, labels)."""
    http = await lab.http()
    async with http.get(f"{served.url}/metrics") as r:
        text = await r.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def assert_alternate(order: list[str], per_org: int) -> None:
    """Orgs A and B of equal weight, ``per_org`` requests each, dispatched in ``order``: all
    served, and by turns (never more than one apart) while both still had requests queued."""
    assert Counter(order) == {"A": per_org, "B": per_org}, order
    counts: Counter[str] = Counter()
    for org in order:
        counts[org] += 1
        if counts["A"] < per_org and counts["B"] < per_org:
            assert abs(counts["A"] - counts["B"]) <= 1, order


async def serve_process(
    config_text: str, tmp_path: Path, workers: int = 1
) -> tuple[asyncio.subprocess.Process, str]:
    """``sfq-proxy serve`` on ``config_text`` (with ``--workers`` when ``workers`` > 1), in
    a process of its own (signals, exit codes, its own memory); returns it and its URL once
    every worker listens. Its stdout past the "listening" lines (the access log) is read
    and dropped, so that a full pipe never holds the proxy up."""
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    more = ["--workers", str(workers)] if workers > 1 else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path), *more,
        stdout=asyncio.subprocess.PIPE, env=os.environ.copy(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode()]
        while sum("listening on" in line for line in lines) < workers:  # the parent's first
            lines.append((await asyncio.wait_for(proc.stdout.readline(), 30)).decode())
    except BaseException:  # never up: no caller holds it to stop it, so it would outlive us
        proc.kill()
        await proc.wait()
        raise
    url = banner_url(lines[0])
    asyncio.get_running_loop().create_task(_discard(proc.stdout))
    return proc, url


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):  # gone meanwhile: read as "", or fails
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return sorted(found)
