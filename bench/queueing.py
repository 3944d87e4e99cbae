"""Queueing cost: RSS per queued request, dispatch rate as slots free up, event-loop lag.

    python bench/queueing.py [--requests 10000] [--slots 8] [--rate 1000] [--seconds 10]

The proxy runs in this process, so that its RSS (VmRSS) and its event loop are measured
exactly, on a realistic config: four keys and orgs, two classes, a capped org, metrics and
the JSON access log on (written to /dev/null). Everything else runs in other processes so
that its memory and CPU are not counted: a driver (this script with --driver) that plays a
gated fake backend and the clients, a second driver as the floor, nginx and wrk.

Queue: N requests, each on its own connection, wait behind a backend whose slots a closed
gate holds. The RSS they add per request is set against a floor: the same N requests held
by a bare aiohttp server that only reads the body, run in a second driver process (a heap
does not give back what it freed, so a floor measured in this process after the proxy's
run would reuse that memory and read near zero). "Beyond its body" takes the body's size
off (both hold the body). Then the gate opens, and the time until all N are answered gives
the dispatch rate.

Lag: wrk sends about --rate req/s through the proxy to nginx, from many connections that
each wait a random time after every answer (wrk's delay() hook), while a probe in the
proxy's loop measures how late a 5 ms sleep wakes up; the same probe with no load is the
reference (uvloop's timers tick in whole milliseconds).
Requires: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import aiohttp
import harness
import uvloop
import yaml
from aiohttp import web

from sfq_proxy.config import parse_config
from sfq_proxy.http.proxy import PROXY, Proxy
from sfq_proxy.observability import access_log
from sfq_proxy.runner.server import bound_url, running

T = TypeVar("T")
CHAT_PATH = "/v1/chat/completions"
QUEUE_POOL, QUEUE_MODEL = "queue", "bench-queue"
LAG_POOL, LAG_MODEL, LAG_SLOTS = "lag", "bench-json", 512
# 64 at a time: memory freed after a deep warm-up queue would be reused by the measured one
WARMUP, WARMUP_CONCURRENCY = 2000, 64
PROBE_S, IDLE_S = 0.005, 3.0
WRK_CONNECTIONS = 128  # many clients, each mostly idle: the latency slows the rate little
STALL_S = 15.0  # longer than a client's SYN retries when the accept backlog overflows
COMPLETION = harness.completion().encode()


class Failed(Exception):
    """The benchmark could not measure what it set out to (a request failed, a timeout)."""


def raise_nofile() -> None:
    """N held requests are N sockets on each side."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def chat_body(model: str) -> bytes:
    return json.dumps({**harness.CHAT, "model": model}).encode()


def settled_rss() -> int:
    """This process's resident memory in bytes, after a full collection."""
    gc.collect()
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


async def until(count: Callable[[], int], target: int, what: str) -> float:
    """Poll ``count`` until it reaches ``target``; return when it did (perf_counter).

    Fails once it has not moved for STALL_S: requests were refused or lost on the way."""
    last, moved = count(), time.monotonic()
    while (now := count()) < target:
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > STALL_S:
            raise Failed(f"{what}: stuck at {now} of {target}")
        await asyncio.sleep(0.01)
    return time.perf_counter()


class Held:
    """POSTs whose body is read, then held until the gate opens: a driver's gated backend.
    In a driver that sends nothing it is the floor: a request held as cheaply as an aiohttp
    server can."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.waiting = 0

    async def hold(self, request: web.Request) -> web.Response:
        await request.read()
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        return web.Response(body=COMPLETION, content_type="application/json")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT_PATH, self.hold)
        app.router.add_get("/health", _health)  # the proxy probes its backends
        return app


async def _health(request: web.Request) -> web.Response:
    return web.Response()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """``app`` on a free port of 127.0.0.1, with the runner options the proxy uses."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    return runner, bound_url(runner)


# --- the driver process: the gated backend and the clients ---------------------------------


def reply(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def drive() -> None:
    """--driver: serve the gated backend and obey one command a line on stdin; one JSON
    line answers each command (a ``send`` once all of its requests are answered)."""
    held = Held()
    runner, url = await serve(held.app())
    reply(backend=url)
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    sending: set[asyncio.Task[None]] = set()
    while command := (await stdin.readline()).decode().split():
        match command:
            case ["send", target, model, n, concurrency]:
                task = asyncio.create_task(send(target, model, int(n), int(concurrency)))
                sending.add(task)
                task.add_done_callback(sending.discard)
            case ["open"]:
                held.gate.set()
                reply(gate="open")
            case ["close"]:
                held.gate.clear()
                reply(gate="closed")
            case ["holds", n]:
                await until(lambda: held.waiting, int(n), "requests held by the backend")
                reply(held=held.waiting)
            case ["rss"]:
                reply(rss=settled_rss())
    await runner.cleanup()


async def send(url: str, model: str, n: int, concurrency: int) -> None:
    """``n`` chat requests, ``concurrency`` at a time, each on a connection of its own (as
    many clients would), spread over the keys; then reply how they ended."""
    body = chat_body(model)
    headers = [
        {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        for key in harness.KEYS
    ]
    limit = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(i: int) -> str:
            async with limit:
                try:
                    post = session.post(url, data=body, headers=headers[i % len(headers)])
                    async with post as response:
                        await response.read()
                        return str(response.status)
                except aiohttp.ClientError as err:
                    return type(err).__name__

        statuses = Counter(await asyncio.gather(*(one(i) for i in range(n))))
    reply(statuses=statuses)


# --- the main process: the proxy, the floor and the probes ---------------------------------


class Driver:
    """A driver process seen from here: commands on its stdin, JSON replies on its stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.backend = ""

    @classmethod
    @contextlib.asynccontextmanager
    async def started(cls) -> AsyncIterator[Driver]:
        """A driver whose backend listens, until the block exits; then end of stdin ends
        it (it is killed if it does not go)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--driver", stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            driver = cls(proc)
            driver.backend = (await driver.reply())["backend"]
            yield driver
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    def tell(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)).encode() + b"\n")

    async def ask(self, *words: object) -> dict[str, Any]:
        self.tell(*words)
        return await self.reply()

    async def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise Failed("the driver exited")
        return json.loads(line)

    def send(self, url: str, n: int, concurrency: int) -> None:
        """Start ``n`` requests to ``url``; ``answered`` waits for them."""
        self.tell("send", url + CHAT_PATH, QUEUE_MODEL, n, concurrency)

    async def answered(self, n: int) -> None:
        """Wait until the ``n`` requests sent are answered; every one must be a 200."""
        statuses = (await self.reply())["statuses"]
        if statuses != {"200": n}:
            raise Failed(f"{n} requests ended {statuses}, not all 200")


def proxy_config(queue_backend: str, lag_backends: list[str], slots: int, requests: int) -> str:
    """The keys and orgs of overhead.py (harness.KEYS), two classes that admit all ``requests`` and
    never expire them, a pool behind the gate with ``slots`` and one for the lag run."""

    def pool(model: str, backends: list[str], slots: int) -> dict[str, Any]:
        # the driver's backend shares a loop with its clients: while thousands of them
        # connect it answers a probe late, and must not be taken for down
        return {"models": [model], "health": {"interval_s": 5, "timeout_s": 30},
                "backends": [{"url": url, "slots": slots} for url in backends]}  # fmt: skip

    return yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "drain_timeout_s": 1,  # a failed run leaves requests held at the closed gate
        # every client here is 127.0.0.1: one peer may hold every connection (else half)
        "limits": {"max_connections_per_peer": 1 << 24},
        "keys": [{"key": key, "org": org, "classes": list(dict.fromkeys([cls, "batch"]))}
                 for key, (org, cls) in harness.KEYS.items()],
        "orgs": {"team-a": {"weight": 2}, "team-b": {"weight": 1, "max_in_flight": 400}},
        "classes": {"interactive": {"weight": 6, "max_queue_len": requests},
                    "batch": {"weight": 1, "max_queue_len": requests}},
        "pools": {QUEUE_POOL: pool(QUEUE_MODEL, [queue_backend], slots),
                  LAG_POOL: pool(LAG_MODEL, lag_backends, LAG_SLOTS)},
    }, sort_keys=False)  # fmt: skip


async def warm_up(driver: Driver, url: str, gated: Driver) -> None:
    """WARMUP requests through ``url`` while ``gated``'s gate is open (it is closed after):
    allocators, code paths, metric labels and the proxy's upstream connections."""
    await gated.ask("open")
    driver.send(url, WARMUP, WARMUP_CONCURRENCY)
    await driver.answered(WARMUP)
    await gated.ask("close")


async def queue_in_proxy(
    proxy: Proxy, url: str, driver: Driver, n: int, slots: int
) -> tuple[float, float, float]:
    """RSS per request while ``n`` wait in the proxy (``slots`` of them at the backend);
    then the seconds from the gate's opening until all are answered, and until none is
    queued any more."""
    scheduler = proxy.pools[QUEUE_POOL].scheduler
    await warm_up(driver, url, driver)
    before = settled_rss()
    driver.send(url, n, n)
    # the slots fill first: queued + running = n is n - slots queued behind them
    await until(lambda: scheduler.queued() + scheduler.running, n, "requests in the proxy")
    await driver.ask("holds", min(n, slots))  # the dispatched have reached the backend
    held = settled_rss()
    start = time.perf_counter()
    await driver.ask("open")
    emptied = asyncio.create_task(until(lambda: n - scheduler.queued(), n, "dispatched"))
    await driver.answered(n)
    return (held - before) / n, time.perf_counter() - start, await emptied - start


async def queue_in_floor(driver: Driver, floor: Driver, n: int) -> float:
    """RSS per request while ``n`` are held by ``floor``'s bare aiohttp server."""
    await warm_up(driver, floor.backend, floor)
    before = (await floor.ask("rss"))["rss"]
    driver.send(floor.backend, n, n)
    await floor.ask("holds", n)
    held = (await floor.ask("rss"))["rss"]
    await floor.ask("open")
    await driver.answered(n)
    return (held - before) / n


async def lag_during(work: Awaitable[T]) -> tuple[list[float], T]:
    """How late a PROBE_S sleep in this loop wakes up, again and again until ``work`` is
    done. perf_counter, not loop.time(): uvloop's clock has whole milliseconds."""
    task = asyncio.ensure_future(work)
    lags = []
    while not task.done():
        start = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        lags.append(max(0.0, time.perf_counter() - start - PROBE_S))  # < 0: timer rounding
    return lags, await task


async def wrk(url: str, rate: int, seconds: int, work: Path) -> float:
    """Run wrk at about ``rate`` req/s over the keys; return the rate it achieved.

    After every answer a connection waits 0 to 2·WRK_CONNECTIONS/rate s at random: the
    connections do not march in step (their requests would arrive in bursts), and the rate
    stays a little under ``rate`` by the latency. One wrk thread, one random sequence."""
    keys = ", ".join(json.dumps(key) for key in harness.KEYS)
    script = work / "paced.lua"
    script.write_text(f"""
local body = {json.dumps(chat_body(LAG_MODEL).decode())}
local keys = {{{keys}}}
local sent = 0
function request()
  sent = sent + 1
  local headers = {{["Content-Type"] = "application/json",
                   ["Authorization"] = "Bearer " .. keys[sent % #keys + 1]}}
  return wrk.format("POST", nil, headers, body)
end
function delay() return math.random(0, {round(2 * WRK_CONNECTIONS * 1000 / rate)}) end
""")
    try:
        result = await asyncio.to_thread(
            harness.wrk, url, script, WRK_CONNECTIONS, seconds, threads=1, path=CHAT_PATH
        )
    except (RuntimeError, subprocess.CalledProcessError) as err:
        raise Failed(f"wrk failed or saw errors: {err}") from err
    if result["sockerr"]:
        raise Failed(f"wrk saw {result['sockerr']:.0f} socket errors")
    return result["rps"]


def percentiles(lags: list[float]) -> str:
    cuts = statistics.quantiles(lags, n=100)
    return f"p50 {cuts[49] * 1e3:.2f} ms  p99 {cuts[98] * 1e3:.2f} ms  max {max(lags) * 1e3:.2f} ms"


def kib(size: float) -> str:
    return f"{size / 1024:.2f} KiB"


async def bench(args: argparse.Namespace, work: Path, log: IO[str], nginx: list[str]) -> None:
    access_log.configure(log, fmt="json")  # as `serve` writes it to a file or a pipe
    async with Driver.started() as driver, Driver.started() as floor:
        yaml_text = proxy_config(
            driver.backend, nginx or [driver.backend], args.slots, args.requests
        )
        async with running(parse_config(yaml_text, environ={})) as runner:
            gc.freeze()  # as `sfq-proxy serve` does once it listens
            url = bound_url(runner)
            await report_queue(args, runner.app[PROXY], url, driver, floor)
            await driver.ask("open")  # the lag pool's backend when there is no nginx
            await report_lag(args, url, work)


async def report_queue(
    args: argparse.Namespace, proxy: Proxy, url: str, driver: Driver, floor: Driver
) -> None:
    n, body = args.requests, len(chat_body(QUEUE_MODEL))
    print(f"queue: {n} requests, body {body} B, {args.slots} slots", flush=True)
    queued, dispatch_s, empty_s = await queue_in_proxy(proxy, url, driver, n, args.slots)
    bare = await queue_in_floor(driver, floor, n)
    added = kib(queued - bare)
    print(
        f"  rss per queued request  sfq-proxy {kib(queued)}  "
        f"floor (aiohttp, held request) {kib(bare)}  added by sfq-proxy {added}"
    )
    print(
        f"  beyond its {body} B body  sfq-proxy {kib(queued - body)}  "
        f"floor {kib(bare - body)}  added by sfq-proxy {added}"
    )
    print(
        f"  dispatch when slots free: {n} in {dispatch_s:.2f} s = "
        f"{n / dispatch_s:.0f} req/s; queue empty after {empty_s:.2f} s",
        flush=True,
    )


async def report_lag(args: argparse.Namespace, url: str, work: Path) -> None:
    idle, _ = await lag_during(asyncio.sleep(IDLE_S))
    loaded, rate = await lag_during(wrk(url, args.rate, args.seconds, work))
    print(
        f"lag: {rate:.0f} req/s achieved for {args.seconds} s: {percentiles(loaded)}"
        f"   (idle: {percentiles(idle)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000, help="how many to queue")
    parser.add_argument("--slots", type=int, default=8, help="the gated backend's slots")
    parser.add_argument("--rate", type=int, default=1000, help="req/s for the lag run")
    parser.add_argument("--seconds", type=int, default=10, help="length of the lag run")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    raise_nofile()
    if args.driver:
        uvloop.run(drive())
        return
    harness.need("wrk", packages="wrk")
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as log:
        work = Path(tmp)
        try:
            with harness.Processes(work) as procs:
                # nginx's JSON answers for the lag run; without it, the driver's backend
                nginx = harness.nginx(procs, ["json"])["json"] if shutil.which("nginx") else []
                uvloop.run(bench(args, work, log, nginx))
        except Failed as err:
            sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
