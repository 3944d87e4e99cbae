"""The ordering policies the scenario lab compares, by name.

They live in the core (``core/queues.py``): each is an implementation of the
``DispatchQueue`` the proxy's ``Scheduler`` takes, and the simulator runs every one of them
through that scheduler. SFQ *is* the proxy's ``FairQueue``; the others are the baselines the
[FAIR-GPU] article (docs/design.md) measures it against: a global FIFO, strict priority by
class, round robin by request count, and Deficit Round Robin with a quantum. All are
deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..core.fair_queue import FairQueue
from ..core.queues import (
    DEFAULT_PRIORITY_ORDER,
    QUEUE_NAMES,
    DispatchQueue,
    Drr,
    Fifo,
    RoundRobin,
    StrictPriority,
    make_queue,
)
from ..core.scheduler import Ticket

__all__ = [
    "DEFAULT_PRIORITY_ORDER",
    "POLICY_NAMES",
    "Drr",
    "Fifo",
    "Policy",
    "RoundRobin",
    "Sfq",
    "StrictPriority",
    "make_policy",
]

Policy = DispatchQueue[Ticket]
"""What ``simulate`` takes: a fresh queue of scheduler tickets."""
Sfq = FairQueue
POLICY_NAMES = QUEUE_NAMES


def make_policy(name: str, *, quantum: float, priority_order: Sequence[str]) -> Policy:
    """A fresh policy by name (one of ``POLICY_NAMES``)."""
    queue: Policy = make_queue(name, quantum=quantum, priority_order=priority_order)
    return queue
