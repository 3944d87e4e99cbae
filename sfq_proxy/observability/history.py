"""What the admin page draws over time (docs/admin-page.md, Over time): per pool, a sample a
second of who was served against what they were entitled to, the queue, the waits in it,
and the backends' load and health.

Kept by the proxy, not by the page, so that a page opened late (or reloaded) shows the
past too; in two series of bounded size whatever the uptime: the last ``RECENT_POINTS``
seconds at a point a second, and the whole time since start in at most ``LONG_POINTS``
points, each pair of neighbours merged into one when the series is full (the points then
cover twice the time). Every field of a point is a sum or a maximum, so two merge exactly;
the wait's quantiles come from counts in log-spaced buckets, which merge too, to within a
bucket (19 %).

A sample is taken on a timer (``sample_forever``), never per request: it reads what the
pool keeps anyway, its last dispatches (each with the time it waited), its flows' backlogs
and its backends, so the requests' path pays nothing for it. A second with more dispatches
than the pool keeps (``RECENT_DISPATCHES``) is sampled from its last ones. With the shared
state, the dispatches, the queue and the slots in use are this process's; the flows'
backlogs are the whole pool's, as Redis held them at the last heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from ..config import Config
from ..core.flows import org_and_class
from ..state.pool import Pool

log = logging.getLogger(__name__)
SAMPLE_S = 1.0  # one sample a second
FAILURE_LOG_S = 60.0  # a pool whose samples keep failing: a log line at most this often
RECENT_POINTS = 300  # the last five minutes, a point a second
LONG_POINTS = 240  # since start: at most this many points, each covering 2^k samples
MAX_FLOWS = 12  # flows drawn per point; the others are summed as OTHER
SERIES = ("recent", "since_start")  # what /admin/history may be asked for
OTHER = "(other)"  # no flow is named so: a flow's name is org/class
WAIT_FLOOR_S = 0.001  # waits below this share the first bucket
BUCKETS_PER_DOUBLING = 4  # a bucket's upper edge is 2^(1/4) = 1.19 times its lower one


Load = tuple[int, int, int, int]  # a backend's samples, and its in-flight, slots, healthy


@dataclass(slots=True)
class Point:
    """A span of samples of one pool: ``end`` (Unix time) and ``span_s`` before it."""

    end: float
    span_s: float
    samples: int = 1
    # the cost dispatched per fair-queued flow, and what each was entitled to of it
    # (``entitlement``): the same total, split otherwise
    served: dict[str, float] = field(default_factory=dict)
    entitled: dict[str, float] = field(default_factory=dict)
    queued: int = 0  # the most requests waiting at one of its samples
    waits: Counter[int] = field(default_factory=Counter)  # dispatches per wait bucket
    # per backend, sums over the samples it was in: (samples, in flight, slots, healthy)
    backends: dict[str, Load] = field(default_factory=dict)

    def merged(self, later: Point) -> Point:
        """This point and the one right after it, as one."""
        backends = dict(self.backends)
        for name, (n, running, slots, healthy) in later.backends.items():
            was = backends.get(name, (0, 0, 0, 0))
            backends[name] = (was[0] + n, was[1] + running, was[2] + slots, was[3] + healthy)
        served, entitled = _capped(
            _add(self.served, later.served), _add(self.entitled, later.entitled)
        )
        return Point(
            later.end, self.span_s + later.span_s, self.samples + later.samples, served,
            entitled, max(self.queued, later.queued), self.waits + later.waits, backends,
        )  # fmt: skip

    def view(self) -> dict[str, Any]:
        """The point in ``/admin/history``: costs (the page sums them over any window it
        draws), the wait's quantiles, and the backends' means over the samples."""
        return {
            "end": round(self.end, 3),
            "span_s": round(self.span_s, 3),
            "served": _rounded(self.served),
            "entitled": _rounded(self.entitled),
            "queued": self.queued,
            "dispatches": self.waits.total(),
            "wait_p50_s": wait_quantile(self.waits, 0.5),
            "wait_p99_s": wait_quantile(self.waits, 0.99),
            "backends": {
                name: {
                    "in_flight": round(running / n, 3),
                    "slots": round(slots / n, 3),
                    "healthy": round(healthy / n, 3),
                }
                for name, (n, running, slots, healthy) in self.backends.items()
            },
        }


class PoolHistory:
    """One pool's samples: ``recent`` and the since-start series, both bounded."""

    def __init__(self) -> None:
        self.recent: deque[Point] = deque(maxlen=RECENT_POINTS)
        self.long: list[Point] = []
        self._filling: Point | None = None  # the since-start series' newest, still filling
        self._width = 1  # samples per point of the since-start series
        self._last: float | None = None  # the pool's clock at the last sample
        self._backlogged: set[str] = set()  # the flows waiting at the last sample

    def sample(self, pool: Pool, now: float, wall: float) -> None:
        """Take the sample of the time since the last one (``now``: the pool's clock)."""
        last = now - SAMPLE_S if self._last is None else self._last
        self._last = now
        fresh = list(takewhile(lambda d: d.at > last, reversed(pool.recent)))
        dispatched: dict[str, float] = {}
        for dispatch in fresh:
            dispatched[dispatch.flow] = dispatched.get(dispatch.flow, 0.0) + dispatch.cost
        config = pool.config
        served = {f: cost for f, cost in dispatched.items() if fair_weight(config, f) is not None}
        backlogged = {view.flow for view in pool.flow_views() if view.backlog}
        waiting = {  # the flows backlogged at the interval's start or end, by weight
            flow: weight
            for flow in self._backlogged | backlogged
            if (weight := fair_weight(config, flow)) is not None
        }
        self._backlogged = backlogged
        self.add(
            Point(
                end=wall,
                span_s=now - last,
                served=served,
                entitled=entitlement(served, waiting),
                queued=pool.queued(),
                waits=Counter(wait_bucket(dispatch.waited) for dispatch in fresh),
                backends={
                    b.name: (1, b.in_flight, b.slots, int(b.healthy))
                    for b in pool.placement.backends
                },
            )
        )

    def add(self, point: Point) -> None:
        """A sample's point, to both series (its flows capped at ``MAX_FLOWS``)."""
        point.served, point.entitled = _capped(point.served, point.entitled)
        self.recent.append(point)
        filling = point if self._filling is None else self._filling.merged(point)
        if filling.samples < self._width:
            self._filling = filling
            return
        self._filling = None
        self.long.append(filling)
        if len(self.long) == LONG_POINTS:  # full: neighbours merge, points twice as wide
            self.long = [a.merged(b) for a, b in zip(self.long[::2], self.long[1::2], strict=True)]
            self._width *= 2

    def view(self, series: Iterable[str] = SERIES) -> dict[str, Any]:
        """The pool in ``/admin/history``: the ``series`` asked for (of ``SERIES``), oldest
        point first in each."""
        points = {
            "recent": list(self.recent),
            "since_start": [*self.long, *([self._filling] if self._filling else [])],
        }
        views = {name: [point.view() for point in points[name]] for name in series}
        return {"sample_s": SAMPLE_S, **views}


async def sample_forever(
    pools: Mapping[str, Pool], histories: Mapping[str, PoolHistory], wall: Callable[[], float]
) -> None:
    """Every ``SAMPLE_S``, a sample of each pool (on its own clock, so that a late wake
    makes a longer point, not a wrong one). A sample that fails (a bug) costs that pool
    its second's point, not its charts for the rest of the process: it is logged (see
    ``_Failing``) and sampling goes on."""
    failing: dict[str, _Failing] = {}
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(SAMPLE_S)
        for name, pool in pools.items():
            try:
                histories[name].sample(pool, pool.clock(), wall())
            except Exception:
                failing.setdefault(name, _Failing()).failed(name, loop.time())


@dataclass(slots=True)
class _Failing:
    """A pool's failed samples: the first is logged with its traceback, and then at most a
    line every ``FAILURE_LOG_S`` with how many failed since the last, so that a failure
    each second does not fill the log."""

    logged_at: float = -math.inf
    unlogged: int = 0

    def failed(self, pool: str, now: float) -> None:
        """Called in the ``except`` of the failed sample (its traceback goes with the line)."""
        self.unlogged += 1
        if now - self.logged_at < FAILURE_LOG_S:
            return
        log.exception(
            "pool %s: the admin page's history could not be sampled (%d failed since the "
            "last such line); sampling goes on", pool, self.unlogged,
        )  # fmt: skip
        self.logged_at, self.unlogged = now, 0


def fair_weight(config: Config, flow: str) -> float | None:
    """The flow's weight, if the fair queue orders it: None for the strict priority band
    (never charged, entitled to nothing) and for a class a reload removed."""
    org, cls = org_and_class(flow)
    spec = config.classes.get(cls)
    return None if spec is None or spec.priority else config.flow_weight(org, cls)


def entitlement(served: Mapping[str, float], waiting: Mapping[str, float]) -> dict[str, float]:
    """What each flow was entitled to of what was ``served`` in an interval. SFQ's guarantee
    is among the flows that wait (design.md §3): those of ``waiting`` (by their weights;
    backlogged at the interval's start or end) are entitled to what they were served
    together, split by weight, so a flow served less than its part was short of its share.
    A flow that did not wait had all it asked for: it is entitled to what it had."""
    together = sum(served.get(flow, 0.0) for flow in waiting)
    whole = sum(waiting.values())
    entitled = {flow: cost for flow, cost in served.items() if flow not in waiting}
    entitled.update({flow: together * weight / whole for flow, weight in waiting.items()})
    return entitled


def wait_bucket(seconds: float) -> int:
    """The bucket of a wait: 0 up to ``WAIT_FLOOR_S``, then one per 2^(1/4)."""
    if seconds <= WAIT_FLOOR_S:
        return 0
    return math.ceil(math.log2(seconds / WAIT_FLOOR_S) * BUCKETS_PER_DOUBLING)


def wait_quantile(waits: Counter[int], q: float) -> float | None:
    """The ``q`` quantile of the waits counted (nearest rank), as its bucket's upper edge:
    at most 19 % above the true value, never below it. None when nothing was dispatched."""
    rank = math.ceil(q * waits.total())
    seen = 0
    for bucket in sorted(waits):
        seen += waits[bucket]
        if seen >= rank > 0:
            return round(WAIT_FLOOR_S * 2 ** (bucket / BUCKETS_PER_DOUBLING), 6)
    return None


def _capped(
    served: dict[str, float], entitled: dict[str, float]
) -> tuple[dict[str, float], dict[str, float]]:
    """At most ``MAX_FLOWS`` flows, the largest (by served and entitled); the others' sums
    as ``OTHER``, so that a point's size is bounded however many orgs call."""
    flows = set(served) | set(entitled)
    if len(flows) <= MAX_FLOWS:
        return served, entitled
    size = {flow: served.get(flow, 0.0) + entitled.get(flow, 0.0) for flow in flows}
    kept = set(sorted(flows, key=lambda f: (-size[f], f))[: MAX_FLOWS - 1])
    return _lumped(served, kept), _lumped(entitled, kept)


def _lumped(costs: dict[str, float], kept: set[str]) -> dict[str, float]:
    out = {flow: cost for flow, cost in costs.items() if flow in kept}
    other = sum(cost for flow, cost in costs.items() if flow not in kept)
    return {**out, OTHER: other} if other else out


def _add(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    out = dict(a)
    for flow, cost in b.items():
        out[flow] = out.get(flow, 0.0) + cost
    return out


def _rounded(costs: Mapping[str, float]) -> dict[str, float]:
    return {flow: round(cost, 4) for flow, cost in sorted(costs.items())}
