"""Engine-gated dispatch in the simulator: the core's ``EngineGate`` per backend, fed with
readings of the simulated engine (docs/engine-dispatch-draft.md, for design.md §5).

The rule is the core's, not a copy: each backend has an ``EngineGate`` of the pool's
``GatePolicy`` (``PoolModel.gate_policy``), told of every dispatch and completion and of
every reading, and asked before a request goes to the backend, with the ceiling of the
request's class. What the lab adds is the I/O the proxy's scrape loop does: a reading of
the engine (``reading_of``) every ``interval_s`` of virtual time, answered
``scrape_delay_s`` after it was asked (the simulator's events).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config import BackendSpec
from ..core.engine_gate import EngineGate, GatePolicy
from ..core.engine_metrics import EngineReading
from ..core.placement import Backend, Placement, Reason
from ..core.queues import DispatchQueue
from ..core.scheduler import Ticket
from ..sim.engine import EngineScheduler

__all__ = ["GatedPlacement", "reading_of"]


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


class GatedPlacement(Placement):
    """``Placement`` whose backends count as full while their engine gate does not admit
    the request being placed: the proxy's rule with ``dispatch.mode: engine``.

    The scheduler asks ``place`` for the head of its queue (the lab has no strict band), so
    that head's class gives the ceiling. The caller sets ``now`` before each call into the
    scheduler: placement is told no time, the gates need one."""

    def __init__(
        self,
        specs: list[BackendSpec],
        policy: GatePolicy,
        queue: DispatchQueue[Ticket],
        ceilings: Mapping[str, float],
    ) -> None:
        super().__init__(specs)
        self.gates = {b.name: EngineGate(policy) for b in self.backends}
        self.queue = queue
        self.ceilings = ceilings  # class → engine_ceiling
        self.now = 0.0

    def place(self, key: str | None = None) -> tuple[Backend, Reason] | None:
        """Placement's own rule (least loaded, affinity) over the backends whose gates admit
        one more of the head's class now: the others are out of the list for this call."""
        head = self.queue.peek()
        ceiling = 1.0 if head is None else self.ceilings.get(head[1].cls, 1.0)
        every = self.backends
        self.backends = [b for b in every if self.gates[b.name].admit(self.now, ceiling).admit]
        try:
            return super().place(key)
        finally:
            self.backends = every

    def acquire(self, backend: Backend) -> None:
        super().acquire(backend)
        self.gates[backend.name].dispatched(self.now)

    def release(self, backend: Backend) -> None:
        super().release(backend)
        self.gates[backend.name].completed(self.now)

    def observe(self, readings: Mapping[str, EngineReading], requested_at: float) -> None:
        """The answers to the scrapes asked at ``requested_at``, arriving ``now``."""
        for name, reading in readings.items():
            self.gates[name].observe(reading, requested_at, self.now)
