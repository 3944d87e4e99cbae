"""The ordering policies the scenario lab compares, by name.

They live in the core (``core/queues.py``): each is an implementation of the
``DispatchQueue`` the proxy's ``Scheduler`` takes, and the simulator runs every one of them
through that scheduler. SFQ *is* the proxy's ``FairQueue``; the others are the baselines the
[FAIR-GPU] article (docs/design.md) measures it against: a global FIFO, strict priority by
class, round robin by request count, and Deficit Round Robin with a quantum. All are
deterministic. ``sfq-fifo`` is SFQ with every flow a strict FIFO whatever its class's size
buckets (docs/design.md §3): what the buckets change, on the same run.
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
    "SFQ_FIFO",
    "Drr",
    "Fifo",
    "Policy",
    "RoundRobin",
    "Sfq",
    "SfqFifoFlows",
    "StrictPriority",
    "make_policy",
]

Policy = DispatchQueue[Ticket]
"""What ``simulate`` takes: a fresh queue of scheduler tickets."""
Sfq = FairQueue
SFQ_FIFO = "sfq-fifo"
POLICY_NAMES = (*QUEUE_NAMES, SFQ_FIFO)


class SfqFifoFlows(FairQueue[Ticket]):
    """SFQ with every flow a strict FIFO: a ticket's size bucket is ignored."""

    def push(
        self,
        flow: str,
        item: Ticket,
        cost: float,
        weight: float = 1.0,
        *,
        front: bool = False,
        bucket: int = 0,
        max_overtaken: int | None = None,
    ) -> None:
        super().push(flow, item, cost, weight, front=front)


def make_policy(name: str, *, quantum: float, priority_order: Sequence[str]) -> Policy:
    """A fresh policy by name (one of ``POLICY_NAMES``)."""
    if name == SFQ_FIFO:
        return SfqFifoFlows()
    queue: Policy = make_queue(name, quantum=quantum, priority_order=priority_order)
    return queue
