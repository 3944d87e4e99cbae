"""What the dispatch functions cost inside Redis, per operation and per request.

    python bench/redis_functions.py [--requests 20000] [--rounds 3] [--baseline OLD.lua ...]

Starts its own redis-server on a free port (no persistence), loads `sfq_proxy/state/
dispatch.lua` as the proxy does (through `RedisDispatch`: the library is loaded by the first
call that finds it missing), registers two holders (two workers) and configures a pool like
config/example.yaml's: two backends of 16 slots, org analytics capped at 16 in flight, the
priority class system at 4. Then it replays a seeded request stream of five flows (mostly
product/interactive and analytics/batch, 1 in 50 a priority request), each request a submit
by one holder and, later, a finish by the holder it was granted to; a heartbeat of each
holder every 500 requests. Three scenarios: `free` keeps 24 requests in flight or queued, so
every submit dispatches at once (the hot path: no cap hit, no size buckets, no pacing, no
affinity; analytics' and the priority class's requests still take the path of a capped
flow); `backlogged` keeps 48, so requests queue and finishes dispatch them; `batched` sends
20 submits at once, then the finishes of all that run at once, as a busy proxy's operations
leave together (state/redis_batcher.py: one call for the 19 that came while the first was on its
way), and is not timed per operation.

Each round and scenario is run twice, each time on a pool of its own: once by four streams
at once sharing the scenario's window (their calls reach Redis back to back, as a busy
proxy's do), to measure Redis's CPU per request (`INFO cpu`, used_cpu_sys + used_cpu_user,
whose delta covers the FCALLs and the inbox reads, the network included), FCALL's µs per
call and the commands the functions ran (`INFO commandstats`, after `CONFIG RESETSTAT`: a
command run by `redis.call` is counted there too); then by one stream on a quarter of the
requests, reading `INFO commandstats` after each call, whose growth of FCALL's usec is that
call's time in Redis: µs per call of each operation, a submit or finish told apart by
whether it dispatched (+grant) or not (alone). These calls run cold (the INFO between them
evicts Redis's caches): compare them with each other, not with FCALL's mean. Medians over
the rounds are printed. `--baseline` runs another version of the library beside the
package's, round by round, so that the machine's other work weighs on both alike.
Requires: apt-get install redis-server.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from collections import defaultdict, deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import harness
from harness import Processes
from redis.asyncio import Redis

from sfq_proxy.state import redis_dispatch
from sfq_proxy.state.redis_dispatch import Grant, RedisDispatch, SharedTicket, pool_prefix
from sfq_proxy.state.redis_functions import DISPATCH, Library

BACKENDS = [("gpu-a", 16), ("gpu-b", 16)]
ORG_CAPS = {"analytics": 16}
CLASS_CAPS = {"system": 4}
# (org, class, weight: class weight x org weight, priority, share of the requests)
FLOWS = [
    ("product", "interactive", 12.0, False, 40),
    ("analytics", "batch", 1.0, False, 25),
    ("product", "batch", 2.0, False, 18),
    ("ops", "interactive", 6.0, False, 15),
    ("ops", "system", 1.0, True, 2),
]
# requests in flight or queued at once; None: `batched`, BATCH submits sent at once, then
# their finishes, as a busy proxy's operations leave together (state/redis_batcher.py)
SCENARIOS: dict[str, int | None] = {"free": 24, "backlogged": 48, "batched": None}
BATCH = 20
STREAMS = 4  # concurrent streams sharing a scenario's window, for the CPU figures
HEARTBEAT_EVERY = 500


@dataclass
class Measure:
    """One scenario's figures in one round."""

    cpu_us_per_request: float = 0.0
    fcall_us: float = 0.0
    fcalls_per_request: float = 0.0
    inner_per_request: float = 0.0  # commands the functions ran (redis.call), TIME included
    per_op: dict[str, float] = field(default_factory=dict)
    calls_per_op: dict[str, int] = field(default_factory=dict)


class Stream:
    """A seeded request stream on one pool, driven by two holders of its own (the ``at``-th
    stream's: several streams may share a pool)."""

    def __init__(self, redis: Redis, pool: str, window: int, seed: int, at: int = 0) -> None:
        self.redis = redis
        self.holders = [RedisDispatch(redis, pool, f"h{2 * at + i}") for i in (1, 2)]
        self.prefix = pool_prefix(pool)
        self.window = window
        self.rng = random.Random(seed)
        self.running: deque[tuple[RedisDispatch, str]] = deque()  # (holder, lease), oldest first
        self.queued = 0
        self.next_id = 0
        self.name = f"s{at}"  # ticket ids unique on the pool, as the proxy's are
        self.inbox_reads = 0  # LPOPs of this client, told from the functions' own

    async def start(self) -> None:
        for holder in self.holders:
            await holder.heartbeat(30.0, new=True)
        await self.holders[0].configure(BACKENDS, ORG_CAPS, CLASS_CAPS)

    def ticket(self) -> SharedTicket:
        org, cls, weight, priority, _ = self.rng.choices(FLOWS, [f[4] for f in FLOWS])[0]
        cost = self.rng.choice([300.0, 800.0, 1500.0, 4000.0])
        return SharedTicket(org, cls, cost, weight, tokens=cost, priority=priority)

    async def granted(self, holder: RedisDispatch, grants: list[Grant]) -> None:
        """Note grants made to ``holder`` and those the call left in the other's inbox."""
        self.note(holder, grants)
        for other in self.holders:
            if other is not holder:  # a call leaves grants in the others' inboxes only
                await self.read_inbox(other)

    def note(self, holder: RedisDispatch, grants: list[Grant]) -> None:
        self.running.extend((holder, g.lease) for g in grants)
        self.queued -= len(grants)

    async def read_inbox(self, holder: RedisDispatch) -> None:
        self.inbox_reads += 1
        raw = await self.redis.lpop(f"{self.prefix}inbox:{holder.holder}", 1000) or []
        for item in raw:
            grant = item.decode() if isinstance(item, bytes) else str(item)
            self.running.append((holder, grant.split(" ")[1]))
            self.queued -= 1

    async def run(self, requests: int) -> None:
        for n in range(requests):
            if n % HEARTBEAT_EVERY == 0:
                for holder in self.holders:
                    await self.granted(holder, await holder.heartbeat(30.0))
            while len(self.running) + self.queued >= self.window and self.running:
                at = self.rng.randrange(min(4, len(self.running)))  # some finish out of order
                holder, lease = self.running[at]
                del self.running[at]
                await self.granted(holder, await holder.finish(lease))
            holder = self.holders[n % 2]
            self.next_id += 1
            self.queued += 1
            grants = await holder.submit(
                f"{self.name}t{self.next_id}", self.ticket(), max_ahead=1000
            )
            await self.granted(holder, grants)

    async def run_batched(self, requests: int) -> None:
        """``requests`` in turns of BATCH submits sent at once by one holder, which its
        batcher sends as one call (the first alone), then every running request's finish at
        once, until the turn's requests are all done."""
        for n in range(0, requests, BATCH):
            holder = self.holders[n // BATCH % 2]
            ids = [f"{self.name}t{self.next_id + i}" for i in range(1, BATCH + 1)]
            self.next_id += BATCH
            self.queued += BATCH
            submits = (holder.submit(i, self.ticket(), max_ahead=1000) for i in ids)
            for grants in await asyncio.gather(*submits):
                self.note(holder, grants)
            await self.read_inbox(self.holders[1 - n // BATCH % 2])  # once a turn, not a call
            while self.running:
                running, self.running = list(self.running), deque()
                finished = await asyncio.gather(*(h.finish(lease) for h, lease in running))
                for (h, _), grants in zip(running, finished, strict=True):
                    self.note(h, grants)
                for other in self.holders:
                    await self.read_inbox(other)

    async def drain(self) -> None:
        while self.running:
            holder, lease = self.running.popleft()
            await self.granted(holder, await holder.finish(lease))


async def cpu_s(redis: Redis) -> float:
    """Redis's CPU time so far, all its threads, in seconds."""
    cpu = await redis.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def totals(redis: Redis, pool: str, window: int | None, requests: int, seed: int) -> Measure:
    """CPU per request, FCALL's µs per call and the commands the functions ran, with
    STREAMS streams at once on the pool (their calls reach Redis back to back, as a busy
    proxy's do, rather than one at a time into an idle server); ``window`` None: batched."""
    streams = [
        Stream(redis, pool, (window or 0) // STREAMS, seed * 100 + at, at) for at in range(STREAMS)
    ]
    for stream in streams:
        await stream.start()
    share = requests // STREAMS

    def run(stream: Stream, n: int) -> Coroutine[Any, Any, None]:
        return stream.run(n) if window is not None else stream.run_batched(n)

    await asyncio.gather(*(run(s, share // 10) for s in streams))  # warm-up: library, flows
    await redis.config_resetstat()
    before, reads = await cpu_s(redis), sum(s.inbox_reads for s in streams)
    await asyncio.gather(*(run(s, share) for s in streams))
    after = await cpu_s(redis)
    stats = await redis.info("commandstats")
    reads = sum(s.inbox_reads for s in streams) - reads
    for stream in streams:
        await stream.drain()
    requests = share * STREAMS
    fcall = stats["cmdstat_fcall"]
    client = int(fcall["calls"]) + reads + stats["cmdstat_info"]["calls"]
    inner = sum(int(s["calls"]) for s in stats.values()) - client
    return Measure(
        cpu_us_per_request=(after - before) * 1e6 / requests,
        fcall_us=float(fcall["usec_per_call"]),
        fcalls_per_request=int(fcall["calls"]) / requests,
        inner_per_request=inner / requests,
    )


class Timed(Redis):
    """A client that reads, after each function call, what it cost inside Redis: the growth
    of FCALL's usec in `INFO commandstats` (one call at a time: nothing else runs FCALL)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spent: dict[str, list[int]] = defaultdict(list)
        self.usec = 0

    async def fcall(self, function: str, numkeys: int, *keys_and_args: Any) -> Any:
        reply = await super().fcall(function, numkeys, *keys_and_args)
        usec = int((await self.info("commandstats"))["cmdstat_fcall"]["usec"])
        op = str(keys_and_args[1])
        if op in ("submit", "finish"):  # told apart: did it dispatch?
            op += " +grant" if reply[0] == 1 and reply[1] else " alone"
        self.spent[op].append(usec - self.usec)
        self.usec = usec
        return reply


async def per_op(port: int, pool: str, window: int, requests: int, seed: int) -> Measure:
    """µs per call of each operation, the commandstats read after each call."""
    redis = Timed(host="127.0.0.1", port=port)
    try:
        stream = Stream(redis, pool, window, seed)
        await stream.start()
        await stream.run(requests // 10)
        redis.spent.clear()
        await stream.run(requests)
        await stream.drain()
    finally:
        await redis.aclose()
    return Measure(
        per_op={op: sum(us) / len(us) for op, us in redis.spent.items()},
        calls_per_op={op: len(us) for op, us in redis.spent.items()},
    )


async def bench(
    port: int, requests: int, rounds: int, libraries: dict[str, Library]
) -> dict[str, list[Measure]]:
    """Each round runs every library on every scenario in turn, on pools of their own."""
    redis = Redis(host="127.0.0.1", port=port)
    results: dict[str, list[Measure]] = defaultdict(list)
    try:
        for r in range(rounds):
            for label, library in libraries.items():
                redis_dispatch.DISPATCH = library  # its calls
                for name, window in SCENARIOS.items():
                    row = f"{label} {name}".strip()
                    pool = f"{label}-{name}-{r}"
                    total = await totals(redis, pool + "-t", window, requests, seed=r)
                    if window is not None:  # a batch's operations are not timed one by one
                        ops = await per_op(port, pool + "-o", window, requests // 4, seed=r)
                        total.per_op, total.calls_per_op = ops.per_op, ops.calls_per_op
                    results[row].append(total)
                    report_round(row, r, total)
    finally:
        await redis.aclose()
    return results


def report_round(name: str, r: int, m: Measure) -> None:
    ops = "  ".join(f"{op} {us:.1f}" for op, us in sorted(m.per_op.items()))
    print(
        f"round {r + 1} {name:>19}: redis CPU {m.cpu_us_per_request:6.1f} µs/request, "
        f"FCALL {m.fcall_us:6.1f} µs/call ({m.fcalls_per_request:.2f}/request, "
        f"{m.inner_per_request:.1f} redis.calls/request); "
        f"µs/call: {ops}",
        flush=True,
    )


def report(results: dict[str, list[Measure]]) -> None:
    print("\nmedians over the rounds (µs inside Redis)")
    for name, measures in results.items():
        ops = sorted({op for m in measures for op in m.per_op})
        cells = [
            f"{op} {statistics.median(m.per_op.get(op, 0.0) for m in measures):.1f}"
            f" (x{statistics.median(m.calls_per_op.get(op, 0) for m in measures):.0f})"
            for op in ops
        ]
        cpu = statistics.median(m.cpu_us_per_request for m in measures)
        fcall = statistics.median(m.fcall_us for m in measures)
        inner = statistics.median(m.inner_per_request for m in measures)
        print(
            f"{name:>19}: CPU/request {cpu:.1f}, FCALL {fcall:.1f}/call, "
            f"{inner:.1f} redis.calls/request; " + ", ".join(cells)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="per scenario and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--baseline",
        type=Path,
        nargs="+",
        help="another version's library, run round by round beside the package's (a busy "
        "machine slows both alike): its files in order, from `git show REV:sfq_proxy/state/F "
        "> F`, admission.lua then dispatch.lua (dispatch.lua alone before they were one)",
    )
    args = parser.parse_args()
    libraries = {"": DISPATCH}
    if args.baseline is not None:  # an absolute path: Library reads it, not the package's
        libraries = {
            "new": DISPATCH,
            "baseline": Library(tuple(str(f.resolve()) for f in args.baseline), "sfq_dispatch"),
        }
    with (
        tempfile.TemporaryDirectory(prefix="sfq-bench-redis-") as tmp,
        Processes(Path(tmp)) as procs,
    ):
        port = harness.redis(procs).port
        report(asyncio.run(bench(port, args.requests, args.rounds, libraries)))


if __name__ == "__main__":
    main()
