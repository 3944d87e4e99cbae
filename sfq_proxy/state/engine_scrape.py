"""Engine dispatch's I/O (docs/design.md §5, "Engine-aware dispatch"): each backend's own
``/metrics`` read every ``interval_s``, its gate told, the pool's dispatch tried again.

The decisions are the core's (``core/engine_gate.py``, ``core/engine_metrics.py``); this
module only fetches, times and hands over. A failed scrape (a timeout, a refused
connection, a 404 or a 5xx, a body over ``max_bytes``) is a reading without numbers: the
gate's last one ages until it is stale and the backend falls back to static slots.
Dispatch never waits for a scrape, nor stops because one failed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

import aiohttp

from ..config import Config, DispatchSpec, PoolSpec
from ..core.engine_gate import policy_of
from ..core.engine_metrics import (
    DISCOVERY_PATHS,
    NOTHING_DISCOVERED,
    Discovery,
    EngineReading,
    Problem,
    parse,
    parse_discovery,
    unavailable,
)
from ..core.placement import Backend, Placement, gated_slots, set_gate
from ..core.scheduler import Scheduler


class Pool(Protocol):
    """What of a pool (``pool.py``) the scrapes use: named here, since that module imports
    this one."""

    name: str
    spec: PoolSpec
    config: Config
    clock: Callable[[], float]
    placement: Placement
    scheduler: Scheduler
    upstream_key: str | None
    ended: asyncio.Event  # set when one of its requests ends

    def after_reading(self) -> None: ...


log = logging.getLogger(__name__)

CHUNK = 65536
# how long what an engine said of itself stands (a restarted engine may have other slots),
# and how soon a read that failed is tried again (a server still starting)
DISCOVERY_REFRESH_S = 60.0
DISCOVERY_RETRY_S = 5.0
# an identity body: the relay's session does not decompress, and the bound is on the bytes
HEADERS = {"Accept-Encoding": "identity"}


def equip(pool: Pool) -> None:
    """Gates for the pool's backends, and its scheduler's class ceilings, as its config says
    (at start and on a reload; what a gate learned stays). Static dispatch takes them away:
    the scheduler then asks no gate."""
    spec, now = pool.spec, pool.clock()
    for backend, backend_spec in zip(pool.placement.backends, spec.backends, strict=True):
        policy = None
        if spec.engine:
            policy = policy_of(spec.dispatch, backend_spec.slots, backend_spec.capacity)
        set_gate(backend, policy, now)
    classes = pool.config.classes
    ceilings = {name: c.engine_ceiling for name, c in classes.items()}
    pool.scheduler.ceilings = ceilings if spec.engine else None


async def scrape_forever(pool: Pool, session: aiohttp.ClientSession) -> None:
    """Start a scrape of every gated, healthy backend each ``interval_s``, and ``settle_s``
    after a request of the pool ends, unless its last one still runs (a hanging backend
    delays no other). A pool in static dispatch keeps the loop, so that a reload may turn
    engine dispatch on.

    Why at an end: the engine drops a finished request from its gauges before the proxy
    hears the end, and the gate credits such ends only with a reading that shows them (the
    credit's ghosts, core/engine_gate.py); read at the interval alone, every wave of
    requests ending together left the engine short until the next reading (on a real vLLM,
    engine dispatch ran at 0.79 of static slots set to the engine's batch). ``settle_s``
    lets the rest of a wave end first, and bounds the readings to one per ``settle_s``."""
    running: dict[Backend, asyncio.Task[None]] = {}
    discovered: dict[Backend, tuple[float, Discovery]] = {}
    try:
        while True:
            running = {b: task for b, task in running.items() if not task.done()}
            discovered = {b: d for b, d in discovered.items() if b in pool.placement.backends}
            for backend in pool.placement.backends:
                if backend.gate is not None and backend.healthy and backend not in running:
                    reading = scrape(pool, session, backend, discovered)
                    running[backend] = asyncio.create_task(reading)
            dispatch = pool.spec.dispatch
            try:
                async with asyncio.timeout(dispatch.interval_s):
                    await pool.ended.wait()
            except TimeoutError:
                continue
            pool.ended.clear()
            await asyncio.sleep(dispatch.settle_s)
    finally:
        for task in running.values():
            task.cancel()


async def scrape(
    pool: Pool,
    session: aiohttp.ClientSession,
    backend: Backend,
    discovered: dict[Backend, tuple[float, Discovery]],
) -> None:
    """One reading of ``backend``'s engine, handed to its gate with the time read *before*
    sending (what the reading may have missed is counted from then); then the pool hears
    of it, as a reading may open the gate (or a failure turn it stale). Before, what its
    engine says of itself (``discover``)."""
    dispatch, family = pool.spec.dispatch, pool.spec.family
    headers = dict(HEADERS)
    if pool.upstream_key:
        headers["Authorization"] = f"Bearer {pool.upstream_key}"
    requested_at = pool.clock()
    try:
        discovery = await discover(pool, session, backend, discovered, headers)
        requested_at = pool.clock()
        reading = await read_metrics(
            session, backend.base + dispatch.metrics_path, family, dispatch, headers, discovery
        )
    except Exception:  # a bug must not end the loop: the backend's readings age instead
        log.exception("pool %s: reading backend %s's metrics failed", pool.name, backend.name)
        reading = unavailable("no_metrics")
    gate = backend.gate
    if gate is None:  # a reload turned engine dispatch off meanwhile
        return
    was = gate.problem
    gate.observe(reading, requested_at, pool.clock())
    if gate.problem != was and (gate.problem is None or was is None):
        log.warning(
            "pool %s: backend %s's engine metrics %s", pool.name, backend.name,
            "are read again" if gate.problem is None else f"unusable ({gate.problem})",
        )  # fmt: skip
    gated_slots(backend)
    pool.after_reading()


async def discover(
    pool: Pool,
    session: aiohttp.ClientSession,
    backend: Backend,
    discovered: dict[Backend, tuple[float, Discovery]],
    headers: dict[str, str],
) -> Discovery:
    """What ``backend``'s engine says of itself, where its family does (``DISCOVERY_PATHS``):
    read again ``DISCOVERY_REFRESH_S`` after it was read, ``DISCOVERY_RETRY_S`` after a read
    failed (a server still starting), and until then what ``discovered`` holds (a failed
    read keeps what was read before)."""
    family = pool.spec.family
    path = DISCOVERY_PATHS.get(family)
    if path is None:
        return NOTHING_DISCOVERED
    due, discovery = discovered.get(backend, (-math.inf, NOTHING_DISCOVERED))
    if pool.clock() < due:
        return discovery
    dispatch = pool.spec.dispatch
    found = await read_discovery(session, backend.base + path, family, dispatch, headers)
    again = DISCOVERY_RETRY_S if found is None else DISCOVERY_REFRESH_S
    discovery = discovery if found is None else found
    discovered[backend] = (pool.clock() + again, discovery)
    return discovery


class Unread(Exception):
    """A GET that gave no body to parse, and why (``Problem``)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem)
        self.problem = problem


async def fetch(
    session: aiohttp.ClientSession, url: str, dispatch: DispatchSpec, headers: dict[str, str]
) -> bytes:
    """GET ``url`` within ``timeout_s``, at most ``max_bytes`` of it read; ``Unread`` on a
    failure, a status other than 200, or a longer body."""
    limit = aiohttp.ClientTimeout(total=dispatch.timeout_s)
    body = bytearray()
    try:
        async with session.get(url, headers=headers, timeout=limit) as answer:
            if answer.status != 200:
                raise Unread("no_metrics")
            if (answer.content_length or 0) > dispatch.max_bytes:
                raise Unread("too_large")
            async for chunk in answer.content.iter_chunked(CHUNK):
                body += chunk
                if len(body) > dispatch.max_bytes:
                    raise Unread("too_large")
    except (aiohttp.ClientError, TimeoutError):
        raise Unread("no_metrics") from None
    return bytes(body)


async def read_metrics(
    session: aiohttp.ClientSession,
    url: str,
    family: str,
    dispatch: DispatchSpec,
    headers: dict[str, str],
    discovery: Discovery = NOTHING_DISCOVERED,
) -> EngineReading:
    """``url``'s metrics parsed as ``family``'s, with what its ``discovery`` said; any
    failure is a reading without numbers."""
    try:
        body = await fetch(session, url, dispatch, headers)
    except Unread as unread:
        return unavailable(unread.problem)
    return parse(family, body, max_bytes=dispatch.max_bytes, discovery=discovery)


async def read_discovery(
    session: aiohttp.ClientSession,
    url: str,
    family: str,
    dispatch: DispatchSpec,
    headers: dict[str, str],
) -> Discovery | None:
    """What the engine at ``url`` says of itself (nothing usable: ``NOTHING_DISCOVERED``);
    None when it did not answer."""
    try:
        return parse_discovery(family, await fetch(session, url, dispatch, headers))
    except Unread:
        return None


def engine_state(backend: Backend, now: float) -> dict[str, Any] | None:
    """A backend's engine in ``/admin/state``: its last usable reading and how old it is,
    why the last scrape gave none (if so), the gate's capacity and its estimate now, and
    the dispatches it refused; None in static dispatch."""
    gate = backend.gate
    if gate is None:
        return None
    reading, estimate = gate.reading, gate.estimate(now)
    return {
        "reading": None if reading is None else {
            "running": reading.running, "waiting": reading.waiting,
            "waiting_for_capacity": reading.waiting_for_capacity,
            "kv_usage": reading.kv_usage, "capacity": reading.capacity,
        },
        "age_s": None if reading is None else now - gate.requested_at,
        "fresh": gate.fresh(now),
        "problem": gate.problem,
        "capacity": gate.capacity(),
        "estimate": None if estimate is None else {
            "running": estimate.running, "waiting": estimate.waiting, "credit": estimate.credit,
        },
        "refused": dict(backend.refused),
    }  # fmt: skip
