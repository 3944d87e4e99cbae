"""The memory a process spends on waiting requests, bounded, largest flows first
(docs/design.md §6, Queue memory).

Sans-I/O. Each request waiting in a line of the process (any pool, the band included) is
counted as ``REQUEST_OVERHEAD_BYTES`` plus the bytes of its body the process holds; the
total is kept within ``limits.queue_memory_mb``. A request that would go beyond it is
admitted only at the expense of flows larger than its own: the newest requests of the
largest flow leave the line (each is answered 429 ``queue_full`` by the shell: none is
dropped silently), as long as that flow stays at least as large as the newcomer's. Else
the newcomer is refused (429 ``queue_full``). At the bound every flow may thus keep an
equal part of it, and a flood only ever pushes out itself. A body still being read counts
the same way, growing as its bytes arrive (:meth:`QueueMemory.grow`; the shell makes the
bodies an org is sending one flow, ``http/body.py``).

Why evict rather than refuse newcomers above ``bound / active flows`` without evicting: a
rule without eviction cannot keep a bound, since the flood is already queued when a small
flow arrives; admitting the small flow beyond the bound (each newcomer up to its fair
part) lets the total grow with every new flow. Pushing out the newest request of the
longest line (as a switch's shared buffer does, "longest queue drop") keeps the bound
exact. The newest is taken because it has waited least and, SFQ charging at dispatch, it
was charged nothing: its flow's meter and the order of its older requests are unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

from ..config import REQUEST_OVERHEAD_BYTES
from .errors import ApiError

F = TypeVar("F", bound=Hashable)
T = TypeVar("T", bound=Hashable)
RETRY_AFTER_S = 1.0


class QueueMemory(Generic[F, T]):
    """The requests waiting in the process's lines, per flow, within ``limit`` bytes.

    A flow is any hashable the caller chooses (the shell: its pool and flow id, and the
    pool itself, so that it knows where an evicted request waits); an item is a request.
    What it keeps per waiting request is one dict entry: it counts in the memory it bounds.
    """

    def __init__(self, limit: int, overhead: int = REQUEST_OVERHEAD_BYTES) -> None:
        if limit <= 0 or overhead <= 0:
            raise ValueError("the limit and the overhead must be positive")
        self.limit = limit
        self.overhead = overhead
        self.used = 0
        self._flows: dict[F, dict[T, int]] = {}  # flow → item → charge, oldest first
        self._held: dict[F, int] = {}  # flow → the sum of its charges
        self._count = 0
        # the flows by what they hold, largest first: (-held, flow), lazily kept. Each flow
        # has an entry at least as large as what it holds, so the first entry that matches
        # its flow's holding is the largest flow.
        self._heap: list[tuple[int, F]] = []

    def charge(self, size: int) -> int:
        """What a request holding ``size`` bytes of body is counted as."""
        return self.overhead + max(0, size)

    def fits(self, size: int) -> bool:
        """Whether a request holding ``size`` bytes can wait without taking anyone's place."""
        return self.used + self.charge(size) <= self.limit

    def enter(self, flow: F, item: T, size: int) -> list[tuple[F, T]]:
        """Count ``item`` (holding ``size`` bytes) as waiting in ``flow``'s line; returns the
        (flow, item) that leave the count to make room, the newest of the largest flows
        (the shell answers each 429 ``queue_full``). Raises 429 ``queue_full`` and changes
        nothing when ``item`` can only wait at the expense of flows not larger than its
        own."""
        if item in self._flows.get(flow, ()):
            raise ValueError("this item is counted already")
        return self._add(flow, item, self.charge(size), new=True)

    def grow(self, flow: F, item: T, more: int) -> list[tuple[F, T]]:
        """``item`` holds ``more`` bytes more: a body being read, as its bytes arrive (its
        first ones count it, with the overhead). Returns, and raises, as :meth:`enter`: a
        body grows at the expense of larger flows only, and otherwise is refused."""
        counted = item in self._flows.get(flow, ())
        charge = max(0, more) if counted else self.charge(more)
        return self._add(flow, item, charge, new=not counted)

    def _add(self, flow: F, item: T, charge: int, *, new: bool) -> list[tuple[F, T]]:
        need = self.used + charge - self.limit
        victims = [] if need <= 0 else self._victims(flow, charge, need)
        if victims is None:
            raise ApiError(
                429, "The proxy's queue memory is full and this request's flow holds the "
                "largest part of it; retry later.", code="queue_full", retry_after=RETRY_AFTER_S,
            )  # fmt: skip
        for giver, victim in victims:
            self.leave(giver, victim)
        items = self._flows.setdefault(flow, {})
        items[item] = items.get(item, 0) + charge
        held = self._held[flow] = self._held.get(flow, 0) + charge
        self.used += charge
        self._count += new
        heapq.heappush(self._heap, (-held, flow))
        self._compact()
        return victims

    def leave(self, flow: F, item: T) -> bool:
        """``item`` no longer waits in ``flow``'s line (dispatched, expired, cancelled,
        refused): its memory is free. False if it was not counted (or left already)."""
        items = self._flows.get(flow)
        charge = None if items is None else items.pop(item, None)
        if items is None or charge is None:
            return False
        self.used -= charge
        self._count -= 1
        if items:
            self._held[flow] -= charge
        else:
            del self._flows[flow], self._held[flow]
        self._compact()
        return True

    def _compact(self) -> None:
        """Mostly stale entries: start afresh (amortised O(1) a change)."""
        if len(self._heap) > 2 * len(self._held) + 64:
            self._heap = [(-held, f) for f, held in self._held.items()]
            heapq.heapify(self._heap)

    def items(self) -> list[tuple[F, T]]:
        """Every waiting item, with its flow."""
        return [(flow, item) for flow, items in self._flows.items() for item in items]

    def held(self, flow: F) -> int:
        """The bytes counted for ``flow``'s waiting requests."""
        return self._held.get(flow, 0)

    def __len__(self) -> int:
        """How many requests are counted as waiting."""
        return self._count

    def largest(self) -> tuple[F, int] | None:
        """The flow holding the most, and what it holds (ties: any of them)."""
        heap = self._heap
        while heap:
            negative, flow = heap[0]
            held = self._held.get(flow)
            if held == -negative:
                return flow, held
            heapq.heappop(heap)
            if held is not None:  # it holds less than that entry said: its true place
                heapq.heappush(heap, (-held, flow))
        return None

    def _victims(self, flow: F, charge: int, need: int) -> list[tuple[F, T]] | None:
        """The newest requests of the flows larger than ``flow`` would be with ``charge``
        more, largest first, that free ``need`` bytes; each flow gives requests only while
        it stays at least as large as ``flow``'s would be. None if they cannot."""
        mine = self._held.get(flow, 0) + charge
        top = self.largest()
        if top is None or top[1] - self.overhead < mine:  # the flood itself, at once
            return None
        # the flows that could give: rare (a smaller flow's request at the bound)
        heap = [(-held, f) for f, held in self._held.items() if f != flow and held > mine]
        heapq.heapify(heap)
        newest = {f: reversed(self._flows[f].items()) for _, f in heap}
        victims: list[tuple[F, T]] = []
        while need > 0 and heap:
            negative, giver = heapq.heappop(heap)
            held = -negative
            item, cost = next(newest[giver])
            if held - cost < mine:  # it would end smaller than the newcomer's flow
                continue
            victims.append((giver, item))
            need -= cost
            if held - cost > mine:
                heapq.heappush(heap, (-(held - cost), giver))
        return victims if need <= 0 else None


def evicted() -> ApiError:
    """What a request pushed out of its line is answered."""
    return ApiError(
        429, "The proxy's queue memory is full and this request's flow holds the largest "
        "part of it: it gave its place in line to a smaller flow's request; retry later.",
        code="queue_full", retry_after=RETRY_AFTER_S,
    )  # fmt: skip
