"""Which backend of a pool serves the next request (docs/design.md §5). No I/O, no clock.

Placement enforces each backend's concurrency slots and health; it never decides order,
which is the fair queue's job. Times are plain numbers the caller reads from its clock.

With affinity (a pool's ``affinity`` section, docs/design.md §5 "Affinity"), a request
that carries a key goes to the first backend of that key's rendezvous order that has a free
slot and stays within the bounded load; ``state/dispatch.lua`` ``choose`` applies the same
rule, with the same hashes, in Redis.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..config import BackendSpec, api_base
from .engine_gate import EngineGate, GatePolicy


@dataclass(slots=True, eq=False)
class Backend:
    name: str
    url: str
    slots: int
    in_flight: int = 0
    healthy: bool = True  # trusted until a probe or a failed request says otherwise
    down_until: float = 0.0  # end of the cooldown after the last failure
    failures: int = 0  # failures in a row (probes, connect errors, 5xx); a success resets it
    # when (pool clock) the response headers of a request of ours last came from it: a
    # first-byte timeout counts against it only if none came since its request was sent
    answered_at: float = -math.inf
    # the slots this process may fill on its own decision: all (None), or its share when a
    # shared pool lost its state (0 while it must not decide alone at all)
    share: int | None = None
    # engine dispatch (docs/design.md §5): whether its engine takes one more now, and the
    # dispatch attempts it refused while a slot was free, by the gate's reason
    gate: EngineGate | None = None
    refused: Counter[str] = field(default_factory=Counter)
    base: str = field(init=False)  # the URL without a trailing /v1: API and health paths go here

    def __post_init__(self) -> None:
        self.base = api_base(self.url)

    @property
    def load(self) -> float:
        return self.in_flight / self.slots

    @property
    def limit(self) -> int:
        """How many requests this process may run here."""
        return self.slots if self.share is None else min(self.slots, self.share)


def share(slots: int, index: int, holders: int, rank: int) -> int:
    """The part of backend ``index``'s ``slots`` that the replica of ``rank`` among
    ``holders`` may fill alone: an even split, whose remainders go to different replicas on
    different backends. Over the ranks, the parts add up to ``slots`` exactly."""
    base, extra = divmod(slots, holders)
    return base + (1 if (rank - index) % holders < extra else 0)


Reason = Literal["affinity", "overflow", "fallback"]
"""Why a request went where it did (``sfq_placement_total``): to its key's first choice, to
a later backend of its key's order (the first was full or over the bounded load), or to the
least loaded (no key, affinity off, or no backend of its order within the bound)."""


def rank(key: str, name: str) -> int:
    """The rendezvous (highest random weight) score of backend ``name`` for affinity ``key``:
    the first 13 hex digits (52 bits, exact in Lua's doubles) of SHA-1 of the key, a newline
    and the name. ``dispatch.lua`` computes the same with ``redis.sha1hex``."""
    return int(hashlib.sha1(f"{key}\n{name}".encode()).hexdigest()[:13], 16)


def key_order(key: str, backends: list[Backend]) -> list[Backend]:
    """``backends`` in ``key``'s order: the highest score first, list order on ties. A
    backend that leaves the list moves only the keys it came first for; one that joins takes
    only the keys it now comes first for (consistent hashing)."""
    return sorted(backends, key=lambda b: -rank(key, b.name))  # stable: list order on ties


class Placement:
    """The backends of one pool and the rule for picking among them.

    ``failures_to_down`` is how many failures in a row take a backend out (the pool's
    ``health.consecutive_failures``); ``load_factor`` is affinity's bound on a backend's
    load over the pool's average (``affinity.load_factor``; None: affinity off), and
    ``slack`` the requests a backend may run above it (``affinity.slack``). The pool sets
    them again on a reload.
    """

    def __init__(
        self,
        specs: list[BackendSpec],
        *,
        failures_to_down: int = 1,
        load_factor: float | None = None,
        slack: int = 0,
    ) -> None:
        self.backends = [
            Backend(name=s.name or s.url, url=s.url, slots=starting_slots(s)) for s in specs
        ]
        self.failures_to_down = failures_to_down
        self.load_factor = load_factor
        self.slack = slack

    def update(self, specs: list[BackendSpec]) -> None:
        """A config reload: keep the backends still listed (their in-flight requests and
        health), take new ones only after their first good probe, and drop the others from
        placement; a dropped backend's requests finish and release their slots as usual."""
        current = {b.url: b for b in self.backends}
        backends = []
        for spec in specs:
            backend = current.get(spec.url)
            if backend is None:
                backend = Backend(name=spec.name or spec.url, url=spec.url, slots=1)
                backend.healthy = False  # joins after its first good probe
            backend.name, backend.slots = spec.name or spec.url, starting_slots(spec)
            backends.append(backend)
        self.backends = backends

    def choose(self, key: str | None = None) -> Backend | None:
        """The healthy backend with a free slot that a request of affinity ``key`` goes to
        (see ``place``); None when every healthy backend is full."""
        placed = self.place(key)
        return None if placed is None else placed[0]

    def place(
        self, key: str | None = None, admits: Callable[[Backend], bool] | None = None
    ) -> tuple[Backend, Reason] | None:
        """Where a request goes, and why. With a ``key`` and affinity on: the first backend
        of the key's order among the healthy ones that has a free slot and whose load after
        placing stays within the bound, ``in_flight + 1 ≤ ⌈load_factor · (R + 1) · slots /
        S⌉ + slack`` (R requests in flight on the healthy backends, S their slots: consistent
        hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, with an absolute
        slack as cache-aware routers' balance thresholds have, so that at light load, where
        the ceiling is 1 or 2, a key is not sent away from its cache by one request). Otherwise,
        or when no backend of the order is within it, the least loaded healthy backend with
        a free slot (in-flight ÷ slots; the first listed on ties). A backend ``admits`` refuses
        (its engine's gate: see ``place_gated``) counts as full."""
        if key is not None and self.load_factor is not None:
            healthy = [b for b in self.backends if b.healthy]
            total = sum(b.limit for b in healthy)
            bound = self.load_factor * (sum(b.in_flight for b in healthy) + 1)
            for i, b in enumerate(key_order(key, healthy)):
                if admits is not None and not admits(b):
                    continue
                # in_flight + 1 ≤ ⌈x⌉ + slack ⇔ in_flight − slack < x, multiplied out as
                # dispatch.lua does
                if b.in_flight < b.limit and (b.in_flight - self.slack) * total < bound * b.limit:
                    return b, "affinity" if i == 0 else "overflow"
        best = None
        for b in self.backends:
            if (
                b.healthy
                and b.in_flight < b.limit
                and (best is None or b.load < best.load)
                and (admits is None or admits(b))  # last: a gate's judgement costs the most
            ):
                best = b
        return None if best is None else (best, "fallback")

    def place_gated(
        self, key: str | None, now: float, ceiling: float
    ) -> tuple[Backend, Reason] | None:
        """``place`` with engine dispatch: a backend whose gate does not admit a request of a
        class of engine ``ceiling`` now counts as full. When that leaves none, each gate that
        refused a backend with a free slot counts it once (``refused``): once per dispatch
        attempt (a request, a completion, a reading), whatever waits."""
        placed = self.place(key, lambda b: b.gate is None or b.gate.admit(now, ceiling).admit)
        if placed is None:
            for b in self.backends:
                if b.gate is not None and b.healthy and b.in_flight < b.limit:
                    b.refused[b.gate.admit(now, ceiling).reason] += 1
        return placed

    def acquire(self, backend: Backend) -> None:
        if backend.in_flight >= backend.limit:
            raise RuntimeError(f"backend {backend.name} has no free slot")
        backend.in_flight += 1

    def release(self, backend: Backend) -> None:
        if backend.in_flight <= 0:
            raise RuntimeError(f"backend {backend.name} released more slots than it had")
        backend.in_flight -= 1

    def record_failure(self, backend: Backend, until: float) -> bool:
        """A failed probe or request: once ``failures_to_down`` of them come in a row, the
        backend is out until ``until`` (each further failure pushes that back). True when
        this one took a healthy backend out."""
        backend.failures += 1
        if backend.failures < self.failures_to_down:
            return False
        was_healthy = backend.healthy
        self.mark_down(backend, until)
        return was_healthy

    def record_success(self, backend: Backend) -> None:
        """A good probe or answer ends the streak; a backend that is out stays out."""
        backend.failures = 0

    def mark_down(self, backend: Backend, until: float) -> None:
        """A failure: no new requests go to ``backend`` before ``until`` and a good probe."""
        backend.healthy = False
        backend.down_until = max(backend.down_until, until)

    def mark_up(self, backend: Backend, now: float) -> bool:
        """A good probe, or for a passive pool the end of the cooldown; True when it brought
        ``backend`` back (its cooldown is over), with a fresh streak."""
        if backend.healthy or now < backend.down_until:
            return False
        backend.healthy = True
        backend.failures = 0
        return True

    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)


def starting_slots(spec: BackendSpec) -> int:
    """A backend's slots until its gate says (``set_gate``): ``slots``, or for ``auto`` its
    ``capacity``, else 1."""
    return spec.slots if isinstance(spec.slots, int) else spec.capacity or 1


def set_gate(backend: Backend, policy: GatePolicy | None, now: float) -> None:
    """Give ``backend`` an engine gate of ``policy`` (a reload keeps what one learned), or
    take it away (None: static dispatch). A new gate is told of the requests already in
    flight, as if just dispatched: it may then count their completions."""
    if policy is None:
        backend.gate = None
        return
    if backend.gate is None:
        backend.gate = EngineGate(policy)
        for _ in range(backend.in_flight):
            backend.gate.dispatched(now)
    backend.gate.policy = policy
    gated_slots(backend)


def gated_slots(backend: Backend) -> None:
    """With ``slots: auto`` (its gate has no static ceiling), the slots placement counts: the
    most the gate lets it hold, its capacity as far as known (at least ``fallback_slots``)
    and the allowance waiting. Called when a reading or a reload may have changed them."""
    gate = backend.gate
    if gate is not None and gate.policy.slots is None:
        backend.slots = gate.fallback() + gate.policy.allowance
