"""Engine dispatch's test helpers (docs/design.md §5, "Engine-aware dispatch"): a pool of
simulated vLLM servers in engine mode, and the engine's load sampled as the proxy reads it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from proxy_lab import Lab, proxy_config

from sfq_proxy.core.engine_metrics import parse
from sfq_proxy.sim.server import SimBackend

# a reading every 0.1 s, stale after 0.5 s; settle_s well below the interval, else every
# completion would fall in the settle window after some reading and wait for the next one
FAST = {"interval_s": 0.1, "timeout_s": 0.2, "max_age_s": 0.5, "settle_s": 0.03}


def engine_config(urls: list[str], slots: int | str, **options: Any) -> Any:
    """One pool ``sim`` of ``urls`` with ``slots`` each; ``dispatch`` (None: static) and the
    other pool settings in ``options``; ``classes`` and ``state`` replace those sections;
    ``capacity`` is each backend's."""
    dispatch, capacity = options.pop("dispatch", None), options.pop("capacity", None)
    overrides = {k: options.pop(k) for k in ("classes", "state") if options.get(k) is not None}
    pool: dict[str, Any] = {**options}
    if dispatch is not None:
        pool["dispatch"] = {"mode": "engine", **FAST, **dispatch}
    known = {} if capacity is None else {"capacity": capacity}
    backends = [{"url": url, "slots": slots, **known} for url in urls]
    return proxy_config(urls, pool={**pool, "backends": backends}, **overrides)


@contextlib.asynccontextmanager
async def sampled(lab: Lab, sim: SimBackend) -> AsyncIterator[list[tuple[int, int]]]:
    """The engine's (running, waiting) every 5 ms until the block ends: from its
    ``/metrics``, or while a fault breaks them, from the same counts in the simulator."""
    http = await lab.http()
    samples: list[tuple[int, int]] = []

    async def sample() -> None:
        while True:
            if sim.faults.metrics_status != 200 or sim.faults.metrics_delay_s:
                samples.append((sim.stats.running, sim.stats.waiting))
            else:
                async with http.get(f"{sim.url}/metrics") as r:
                    reading = parse(sim.config.metrics_format, await r.read())
                assert reading.running is not None
                assert reading.waiting is not None
                samples.append((reading.running, reading.waiting))
            await asyncio.sleep(0.005)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
