"""Ordering policies compared in the scenario lab, behind one small interface.

SFQ here *is* the proxy's ``FairQueue`` (no second copy); the others are the baselines
the [FAIR-GPU] article (docs/design.md) measures it against: a global FIFO, strict priority
by class, round robin by request count, and Deficit Round Robin with a quantum. All are
deterministic.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from ..core.fair_queue import FairQueue
from .scenario import Request


class Policy(Protocol):
    name: str

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None: ...
    def pop(self) -> Request | None: ...


class Fifo:
    """One global queue in arrival order: whoever comes first is served first."""

    name = "fifo"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None:
        self._queue.append(request)

    def pop(self) -> Request | None:
        return self._queue.popleft() if self._queue else None


class StrictPriority:
    """The highest non-empty class first (``order``, highest first), FIFO within a class."""

    name = "priority"

    def __init__(self, order: Sequence[str]) -> None:
        self._rank = {cls: i for i, cls in enumerate(order)}
        self._queues: dict[int, deque[Request]] = {}

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None:
        rank = self._rank.get(request.cls, len(self._rank))
        self._queues.setdefault(rank, deque()).append(request)

    def pop(self) -> Request | None:
        for rank in sorted(self._queues):
            if self._queues[rank]:
                return self._queues[rank].popleft()
        return None


class RoundRobin:
    """One request per backlogged flow in turn, whatever it costs."""

    name = "rr"

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self._active: deque[str] = deque()

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None:
        queue = self._queues.setdefault(flow, deque())
        if not queue:
            self._active.append(flow)
        queue.append(request)

    def pop(self) -> Request | None:
        if not self._active:
            return None
        flow = self._active.popleft()
        queue = self._queues[flow]
        request = queue.popleft()
        if queue:
            self._active.append(flow)
        return request


class Drr:
    """Deficit Round Robin (Shreedhar & Varghese): each visit credits ``quantum × weight``;
    the head goes when the credit covers its cost; an emptied flow loses its credit."""

    name = "drr"

    def __init__(self, quantum: float) -> None:
        if quantum <= 0:
            raise ValueError("quantum must be > 0")
        self._quantum = quantum
        self._queues: dict[str, deque[tuple[Request, float]]] = {}
        self._weights: dict[str, float] = {}
        self._deficit: dict[str, float] = {}
        self._active: deque[str] = deque()
        self._credited = False  # whether the flow at the head of the round got its quantum

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None:
        queue = self._queues.setdefault(flow, deque())
        if not queue:
            self._active.append(flow)
            self._deficit[flow] = 0.0
        self._weights[flow] = weight
        queue.append((request, cost))

    def pop(self) -> Request | None:
        while self._active:
            flow = self._active[0]
            if not self._credited:
                self._deficit[flow] += self._quantum * self._weights[flow]
                self._credited = True
            queue = self._queues[flow]
            request, cost = queue[0]
            if cost <= self._deficit[flow]:
                queue.popleft()
                self._deficit[flow] -= cost
                if not queue:
                    self._deficit[flow] = 0.0
                    self._active.popleft()
                    self._credited = False
                return request
            self._active.rotate(-1)
            self._credited = False
        return None


class Sfq:
    """Start-time Fair Queueing: the proxy's own ``FairQueue``."""

    name = "sfq"

    def __init__(self) -> None:
        self._queue: FairQueue[Request] = FairQueue()

    def push(self, flow: str, request: Request, cost: float, weight: float) -> None:
        self._queue.push(flow, request, cost, weight)

    def pop(self) -> Request | None:
        popped = self._queue.pop()
        return None if popped is None else popped[1]


DEFAULT_PRIORITY_ORDER = ("system", "interactive", "batch")
POLICY_NAMES = ("fifo", "priority", "rr", "drr", "sfq")


def make_policy(name: str, *, quantum: float, priority_order: Sequence[str]) -> Policy:
    """A fresh policy by name (one of ``POLICY_NAMES``)."""
    factories: dict[str, Callable[[], Policy]] = {
        "fifo": Fifo,
        "priority": lambda: StrictPriority(priority_order),
        "rr": RoundRobin,
        "drr": lambda: Drr(quantum),
        "sfq": Sfq,
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return factories[name]()
