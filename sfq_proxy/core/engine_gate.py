"""Whether a backend may take one more request now, judged by its engine's own readings.
No I/O, no clock (docs/design.md §5, "Engine-aware dispatch").

A backend's static ``slots`` is a guess: too high and the queue moves from the proxy's fair
queue into the engine's FCFS one, too low and GPUs idle. The gate dispatches only while the
engine would run the request at once (or hold at most ``allowance`` waiting), reading what
the engine says it runs and queues (``engine_metrics``) every few hundred milliseconds.

A reading is old the moment it arrives, so the gate corrects it with an **in-flight
credit**: plus the proxy's own dispatches the reading may not have seen, less its
completions of requests the reading still counted.

- A dispatch takes a while to reach the engine's scheduler: one counts as unseen from
  ``settle_s`` before the scrape was *requested*.
- A finished request takes a while to reach the proxy, and the engine's gauges drop it
  first: against a real vLLM on a busy CPU, more than 50 ms later. Taking such a
  completion off again lets the engine queue one more than the allowance (with a 50 ms
  window alone it did: two waiting, allowance one). So when a reading arrives, the
  proxy's requests in flight that it neither shows nor may have missed (in flight −
  unseen − the engine's load, at least 0) are **ghosts**: finished, the end not yet heard.
  The next that many completions are not credited, and neither is any within
  ``settle_s`` after the answer arrived (for the engine's other clients, whose requests
  hide the ghosts). What is held back, the next reading gives.

With the proxy as the engine's only client and dispatches reaching the scheduler within
``settle_s``, the corrected reading is never below the engine's load, however late the
completions are heard, so the engine never holds more than the allowance waiting. It is
not floored at the proxy's own in-flight count: requests on their way or finished unheard
would then hold places in the engine, a large engine would never be seen running more
than it had, and its learned capacity would stall.

What may go in (``admit``), checked in this order:

1. ``slots``: the static ceiling, when set, is never passed (the proxy's own in-flight).
2. ``stale``: no usable reading, or one requested more than ``max_age_s`` ago, falls back
   to static dispatch: ``slots``, or with ``slots: auto`` the capacity learned so far (at
   least ``fallback_slots``). It never halts dispatch: llm-d shipped that failure, stale
   metrics stopping every dispatch.
3. An engine that runs and holds nothing, the credit included, always takes one.
4. ``engine_queue``: admitted, the engine would hold more than ``allowance`` waiting
   (estimated load + 1 > capacity + allowance).
5. ``kv_cache``: the KV cache's use is at or above the class's share of ``kv_ceiling``.
6. ``capacity``: a class whose ``ceiling`` is below 1 stops at ``⌊ceiling × capacity⌋``
   running (at least 1), leaving the rest for the classes above it without idle reserved
   slots; it never queues in the engine.

The **capacity** is the least of what is known: a configured ``capacity``, the one the
engine reports (llama.cpp's slots, TGI's ``max_batch_size``), and the one it showed when
saturated (running while requests wait for room: that running count is all it can run
now, KV-limited perhaps). A later reading with nobody waiting and more running raises it:
the ``allowance`` lets the engine show it, one reading at a time. Until any is known, the
capacity is the most it has seen running, so it ramps up by ``allowance`` a reading (or
``capacity`` skips the ramp), ``slots`` or not: ``slots`` is a ceiling, not what the engine
runs, and trusting it let the first burst of a pool whose ``slots`` were too high wait in
the engine's own queue (the lab's engine-slots scenario: 28 of 32, chat's answers 145 s).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol

from .engine_metrics import EngineReading

Reason = Literal["ok", "engine_queue", "kv_cache", "capacity", "stale", "slots"]

MAX_TRACKED = 65536  # dispatch times kept for the credit: within max_age_s + settle_s


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    reason: Reason


OK = Decision(True, "ok")


@dataclass(frozen=True, slots=True)
class GatePolicy:
    """One backend's rule (the pool's ``dispatch`` section and the backend's ``slots``).

    ``slots`` the static ceiling (None: ``auto``); ``capacity`` the requests the engine runs
    at once, when the operator knows it; ``allowance`` the requests the engine may hold
    waiting, at least 1 (it covers slot turnover between readings, and is how a learned
    capacity grows back); ``max_age_s`` how old a reading may be; ``kv_ceiling`` the KV use
    at which the top class stops (None: not checked); ``fallback_slots`` the least an
    ``auto`` backend runs on stale readings; ``settle_s`` how long a request may take to
    reach the engine's scheduler, or a finished one to reach the proxy."""

    slots: int | None = None
    capacity: int | None = None
    allowance: int = 1
    max_age_s: float = 2.0
    kv_ceiling: float | None = 0.95
    fallback_slots: int = 1
    settle_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("slots", "capacity"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None)")
        if self.allowance < 1:
            raise ValueError(
                "allowance must be at least 1: with 0 a learned capacity could only fall"
            )
        if self.fallback_slots < 1:
            raise ValueError("fallback_slots must be at least 1: dispatch never halts")
        if not (0 < self.max_age_s < math.inf):
            raise ValueError("max_age_s must be a positive number of seconds")
        if not (0 <= self.settle_s < math.inf):
            raise ValueError("settle_s must be a number of seconds, 0 or more")
        if self.kv_ceiling is not None and not (0 < self.kv_ceiling <= 1):
            raise ValueError("kv_ceiling must be in (0, 1]")


class DispatchRule(Protocol):
    """A pool's engine-dispatch settings, as the proxy's config (``pools.<p>.dispatch``) and
    the lab's scenario both hold them."""

    @property
    def allowance(self) -> int: ...
    @property
    def max_age_s(self) -> float: ...
    @property
    def kv_ceiling(self) -> float | None: ...
    @property
    def fallback_slots(self) -> int: ...
    @property
    def settle_s(self) -> float: ...


def policy_of(rule: DispatchRule, slots: int | str, capacity: int | None) -> GatePolicy:
    """A backend's gate: its pool's ``rule``, its ``slots`` (``auto``: no static ceiling)
    and the ``capacity`` its operator knows. One builder, so that the lab's gate is the
    proxy's."""
    return GatePolicy(
        slots=slots if isinstance(slots, int) else None,
        capacity=capacity,
        allowance=rule.allowance,
        max_age_s=rule.max_age_s,
        kv_ceiling=rule.kv_ceiling,
        fallback_slots=rule.fallback_slots,
        settle_s=rule.settle_s,
    )


@dataclass(frozen=True, slots=True)
class Estimate:
    """The engine now, as the gate believes it: the reading corrected by the credit."""

    running: int
    waiting: int
    capacity: int
    credit: int  # the proxy's own dispatches the reading has not seen, less completions

    @property
    def load(self) -> int:
        return self.running + self.waiting


class EngineGate:
    """One backend's engine-aware gate. Every method takes ``now`` from the caller's clock
    (monotonic seconds, never going back); the caller reports each of its own dispatches
    and completions to this backend, each scrape's request time, and its reading."""

    def __init__(self, policy: GatePolicy) -> None:
        self.policy = policy  # a reload may replace it; what was learned stays
        self.reading: EngineReading | None = None  # the newest usable one
        self.requested_at = -math.inf  # when that reading's scrape was requested
        self.problem: str | None = None  # of the last reading that was not usable
        self.dispatches = 0
        self.completions = 0
        self.learned = 0  # capacity from saturation, or the most seen running
        self.saturated = False  # whether ``learned`` came from (or since) a saturation
        self.reported: int | None = None  # capacity the engine reported
        self._times: deque[float] = deque(maxlen=MAX_TRACKED)  # recent dispatch times
        self._last = -math.inf
        self._seen = 0  # the current reading's running + waiting
        self._base = 0  # dispatches the current reading has seen
        self._count_from = math.inf  # completions from then on may be credited
        self._ghosts = 0  # completions still to hold back: requests finished unheard
        self._credited = 0

    @property
    def in_flight(self) -> int:
        return self.dispatches - self.completions

    def _now(self, now: float) -> float:
        self._last = max(self._last, now)
        return self._last

    def dispatched(self, now: float) -> None:
        now = self._now(now)
        self.dispatches += 1
        self._times.append(now)
        horizon = now - self.policy.max_age_s - self.policy.settle_s
        while self._times[0] < horizon:  # a reading requested before is stale anyway
            self._times.popleft()

    def completed(self, now: float) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("more completions than dispatches")
        self.completions += 1
        if self._now(now) < self._count_from:
            return
        if self._ghosts > 0:
            self._ghosts -= 1
        else:
            self._credited += 1

    def observe(self, reading: EngineReading, requested_at: float, now: float) -> None:
        """The answer to a scrape requested at ``requested_at``, arrived ``now``. One with
        no usable numbers leaves the last usable reading to age; one older than the
        current reading (a late answer) is dropped."""
        now = self._now(now)
        running, waiting = reading.running, reading.waiting
        if reading.problem is not None or running is None or waiting is None:
            self.problem = reading.problem or "missing"
            return
        if requested_at < self.requested_at:
            return
        self.problem = None
        after = requested_at - self.policy.settle_s
        unseen = 0
        for t in reversed(self._times):
            if t < after:
                break
            unseen += 1
        self.reading, self.requested_at = reading, requested_at
        self._seen = running + waiting
        self._base = self.dispatches - unseen
        self._count_from = now + self.policy.settle_s
        self._ghosts = max(0, self.in_flight - unseen - self._seen)
        self._credited = 0
        if now - requested_at <= self.policy.max_age_s:
            self._learn(reading)

    def _learn(self, reading: EngineReading) -> None:
        assert reading.running is not None
        if reading.capacity is not None:
            self.reported = reading.capacity
        if not reading.saturated:
            self.learned = max(self.learned, reading.running)
        elif reading.running >= 1:  # nothing running and a queue: loading, not a capacity
            self.learned, self.saturated = reading.running, True

    def capacity(self) -> int:
        """The requests the engine runs at once, as far as the gate knows (see the module's
        docstring); without any bound yet, the most seen running."""
        bounds = [
            b
            for b in (
                self.policy.capacity,
                self.reported,
                self.learned if self.saturated else None,
            )
            if b is not None
        ]
        if bounds:
            return min(bounds)
        return self.learned

    def fresh(self, now: float) -> bool:
        return self.reading is not None and now - self.requested_at <= self.policy.max_age_s

    def estimate(self, now: float) -> Estimate | None:
        """The engine's running and waiting now, the reading corrected by the credit; None
        when there is no fresh reading."""
        if not self.fresh(now):
            return None
        credit = self.dispatches - self._base - self._credited
        load = max(0, self._seen + credit)
        capacity = self.capacity()
        running = min(load, capacity)
        return Estimate(running=running, waiting=load - running, capacity=capacity, credit=credit)

    def fallback(self) -> int:
        """How many requests may run on stale or missing readings: static dispatch."""
        if self.policy.slots is not None:
            return self.policy.slots
        return max(self.policy.fallback_slots, self.capacity())

    def admit(self, now: float, ceiling: float = 1.0) -> Decision:
        """May one more request of a class with ``ceiling`` (a fraction in (0, 1]) go to
        this backend now, and why (or why not)."""
        if not (0 < ceiling <= 1):
            raise ValueError("a class's engine ceiling is in (0, 1]")
        policy = self.policy
        if policy.slots is not None and self.in_flight >= policy.slots:
            return Decision(False, "slots")
        est = self.estimate(now)
        if est is None:
            return Decision(self.in_flight < self.fallback(), "stale")
        if est.load == 0:
            return OK
        if est.load + 1 > est.capacity + policy.allowance:
            return Decision(False, "engine_queue")
        assert self.reading is not None
        kv = self.reading.kv_usage
        if policy.kv_ceiling is not None and kv is not None and kv >= ceiling * policy.kv_ceiling:
            return Decision(False, "kv_cache")
        if ceiling < 1 and self.bounded() and est.load + 1 > self.share(ceiling):
            return Decision(False, "capacity")
        return OK

    def leases(self, now: float) -> int:
        """What the backend may hold when the pool's replicas share it through leases in
        Redis (``state: redis``), each counting every replica's dispatches where no gate
        sees the others': its capacity as far as known and the allowance on a fresh reading
        (the ramp as ``admit``'s), within ``slots``; static dispatch's on a stale one. The
        leases over-count what the engine runs by the ends not yet heard, as static slots
        do: the allowance covers that turnover."""
        if not self.fresh(now):
            return self.fallback()
        room = self.capacity() + self.policy.allowance
        return room if self.policy.slots is None else min(self.policy.slots, room)

    def class_leases(self, now: float, ceiling: float) -> int | None:
        """Fewer ``leases`` for a class of engine ``ceiling``, on a fresh reading: its share
        of a known capacity (``admit``'s ``capacity``), and while the KV cache is at or
        above the class's ceiling what the engine runs (at least one: ``admit``'s engine
        running nothing takes one). None: the backend's leases bound it alone."""
        if not (0 < ceiling <= 1):
            raise ValueError("a class's engine ceiling is in (0, 1]")
        reading = self.reading
        if reading is None or not self.fresh(now):
            return None
        bounds = []
        kv, kv_ceiling = reading.kv_usage, self.policy.kv_ceiling
        if kv_ceiling is not None and kv is not None and kv >= ceiling * kv_ceiling:
            bounds.append(max(1, reading.running or 0))
        if ceiling < 1 and self.bounded():
            bounds.append(self.share(ceiling))
        return min(bounds, default=None)

    def share(self, ceiling: float) -> int:
        """The requests a class of engine ``ceiling`` may have the engine run: its part of
        the capacity, at least one."""
        return max(1, math.floor(ceiling * self.capacity() + 1e-9))

    def bounded(self) -> bool:
        """Whether the engine's capacity is known (configured, reported, or shown by
        saturation) rather than ramped to. A class ceiling applies to a known capacity only:
        applied to the ramp, a class below 1 sending alone held it at what it had seen
        running (⌊0.75 × 1⌋ = 1, for ever: found on a real vLLM); while ramping, the
        allowance alone bounds what waits in the engine."""
        policy = self.policy
        return policy.capacity is not None or self.reported is not None or self.saturated
