"""One pool's dispatch, made atomically in Redis by the ``dispatch.lua`` library: the calls,
typed.

The script holds the rules (the same as ``core/fair_queue.py`` and ``core/scheduler.py``);
this module only packs arguments and unpacks grants, so that the proxy and the conformance
tests drive it the same way. Each process is a *holder*: its queued tickets and slot leases
are its own, kept alive by its heartbeat, given back by Redis when the heartbeat stops.
A provider pool's rate and its provider's feedback pace the dispatch in Redis too: a reply
that dispatches says when pacing allows the next dispatch (``Grants.wake_s``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from ..core.fair_queue import UNITS_PER_COST, FlowView
from ..core.limits import Rate, TokenBucket
from ..core.placement import Reason
from .redis_batcher import Batcher, Call
from .redis_functions import DISPATCH, Caller

# a backend as dispatch.lua places on it: its name, its slots and, in engine dispatch, the
# classes that may fill fewer of them (``EngineGate.class_leases``), and whether the entry is
# provisional (the caller's reading of its engine is stale: the one Redis holds stands)
SharedBackend = (
    tuple[str, int] | tuple[str, int, dict[str, int]] | tuple[str, int, dict[str, int], bool]
)


class Grant(NamedTuple):
    """A ticket given a slot: the lease (its fencing token) that must be handed back, and
    why placement chose that backend (``core/placement.py`` ``Reason``)."""

    ticket: str
    lease: str
    backend: str
    reason: Reason = "fallback"


class Grants(list[Grant]):
    """The grants of a reply, and ``wake_s``: in how many seconds the pool's pacing (its rate,
    its provider's pause) allows the next dispatch, when it held a ticket back; else None.
    ``admitted``: the reply of the admission a submit carried (``admission.lua``'s admit)."""

    def __init__(self, grants: Iterable[Grant] = (), wake_s: float | None = None) -> None:
        super().__init__(grants)
        self.wake_s = wake_s
        self.admitted: list[int] | None = None


@dataclass(frozen=True, slots=True)
class SharedTicket:
    """What Redis needs of a queued request; numbers already checked by ``Ticket``."""

    org: str
    cls: str
    cost: float
    weight: float
    tokens: float = 0.0
    priority: bool = False
    affinity: str | None = None  # its affinity key: a digest (core/affinity.py)
    # its size bucket and max_overtaken (docs/design.md §3); None: its flow is a FIFO
    bucket: int = 0
    max_overtaken: int | None = None

    @property
    def flow(self) -> str:
        return f"{self.org}/{self.cls}"


class Fenced(Exception):
    """This holder's heartbeat stopped long enough for Redis to give its slots back: what it
    still runs holds no lease, and what it queued is gone."""


class QueueFull(Exception):
    """The ticket's own line already holds ``ahead`` requests (its ``max_queue_len``);
    ``admitted``: the reply of the admission its submit carried, which let it in."""

    def __init__(self, ahead: int, admitted: list[int] | None = None) -> None:
        super().__init__(ahead)
        self.ahead = ahead
        self.admitted = admitted


class NotAdmitted(Exception):
    """The admission a submit carried refused the ticket: its reply (``admission.lua``)."""

    def __init__(self, reply: list[int]) -> None:
        super().__init__(reply)
        self.reply = reply


def pool_prefix(pool: str) -> str:
    """Every key of a pool starts so: its name as the hash tag keeps it in one cluster slot."""
    return f"sfq:{{{pool}}}:"


class RedisDispatch:
    """The dispatch calls of one pool for one holder."""

    def __init__(
        self, redis: Redis | RedisCluster, pool: str, holder: str, calls: Caller | None = None
    ) -> None:
        """``redis`` serves the inbox's blocking reads; ``calls`` (a ``Pipe`` to the same
        server, or by default ``redis``) the function calls."""
        self.redis = redis
        self.calls = redis if calls is None else calls
        self._prefix = pool_prefix(pool)
        self.holder = holder
        self.holders: list[str] = [holder]  # the pool's live holders at the last heartbeat
        self._batcher = Batcher(self._send)

    async def _call(self, op: str, *args: Any) -> Any:
        return await self._batcher.call((op, *args))

    async def _send(self, calls: list[Call]) -> list[Any]:
        return await DISPATCH.call_all(self.calls, self._prefix, calls, self.holder)

    async def heartbeat(
        self, ttl_s: float, down: Iterable[str] = (), *, new: bool = False
    ) -> Grants:
        """Renew this holder's leases for ``ttl_s`` (``new``: register it), reclaiming those
        of holders whose own expired; raises Fenced when this holder's were reclaimed.
        Notes the pool's live holders (``holders``)."""
        ttl_ms = round(ttl_s * 1000)
        reply = await self._call("heartbeat", ttl_ms, "1" if new else "0", _names(down))
        if reply[0] == 0:
            raise Fenced(self.holder)
        self.holders = sorted(_text(h) for h in reply[2])
        return _grants(reply[1], reply[3])

    async def adopt(
        self, ttl_s: float, running: Iterable[tuple[str, str, str]]
    ) -> tuple[list[str], float]:
        """Back after Redis was lost: register this holder again with a lease for each
        request it runs (backend, org, class), in place of whatever Redis still held of it.
        Returns the leases, in order, and for how many seconds the pool has been calm (no
        holder reclaimed, no state lost): under a TTL, others may still run unregistered
        requests of their own."""
        listed = json.dumps([list(r) for r in running])
        reply = await self._call("adopt", round(ttl_s * 1000), listed)
        return [_text(lease) for lease in reply[1]], int(reply[2]) / 1000

    async def configure(
        self,
        backends: Iterable[SharedBackend],
        org_caps: Mapping[str, int],
        class_caps: Mapping[str, int],
        down: Iterable[str] = (),
        rate: Rate | None = None,
        load_factor: float | None = None,
        slack: int = 0,
    ) -> Grants:
        """The pool's backends (in placement order, with their slots and, in engine
        dispatch, their classes' lower limits), in-flight caps,
        provider rate, whose buckets Redis keeps with a second's burst (``pool_limits``), and
        affinity's load factor (None: affinity off, every ticket goes to the least loaded)
        and slack (``Placement.place``)."""
        call = self._call(
            "configure",
            json.dumps([list(backend) for backend in backends]),
            json.dumps(dict(org_caps)),
            json.dumps(dict(class_caps)),
            _names(down),
            _per_minute(rate.requests if rate else None),
            _per_minute(rate.tokens if rate else None),
            "" if load_factor is None else f"{load_factor:.17g}",
            slack,
        )
        reply = _checked(await call)
        return _grants(reply[1], reply[2])

    async def set_backends(self, backends: Iterable[SharedBackend], down: Iterable[str]) -> Grants:
        """The pool's backends alone, as ``configure`` lists them (engine dispatch's limits
        after a reading changed them: the rest of the pool's settings stay), and dispatch
        what they allow."""
        listed = json.dumps([list(backend) for backend in backends])
        reply = _checked(await self._call("backends", listed, _names(down)))
        return _grants(reply[1], reply[2])

    async def submit(
        self,
        ticket_id: str,
        ticket: SharedTicket,
        *,
        front: bool = False,
        down: Iterable[str] = (),
        max_ahead: int | None = None,
        admit: tuple[str, ...] = (),
    ) -> Grants:
        """Queue ``ticket`` and dispatch what slots allow; raises QueueFull when its line
        already holds ``max_ahead`` requests (checked and queued in one step). ``admit``:
        an admission to decide first, in the same step (its org's key prefix, then
        ``admission.lua``'s admit arguments; one Redis only, not a Cluster, where the org's
        keys are on another shard); raises NotAdmitted when it refuses."""
        fields = {
            "f": ticket.flow, "o": ticket.org, "c": ticket.cls, "cost": ticket.cost,
            "w": ticket.weight, "tok": ticket.tokens, "p": int(ticket.priority),
            "h": self.holder,
        }  # fmt: skip
        if ticket.affinity is not None:
            fields["a"] = ticket.affinity
        if ticket.max_overtaken is not None:  # size buckets inside its flow
            fields["b"], fields["k"] = ticket.bucket, ticket.max_overtaken
        limit = -1 if max_ahead is None else max_ahead
        flags = "1" if front else "0"
        reply = _checked(
            await self._call(
                "submit", ticket_id, json.dumps(fields), flags, _names(down), limit, *admit
            )
        )
        if reply[0] == 3:
            raise NotAdmitted(reply[1])
        if reply[0] == 2:
            raise QueueFull(int(reply[1]), reply[2] if len(reply) > 2 else None)
        grants = _grants(reply[1], reply[2])
        grants.admitted = reply[3] if len(reply) > 3 else None
        return grants

    async def cancel(self, ticket_id: str) -> bool:
        """Take a queued ticket out, uncharged; False if it was dispatched (or is unknown)."""
        return bool(_checked(await self._call("cancel", ticket_id))[0])

    async def finish(
        self,
        lease: str,
        down: Iterable[str] = (),
        *,
        refund: float | None = None,
        actual: float | None = None,
    ) -> Grants:
        """Hand a lease back and dispatch what it frees; ``refund``: the tokens its request
        gives back to the pool's rate (the upstream generated nothing); ``actual``: what the
        request really cost, its flow's charge trued up to it in the same step (None: the
        estimate stands). A lease that Redis reclaimed (or that was handed back already) frees
        nothing: the fencing that keeps a late release from freeing a slot granted since."""
        tokens = "" if refund is None else f"{refund:.17g}"
        cost = "" if actual is None else f"{actual:.17g}"
        reply = _checked(await self._call("finish", lease, _names(down), tokens, cost))
        return _grants(reply[1], reply[2]) if reply[0] == 1 else Grants()

    async def pump(self, down: Iterable[str] = ()) -> Grants:
        """Dispatch what capacity and pacing allow now (a backend came back, a wait ended)."""
        reply = _checked(await self._call("pump", _names(down)))
        return _grants(reply[1], reply[2])

    async def quit(self, down: Iterable[str] = ()) -> Grants:
        """This holder leaves: its leases, queued tickets and inbox are given back at once
        (not after the lease TTL), and what that frees is dispatched to the others."""
        reply = _checked(await self._call("quit", _names(down)))
        return _grants(reply[1], reply[2])

    async def throttle(self, pause_s: float, factor: float, recover_per_s: float) -> None:
        """What this holder's ``Throttle`` concluded from its provider's answer, for every
        holder: hold the pool's dispatch for ``pause_s`` (never shortening a pause), and
        dispatch at ``factor`` of its rate at most, growing back by ``recover_per_s`` a
        second from the end of the pause."""
        pause_ms = math.ceil(pause_s * 1000)
        _checked(await self._call("throttle", pause_ms, f"{factor:.17g}", f"{recover_per_s:.17g}"))

    async def view(self) -> tuple[float, list[FlowView]]:
        """The pool's virtual time and every flow Redis tracks, as ``FairQueue`` shows them
        (``/admin/state``, the fair-queue metrics)."""
        v_raw, offset_raw, *rest = [_text(x) for x in _checked(await self._call("view"))]
        v, offset = int(float(v_raw)), int(float(offset_raw))
        flows = []
        for at in range(0, len(rest), 4):
            flow, meter_raw, backlog, capped = rest[at : at + 4]
            meter = int(float(meter_raw))
            lag = (meter - v) / UNITS_PER_COST
            view = FlowView(
                flow, (meter + offset) / UNITS_PER_COST, lag, int(backlog), capped == "0"
            )
            flows.append(view)
        return (v + offset) / UNITS_PER_COST, sorted(flows, key=lambda view: view.flow)

    async def inbox(self, timeout_s: float) -> Grants:
        """Grants of this holder's tickets that another holder's call dispatched: waits up to
        ``timeout_s`` for the first, then takes what else is there."""
        key = self._prefix + "inbox:" + self.holder
        first = await self.redis.blpop([key], timeout=timeout_s)
        if first is None:
            return Grants()
        rest = await self.redis.lpop(key, 1000) or []
        return _grants([first[1], *rest])


def _names(names: Iterable[str]) -> str:
    return json.dumps(list(names)) if names else "[]"


def _checked(reply: Any) -> Any:
    """A reply of a holder Redis does not know (never registered, or reclaimed)."""
    if reply[0] == -1:
        raise Fenced("not registered, or reclaimed")
    return reply


def _per_minute(bucket: TokenBucket | None) -> str:
    return "" if bucket is None else f"{bucket.per_minute:.17g}"


def _text(item: bytes | str) -> str:
    return item.decode() if isinstance(item, bytes) else item


def _grants(raw: Iterable[bytes | str], wake_ms: int = -1) -> Grants:
    """A reply's grants, and its wake time (ms, -1: none)."""
    grants = Grants(wake_s=None if wake_ms < 0 else wake_ms / 1000)
    for item in raw:
        ticket, lease, reason, backend = _text(item).split(" ", 3)
        grants.append(Grant(ticket, lease, backend, cast(Reason, reason)))
    return grants
