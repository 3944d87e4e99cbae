"""The ordering policies the scenario lab compares, by name.

They live in the core (``core/queues.py``): each is an implementation of the
``DispatchQueue`` the proxy's ``Scheduler`` takes, and the simulator runs every one of them
through that scheduler. SFQ *is* the proxy's ``FairQueue``; the others are the baselines the
[FAIR-GPU] article (docs/design.md) measures it against: a global FIFO, strict priority by
class, round robin by request count, and Deficit Round Robin with a quantum. All are
deterministic. ``sfq-fifo`` is SFQ with every flow a strict FIFO whatever its class's size
buckets (docs/design.md §3): what the buckets change, on the same run. ``sfq-estimate-only``
is SFQ run without true-ups: the simulator tells the scheduler nothing of a request's actual
cost at its end, so its estimate stands (``trues_up``): what the true-up buys, on the same
workload.
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
    "SFQ_ESTIMATE_ONLY",
    "SFQ_FIFO",
    "Drr",
    "Fifo",
    "Policy",
    "RoundRobin",
    "Sfq",
    "SfqFifoFlows",
    "StrictPriority",
    "make_policy",
    "trues_up",
]

Policy = DispatchQueue[Ticket]
"""What ``simulate`` takes: a fresh queue of scheduler tickets."""
Sfq = FairQueue
SFQ_FIFO = "sfq-fifo"
SFQ_ESTIMATE_ONLY = "sfq-estimate-only"
POLICY_NAMES = (*QUEUE_NAMES, SFQ_FIFO, SFQ_ESTIMATE_ONLY)


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
    if name == SFQ_ESTIMATE_ONLY:  # the queue is SFQ's: the run differs (``trues_up``)
        return Sfq()
    queue: Policy = make_queue(name, quantum=quantum, priority_order=priority_order)
    return queue


def trues_up(name: str) -> bool:
    """Whether a run of policy ``name`` passes each request's actual cost to the scheduler at
    its end, as the proxy does: SFQ's runs, but ``sfq-estimate-only``. A baseline orders by
    its own rule, which a true-up does not change: its run is the same either way, and its
    charges stay the final ones the report's bound check takes."""
    return name in ("sfq", SFQ_FIFO)
