"""A request's body, read in time and within the process's queue memory (docs/design.md §6,
Slow senders and Queue memory).

A body that has arrived whole by the time its handler reads it (most: a small body comes
with its head) is taken as it is. Any other is read as it arrives:

- **within the queue memory**: its bytes are counted as they come, with the 16 KiB of a
  request, its org's bodies being read forming one flow of the process's
  :class:`~sfq_proxy.core.queue_memory.QueueMemory`, beside the flows waiting in line. A
  body that would go beyond the bound takes the place of the largest flows' newest
  requests (a waiting one, or a body being read, which is cut), or, its org's bodies being
  the largest, is refused: 429 ``queue_full``, as a request joining its line is. It counts
  until it is whole, and then when it joins its line;
- **in time**: whole within ``limits.body_timeout_s``, and past ``limits.body_grace_s`` at
  ``limits.min_body_kib_per_s`` at least (:func:`~sfq_proxy.core.senders.body_due`),
  else 408 ``request_timeout``. One timer a body, which looks at what came only when it
  fires, and fires again later if that was enough: nothing is done per chunk but count it.

Either cut wakes the read by cancelling its task, and the cancellation becomes the answer
here; any other (the client left, the drain) goes on as it came.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import Any

from aiohttp import web

from ..config import Limits
from ..core.errors import ApiError
from ..core.queue_memory import RETRY_AFTER_S
from ..core.senders import body_due
from ..state.pool import Memory

KIB = 1024
# what aiohttp may hold of a body ahead of its read: its buffer (twice ``read_bufsize``,
# 64 KiB) and one read from the socket past it (uvloop's, 250 KB). A body being read counts
# it from its first bytes, so what the process really holds stays within the bound
READ_AHEAD = 2 * 64 * KIB + 256_000


class Reading:
    """A body being read: an item of the queue memory, which a cut ends early."""

    __slots__ = ("cut", "received", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.received = 0
        self.cut: ApiError | None = None

    def end(self, error: ApiError) -> None:
        """Stop the read: its task is cancelled, and the read answers ``error``."""
        if self.cut is None:
            self.cut = error
            self.task.cancel()


class _Readers:
    """Where the bodies being read are, for the queue memory: it evicts them from here."""

    def evict(self, reading: Reading) -> None:
        reading.end(_evicted())


READERS = _Readers()


class _Pace:
    """The body's deadline (``body_due`` of what came), checked when it passes."""

    __slots__ = ("_handle", "_limits", "_loop", "_reading", "_start")

    def __init__(self, loop: asyncio.AbstractEventLoop, reading: Reading, limits: Limits) -> None:
        self._loop, self._reading, self._limits = loop, reading, limits
        self._start = loop.time()
        self._handle = loop.call_at(self._due(), self._check)

    def _due(self) -> float:
        limits = self._limits
        return self._start + body_due(
            self._reading.received, limits.body_timeout_s, limits.body_grace_s,
            limits.min_body_kib_per_s * KIB,
        )  # fmt: skip

    def _check(self) -> None:
        due = self._due()
        if self._loop.time() >= due:
            self._reading.end(_too_slow(self._limits))
        else:  # what came since pays for more time
            self._handle = self._loop.call_at(due, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


async def read(request: web.Request, limits: Limits, memory: Memory, org: str) -> bytes:
    """``request``'s body as sent, ``org``'s (the key's); raises the ApiError that answers
    it when it is too large (413), too slow (408) or does not fit (429). (A body not framed
    as its headers say is aiohttp's 400, ``connections.py``: its parser stops there.)"""
    payload = request.content
    if payload.is_eof():  # whole already (or none): most requests
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(limits.max_body_bytes) from None
    task = asyncio.current_task()
    assert task is not None
    reading = Reading(task)
    flow = ("", org, READERS)  # "": no pool's name is empty
    pace = _Pace(asyncio.get_running_loop(), reading, limits)
    cancelling = task.cancelling()
    chunks: list[bytes] = []
    try:
        while chunk := await payload.readany():
            reading.received += len(chunk)
            if reading.received > limits.max_body_bytes:
                raise too_large(limits.max_body_bytes)
            more = len(chunk) if chunks else READ_AHEAD + len(chunk)
            try:
                victims = memory.grow(flow, reading, more)
            except ApiError:
                raise _full() from None
            for (_, _, holder), victim in victims:
                holder.evict(victim)
            chunks.append(chunk)
        return b"".join(chunks)
    except asyncio.CancelledError:
        # a cut comes from a timer or another request's task, so while this one waits for
        # bytes: its cancellation is raised by that wait, never after the loop
        cut, reading.cut = reading.cut, None  # raised, it would hold this frame in a cycle
        if cut is not None and task.uncancel() <= cancelling:
            try:
                raise cut from None
            finally:  # its traceback holds this frame: the frame must not hold it back
                cut = None
        raise
    finally:
        chunks.clear()  # whatever holds this frame (an error's traceback) holds no body
        pace.cancel()
        memory.leave(flow, reading)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The body is larger than the {limit} bytes allowed.")


@lru_cache(maxsize=16)
def _slowness(timeout_s: float, grace_s: float, kib_per_s: float) -> str:
    rate = f", and after {grace_s:g} s at {kib_per_s:g} KiB/s at least" if kib_per_s else ""
    return (
        f"The request's body came too slowly: it must be whole within {timeout_s:g} s{rate} "
        "(limits.body_timeout_s, body_grace_s, min_body_kib_per_s)."
    )


def _too_slow(limits: Limits) -> ApiError:
    message = _slowness(limits.body_timeout_s, limits.body_grace_s, limits.min_body_kib_per_s)
    return ApiError(408, message, code="request_timeout")


def _full() -> ApiError:
    return ApiError(
        429, "The proxy's queue memory is full and the bodies your org is sending hold the "
        "largest part of it; retry later.", code="queue_full", retry_after=RETRY_AFTER_S,
    )  # fmt: skip


def _evicted() -> ApiError:
    return ApiError(
        429, "The proxy's queue memory is full and the bodies your org is sending hold the "
        "largest part of it: this one gave its place to a smaller flow's request; retry later.",
        code="queue_full", retry_after=RETRY_AFTER_S,
    )  # fmt: skip
