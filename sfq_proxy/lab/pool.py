"""A scenario's ``pool`` section: its backends, the proxy's slots and dispatch, the engine.

Apart from ``scenario.py`` (the teams, classes and requests) because the pool is what the
lab compares settings of: the proxy's static ``slots`` against engine-gated dispatch
(``dispatch: {mode: engine, …}``, docs/design.md §5, Engine-aware dispatch), on the same
engine (``sim/engine.py``: its batch ``max_num_seqs``, KV cache, scheduling policy). The
``dispatch`` section has the names and bounds of the proxy's ``pools.<p>.dispatch`` and
becomes the core's own ``GatePolicy``, so the simulator's gate is the proxy's gate; only
``scrape_delay_s`` is the lab's (how long a reading takes to come back). The proxy's
``timeout_s``, ``max_bytes`` and ``metrics_path`` have no meaning here: a simulated scrape
always answers, with a reading, ``scrape_delay_s`` after it was asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from ..config import NonNegativeFloat, PositiveFloat, PositiveInt, StrictModel, WeightedCost
from ..core.engine_gate import GatePolicy, policy_of
from ..sim.engine import EngineModel, SchedulingPolicy

__all__ = ["Dispatch", "DispatchMode", "PoolModel", "PoolSection", "Slots", "check_pool"]

DispatchMode = Literal["static", "engine"]


def _slots(value: Any) -> Any:
    """A positive integer or ``auto``, told in one message rather than as a union's two."""
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected an integer, or auto")
    if value <= 0:
        raise ValueError("must be > 0")
    return value


# the proxy's slots per backend, or ``auto`` (engine dispatch only): as many as the
# engine's readings allow
Slots = Annotated[int | Literal["auto"], BeforeValidator(_slots)]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """How the proxy decides that a backend may take one more request: ``static`` while it
    has a free slot; ``engine`` while the engine's readings, taken every ``interval_s``, say
    it would run it at once or hold at most ``allowance`` waiting (the rest as in
    ``GatePolicy``). ``scrape_delay_s``: a reading arrives this long after it was asked,
    describing the engine when it was asked."""

    mode: DispatchMode = "static"
    interval_s: float = 0.5
    max_age_s: float = 2.0
    allowance: int = 1
    kv_ceiling: float | None = 0.95
    settle_s: float = 0.05
    fallback_slots: int = 1
    scrape_delay_s: float = 0.05

    @property
    def engine(self) -> bool:
        return self.mode == "engine"


@dataclass(frozen=True, slots=True)
class PoolModel:
    """``backends`` identical backends, to each of which the proxy sends at most ``slots``
    requests at once (``auto``: as many as its engine gate allows), and the pool's cost
    model (docs/design.md §4): ``input_weight × input + output_weight × output``. Each
    backend's ``engine`` runs ``engine.max_num_seqs`` of them at once (default: ``slots``,
    the proxy's slots and the engine's batch alike) within its ``engine.kv_cache_tokens``
    of KV cache; the rest wait in the engine's queue. ``dispatch`` and ``capacity`` (the
    engine's batch as the operator tells the gate) are the proxy's engine dispatch."""

    backends: int
    slots: int | Literal["auto"]
    engine: EngineModel
    input_weight: float = 1.0
    output_weight: float = 1.0
    output_ratio: float = 1.0  # the proxy's cost.output_ratio: where calibration starts
    dispatch: Dispatch = field(default_factory=Dispatch)
    capacity: int | None = None

    @property
    def max_num_seqs(self) -> int:
        """What each engine runs at once: its own ``max_num_seqs``, else the proxy's slots
        (``check_pool`` requires the former with ``slots: auto``)."""
        if self.engine.max_num_seqs is not None:
            return self.engine.max_num_seqs
        assert isinstance(self.slots, int)
        return self.slots

    def gate_policy(self) -> GatePolicy:
        """Each backend's engine gate, as the proxy builds it from the same settings."""
        return policy_of(self.dispatch, self.slots, self.capacity)


# --------------------------------------------------------------------------- the YAML


class EngineSpec(StrictModel):
    """Each backend's engine: its speeds, and its scheduler (``sim/engine.py``): at most
    ``max_num_seqs`` sequences at once (default: the pool's ``slots``), ``kv_cache_tokens``
    of KV cache (default: unlimited), its queue FCFS or by priority."""

    prefill_tokens_per_s: PositiveFloat
    decode_tokens_per_s: PositiveFloat
    batch_slowdown: NonNegativeFloat = 0.0
    max_num_seqs: PositiveInt | None = None
    kv_cache_tokens: PositiveInt | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"


class DispatchSpec(StrictModel):
    """The pool's ``dispatch`` section: the proxy's names and bounds, and the lab's
    ``scrape_delay_s``."""

    mode: DispatchMode = "static"
    interval_s: float = Field(0.5, ge=0.05, le=60, allow_inf_nan=False)
    max_age_s: float = Field(2.0, gt=0, le=31_536_000, allow_inf_nan=False)
    allowance: int = Field(1, ge=1, le=1000)
    kv_ceiling: float | None = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    settle_s: float = Field(0.05, ge=0, le=10, allow_inf_nan=False)
    fallback_slots: PositiveInt = 1
    scrape_delay_s: float = Field(0.05, ge=0, le=3600, allow_inf_nan=False)


class PoolSection(StrictModel):
    backends: PositiveInt
    slots: Slots
    capacity: PositiveInt | None = None
    dispatch: DispatchSpec = DispatchSpec()
    engine: EngineSpec
    cost: WeightedCost = WeightedCost()  # the proxy's own weights and bounds

    def model(self) -> PoolModel:
        cost = self.cost
        return PoolModel(
            self.backends, self.slots, EngineModel(**self.engine.model_dump()),
            cost.input_weight, cost.output_weight, cost.output_ratio,
            Dispatch(**self.dispatch.model_dump()), self.capacity,
        )  # fmt: skip


_ENGINE_ONLY = "only with dispatch.mode: engine (its engine's readings decide)"


def check_pool(pool: PoolSection) -> list[tuple[str, str]]:
    """What the proxy's config checks of a pool's dispatch (a reading is stale only after
    one lost scrape at least; ``slots: auto`` and ``capacity`` mean nothing without engine
    dispatch), and the lab's own: with ``slots: auto`` the engine's batch must be said."""
    errors = []
    dispatch = pool.dispatch
    if dispatch.max_age_s <= dispatch.interval_s:
        errors.append(("pool.dispatch.max_age_s", "must be above interval_s"))
    if dispatch.mode != "engine":
        if pool.slots == "auto":
            errors.append(("pool.slots", f"auto {_ENGINE_ONLY}; else a number"))
        if pool.capacity is not None:
            errors.append(("pool.capacity", _ENGINE_ONLY))
    if pool.slots == "auto" and pool.engine.max_num_seqs is None:
        errors.append((
            "pool.engine.max_num_seqs",
            "required with slots: auto (the proxy's slots cannot stand for the engine's batch)",
        ))  # fmt: skip
    return errors
