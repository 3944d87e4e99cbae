"""One pool's dispatch decisions: the fair queue in front of placement. No I/O, no clock.

Like httpcore's connection pool, it only changes state and *returns* what to do (which
ticket goes to which backend); the async shell in ``dispatch.py`` carries it out. The
simulator drives this same class in virtual time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .placement import Backend, Placement
from .sfq import FairQueue


@dataclass(eq=False, slots=True)
class Ticket:
    """A request's place in line. ``payload`` is whatever the shell needs to resume it."""

    flow: str
    cost: float
    weight: float
    payload: Any = None
    backend: Backend | None = field(default=None, repr=False)
    dispatches: int = 0  # how many times it was sent (a retry is sent again, charged again)


class Scheduler:
    """Dispatch one request at a time while a healthy backend has a free slot.

    The head of the fairest flow waits for a slot rather than letting another flow
    overtake it: the order is always the one the meters explain.
    """

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self.queue: FairQueue[Ticket] = FairQueue()
        self.running = 0

    def submit(self, ticket: Ticket) -> list[Ticket]:
        """Queue ``ticket`` in its flow; returns the tickets dispatched as a result."""
        self.queue.push(ticket.flow, ticket, ticket.cost, ticket.weight)
        return list(self._dispatch())

    def cancel(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out, uncharged; False if it was not queued."""
        return self.queue.remove(ticket.flow, ticket)

    def finish(self, ticket: Ticket) -> list[Ticket]:
        """A dispatched ticket is done (or failed): free its slot and dispatch more."""
        backend = ticket.backend
        if backend is None:
            raise RuntimeError("finish() of a ticket that holds no slot")
        ticket.backend = None
        self.placement.release(backend)
        self.running -= 1
        return list(self._dispatch())

    def pump(self) -> list[Ticket]:
        """Dispatch what capacity allows now (after a backend came back, say)."""
        return list(self._dispatch())

    def _dispatch(self) -> Iterator[Ticket]:
        while (backend := self.placement.choose()) is not None:
            popped = self.queue.pop()
            if popped is None:
                return
            ticket = popped[1]
            self.placement.acquire(backend)
            ticket.backend = backend
            ticket.dispatches += 1
            self.running += 1
            yield ticket
