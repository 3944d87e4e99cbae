"""The ``classes:`` section: workload classes, their weights, the strict priority band and
size buckets (docs/design.md §2, §3).

With the checks that read keys and pools too, since they are about classes: only a class
some key grants can run, and the band's caps must leave every pool a slot for the fair
queue. The bounds of ``size_buckets`` and ``max_overtaken``, and :func:`size_bucket` (a
request's bucket under a class's bounds), are defined here and used by the core's fair
queue and scheduler: the config is the lowest layer and needs nothing of the core.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Annotated

from pydantic import AfterValidator, Field

from .errors import Errors
from .fields import PositiveFloat, PositiveInt, RequestTokens, Seconds, StrictModel, Weight
from .keys import KeySpec
from .pools import PoolSpec, pool_slots

DEFAULT_MAX_OVERTAKEN = 100
"""How many times a request of a flow with size buckets may be overtaken by later, smaller
ones when its class does not say. Large enough to let short requests pass the long ones of a
busy flow (which wait while tens of short ones arrive), bounded so a long one waits at most
that many short ones longer (docs/design.md §3, Size buckets inside a flow: why 100)."""
MAX_OVERTAKEN = 1000
MAX_SIZE_BUCKETS = 16
"""At most this many bounds (so this many + 1 buckets) per class."""
ENGINE_PRIORITY_FAMILIES = frozenset({"vllm"})
"""The server families whose engine orders its queue by a request's ``priority`` (vLLM's,
with ``--scheduling-policy priority``): a class's ``engine_priority`` goes to their pools,
and a client's own ``priority`` never does (docs/design.md §5, Engine priority)."""


def size_bucket(cost: float, bounds: Sequence[float]) -> int:
    """The size bucket of a request of ``cost`` under a class's ``size_buckets``: the first
    bucket whose bound (ascending upper bounds, inclusive) it does not exceed; above the last,
    ``len(bounds)``. ``[500, 4000]``: 500 → 0, 501 → 1, 4001 → 2."""
    return bisect_left(bounds, cost)


def _strictly_increasing(bounds: list[float]) -> list[float]:
    if any(b <= a for a, b in pairwise(bounds)):
        raise ValueError("must be strictly increasing")
    return bounds


# size buckets inside a flow (docs/design.md §3): ascending upper bounds of a request's cost,
# finite and positive; and how often one request may be overtaken
SizeBounds = Annotated[
    list[PositiveFloat],
    Field(min_length=1, max_length=MAX_SIZE_BUCKETS),
    AfterValidator(_strictly_increasing),
]
MaxOvertaken = Annotated[int, Field(ge=0, le=MAX_OVERTAKEN)]
# vLLM's bounds of a request's ``priority`` (its pydantic field: the int64 range)
EnginePriority = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class ClassSpec(StrictModel):
    """A workload class. Priority classes bypass SFQ (strict band, FIFO, capped).

    A priority class that some key grants must set ``max_in_flight``, ``max_queue_age_s``
    and ``max_queue_len``, and the band's caps must leave a slot of every pool to the fair
    queue (``Config`` checks it; see :func:`check_priority_band`).
    """

    weight: Weight = 1.0
    priority: bool = False
    max_in_flight: PositiveInt | None = None
    max_queue_age_s: Seconds | None = None
    max_queue_len: PositiveInt | None = None
    max_request_tokens: RequestTokens | None = None  # tighter than the pool's, when set
    # a request's whole life, from admission: queued, then served (504 ``deadline`` before
    # the answer starts, a ``deadline`` error event in a stream); X-Request-Timeout may
    # only shorten it
    max_request_s: Seconds | None = None
    # size buckets inside a flow (docs/design.md §3): upper bounds of a request's cost for
    # buckets 0, 1, …; within a flow a smaller bucket may overtake, each request at most
    # max_overtaken times (Config checks the pair: check_size_buckets); unset: the default
    # (None, so that a config dumped without its None fields loads again)
    size_buckets: SizeBounds | None = None
    max_overtaken: MaxOvertaken | None = None
    # the ``priority`` a vLLM pool's engine is sent for this class's requests (lower is
    # served first, and may preempt running requests of a higher value: docs/design.md §5,
    # Engine priority); unset: none is sent
    engine_priority: EnginePriority | None = None
    # in a pool with engine dispatch (docs/design.md §5): the fraction of an engine's
    # capacity (and of its KV ceiling) past which this class is not sent there, so that the
    # classes above find room at once; below 1 the class never queues in the engine
    engine_ceiling: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)

    def overtaking(self, cost: float) -> tuple[int, int | None]:
        """A request of ``cost``'s size bucket and ``max_overtaken`` in this class, or
        ``(0, None)`` when its flows are FIFOs (no ``size_buckets``)."""
        if self.size_buckets is None or self.priority:
            return 0, None
        return size_bucket(cost, self.size_buckets), self.overtaken_at_most

    @property
    def overtaken_at_most(self) -> int:
        """``max_overtaken``, or its default."""
        return DEFAULT_MAX_OVERTAKEN if self.max_overtaken is None else self.max_overtaken


def default_classes() -> dict[str, ClassSpec]:
    """The classes of docs/design.md §2 with the values of §7, used when ``classes:`` is absent."""
    return {
        "system": ClassSpec(priority=True, max_in_flight=4, max_queue_age_s=5, max_queue_len=100),
        "interactive": ClassSpec(weight=6, max_queue_age_s=45, max_queue_len=1000),
        "batch": ClassSpec(weight=1, max_queue_age_s=7200, max_queue_len=100000),
    }


def check_size_buckets(classes: Mapping[str, ClassSpec]) -> Errors:
    """Size buckets order a fair-queued flow: the band is a FIFO of its own, and a
    ``max_overtaken`` without buckets would say something that never happens."""
    errors: Errors = []
    for name, spec in classes.items():
        if spec.priority and spec.size_buckets is not None:
            errors.append((
                f"classes.{name}.size_buckets",
                "a priority class is served in the strict band, in arrival order: size "
                "buckets order fair-queued classes only",
            ))  # fmt: skip
        if spec.size_buckets is None and spec.max_overtaken is not None:
            errors.append((f"classes.{name}.max_overtaken", "only with size_buckets"))
    return errors


def check_key_classes(keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec]) -> Errors:
    """A key may only grant classes that exist, else its requests could not be queued."""
    return [
        (f"keys[{i}].classes[{j}]", f"class {cls!r} is not defined")
        for i, key in enumerate(keys)
        for j, cls in enumerate(key.classes)
        if cls not in classes
    ]


def granted_classes(
    keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec]
) -> dict[str, ClassSpec]:
    """The classes some key grants, in the order of ``classes``: the only ones that can run."""
    names = {cls for key in keys for cls in key.classes}
    return {name: spec for name, spec in classes.items() if name in names}


def band_cap(classes: Mapping[str, ClassSpec]) -> int:
    """The most band requests running at once in one pool: the priority classes' caps."""
    return sum(spec.max_in_flight or 0 for spec in classes.values() if spec.priority)


# what a priority class must set, and why: the band is served before every fair-queued request
_BAND_NEEDS = {
    "max_in_flight": "an uncapped band can take every slot of a pool and starve the fair queue",
    "max_queue_age_s": "band requests that never expire, always served first, let the band "
    "hold the pool",
    "max_queue_len": "an unbounded band queue, always served first, lets the band hold the pool",
}


def check_priority_band(
    keys: Iterable[KeySpec], classes: Mapping[str, ClassSpec], pools: Mapping[str, PoolSpec]
) -> Errors:
    """The strict band must never starve a pool's fair queue.

    The band is served before every SFQ flow, so a priority class needs ``max_in_flight``,
    ``max_queue_age_s`` and ``max_queue_len``, and the ``max_in_flight`` of all priority
    classes together must stay below every pool's total slots (the smallest pool binds): at
    least one slot then always serves the fair queue. Only classes some key grants are
    checked, since no request can ever be of another class (the default ``system`` class is
    defined even where no key uses it). The slots are the configured ones: a backend out of
    rotation lowers them for a while.
    """
    band = {name: spec for name, spec in granted_classes(keys, classes).items() if spec.priority}
    errors = [
        (f"classes.{name}.{field}", f"a priority class needs {field}: {why}")
        for name, spec in band.items()
        for field, why in _BAND_NEEDS.items()
        if getattr(spec, field) is None
    ]
    capped = {name: spec.max_in_flight for name, spec in band.items() if spec.max_in_flight}
    total = sum(capped.values())
    smallest = min(pools, key=lambda name: pool_slots(pools[name]), default=None)
    if smallest is None or total < (slots := pool_slots(pools[smallest])):
        return errors
    parts = " + ".join(f"{name} {cap}" for name, cap in capped.items())
    message = (
        f"the priority band's max_in_flight total {total} ({parts}) leaves no slot of pool "
        f"{smallest!r} ({slots} slots) to the fair queue; it must be below every pool's slots"
    )
    return errors + [(f"classes.{name}.max_in_flight", message) for name in capped]
