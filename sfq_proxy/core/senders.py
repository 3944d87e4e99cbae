"""What a client may hold before its request is read: connections, and the time its body
takes (docs/design.md §6, Slow senders).

Sans-I/O. :class:`Connections` keeps a process's open client connections within a total
and a cap per peer address; :func:`body_due` says by when a body being read must be whole.

**Connections.** A connection is *idle* while it serves no request: just accepted and
still sending its first request's head, or kept alive between requests. One that would go
beyond a cap takes the place of the connection idle the longest (of its own peer, at the
peer's cap), which the shell closes; when every connection in the way is serving a request,
it is refused (the shell closes it at once). So connections that only trickle their
headers, however many and from however many addresses, never keep an honest client out:
its connection sends its head at once and is then serving a request, which nothing closes,
while the trickling ones are the oldest idle ones. A request being served holds its
connection until it ends, as it must: those are bounded by what admits requests (keys,
rates, queues, the queue memory, the body's pace).

Why close rather than answer 503: at a cap it is file descriptors that are short, and an
answer would keep the connection open until its request had been read (closing a socket
with unread bytes resets it, and the answer is lost with it), which is what a cap must not
do for a client that sends slowly. A refused client sees a connection error, which the
OpenAI SDKs retry as they retry a 503.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

C = TypeVar("C", bound=Hashable)


class Connections(Generic[C]):
    """The open connections, each with its peer (an address, or the network of one), within
    ``total`` and ``per_peer``; a caller may change either at any time (newcomers see it,
    nothing is closed for it)."""

    def __init__(self, total: int, per_peer: int) -> None:
        if total <= 0 or per_peer <= 0:
            raise ValueError("the caps must be positive")
        self.total = total
        self.per_peer = per_peer
        self._peer: dict[C, str] = {}  # every open connection → its peer
        self._count: dict[str, int] = {}  # peer → its open connections
        self._idle: OrderedDict[C, None] = OrderedDict()  # idle the longest first
        self._idle_of: dict[str, OrderedDict[C, None]] = {}  # the same, per peer

    def open(self, conn: C, peer: str) -> list[C] | None:
        """A new connection of ``peer``: counted (idle) and returned the connections that
        leave the count to make room, for the shell to close; or None, nothing counted,
        when only connections serving a request are in the way (the shell refuses it)."""
        if conn in self._peer:
            raise ValueError("this connection is counted already")
        victims: list[C] = []
        over = self._count.get(peer, 0) + 1 - self.per_peer
        if over > 0:  # its own idle ones make room, the oldest first
            idle = self._idle_of.get(peer)
            victims += [] if idle is None else _oldest(idle, over, ())
            if len(victims) < over:
                return None
        over = len(self._peer) + 1 - len(victims) - self.total
        if over > 0:
            more = _oldest(self._idle, over, victims)
            if len(more) < over:
                return None
            victims += more
        for victim in victims:
            self.close(victim)
        self._peer[conn] = peer
        self._count[peer] = self._count.get(peer, 0) + 1
        self.idle(conn)
        return victims

    def busy(self, conn: C) -> None:
        """``conn`` serves a request: nothing closes it to make room."""
        if conn not in self._idle:
            return
        del self._idle[conn]
        peer = self._peer[conn]
        idle = self._idle_of[peer]
        del idle[conn]
        if not idle:
            del self._idle_of[peer]

    def idle(self, conn: C) -> None:
        """``conn`` serves no request (any more): the newest idle one."""
        peer = self._peer.get(conn)
        if peer is not None and conn not in self._idle:
            self._idle[conn] = None
            self._idle_of.setdefault(peer, OrderedDict())[conn] = None

    def close(self, conn: C) -> None:
        """``conn`` is closed (or about to be): it counts no more. Nothing if not counted."""
        self.busy(conn)
        peer = self._peer.pop(conn, None)
        if peer is None:
            return
        left = self._count[peer] - 1
        if left:
            self._count[peer] = left
        else:
            del self._count[peer]

    def __len__(self) -> int:
        """How many connections are open."""
        return len(self._peer)

    def of(self, peer: str) -> int:
        """How many connections ``peer`` has open."""
        return self._count.get(peer, 0)

    def idle_count(self) -> int:
        """How many of them serve no request."""
        return len(self._idle)


def _oldest(idle: OrderedDict[C, None], n: int, taken: list[C] | tuple[()]) -> list[C]:
    """The ``n`` connections of ``idle`` idle the longest, not in ``taken`` (fewer if there
    are not enough)."""
    found: list[C] = []
    for conn in idle:
        if len(found) == n:
            break
        if conn not in taken:
            found.append(conn)
    return found


def body_due(received: int, timeout_s: float, grace_s: float, min_bytes_per_s: float) -> float:
    """By when, in seconds from the start of its read, a body of which ``received`` bytes
    are in must be whole: ``grace_s``, and a second more for every ``min_bytes_per_s``
    bytes in, never beyond ``timeout_s`` (``min_bytes_per_s`` 0: ``timeout_s`` alone). A
    body that keeps arriving at that rate is never cut before ``timeout_s``; one that
    stalls is cut as soon as what it sent no longer pays for its time."""
    if min_bytes_per_s <= 0:
        return timeout_s
    return min(timeout_s, grace_s + received / min_bytes_per_s)


def connection_caps(
    max_connections: int | None, per_peer: int | None, fds: int, reserve: int, ceiling: int
) -> tuple[int, int, str | None]:
    """The caps in force, and a warning for the operator, if any.

    The total: ``max_connections``, or (None) what ``fds`` open files (``ulimit -n``) allow
    once ``reserve`` are kept for everything but clients, at most ``ceiling``; never more
    than those files allow (a quarter of them, when the reserve would leave less). Per peer:
    ``per_peer``, or (None) half the total; never more than the total.
    """
    room = fds - reserve
    warning = None
    if room < fds // 4:
        room = max(1, fds // 4)
        warning = (
            f"the limit of {fds} open files (ulimit -n) leaves little room for clients once "
            f"{reserve} are kept for the backends and the rest: {room} client connections "
            "at most; raise it"
        )
    if max_connections is None:
        total = min(room, ceiling)
    elif max_connections > room:
        total = room
        warning = (
            f"limits.max_connections {max_connections} is more than the limit of {fds} open "
            f"files (ulimit -n) allows once {reserve} are kept for the backends and the rest: "
            f"{room} in force; raise the limit"
        )
    else:
        total = max_connections
    peer = max(1, total // 2) if per_peer is None else min(per_peer, total)
    return total, peer, warning
