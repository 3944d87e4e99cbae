"""Engine-gated dispatch in the simulator: the core's ``EngineGate`` per backend, fed with
readings of the simulated engine (docs/design.md §5, Engine-aware dispatch).

The rule and its wiring are the proxy's, not a copy: each backend of the core's
``Placement`` gets an ``EngineGate`` of the pool's ``GatePolicy`` (``PoolModel.gate_policy``),
and the core's ``Scheduler`` asks it with each request's class ceiling and tells it of every
dispatch and completion. What the lab adds is the I/O the proxy's scrape loop does: a
reading of the engine (``reading_of``) every ``interval_s`` of virtual time, answered
``scrape_delay_s`` after it was asked (the simulator's events).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.engine_gate import GatePolicy
from ..core.engine_metrics import EngineReading
from ..core.placement import Placement, gated_slots, set_gate
from ..sim.engine import EngineScheduler

__all__ = ["equip", "observe", "reading_of"]


def reading_of(engine: EngineScheduler) -> EngineReading:
    """What a vLLM's ``/metrics`` say of ``engine``, as the simulated server's gauges do
    (``sim/server.py``): sequences running, sequences waiting (all of them for capacity),
    the KV cache's use and size; no KV use for a cache that never runs out (the gate then
    does not check it), and no capacity (vLLM has no metric for ``--max-num-seqs``: the gate
    learns it)."""
    limited = engine.kv_cache_tokens is not None
    return EngineReading(
        running=engine.running_places,
        waiting=engine.waiting_places,
        waiting_for_capacity=engine.waiting_places,
        kv_usage=engine.kv_usage if limited else None,
        kv_tokens=engine.kv_cache_tokens,
    )


def equip(placement: Placement, policy: GatePolicy) -> None:
    """Give each backend an engine gate of ``policy``, as the proxy's pool does in engine
    mode (``core/placement.py``'s ``set_gate``): the scheduler then asks them with each
    request's class ceiling and tells them of every dispatch and completion."""
    for backend in placement.backends:
        set_gate(backend, policy, 0.0)


def observe(
    placement: Placement, readings: Mapping[str, EngineReading], requested_at: float, now: float
) -> None:
    """The answers to the scrapes asked at ``requested_at``, arriving ``now``: each gate
    hears its engine's, and a backend with ``slots: auto`` counts the slots it now allows,
    as the proxy's scrape loop does (``state/engine_scrape.py``)."""
    for backend in placement.backends:
        reading = readings.get(backend.name)
        if reading is not None and backend.gate is not None:
            backend.gate.observe(reading, requested_at, now)
            gated_slots(backend)
