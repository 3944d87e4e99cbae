"""Calls to one Redis function on one key, at most one on the way at a time: those made
meanwhile leave together, as one call (group commit)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

Call = tuple[Any, ...]  # an operation and its arguments


class Batcher:
    """Calls to one function on one key (a holder's to its pool, a process's to an org's
    limits): at most one FCALL on the way at a time; the calls made meanwhile leave
    together, as one, when it lands.

    Under load most of a call's cost is the call itself (the round trip, framing on both
    sides, and in dispatch.lua reading the pool's scalars, backends and caps and writing them
    back), not the operation: one call for the dozens of submits and finishes that came while
    the last was on its way pays that once. With one request at a time nothing waits, and
    each call leaves at once. (Two on the way rather than one made twice the calls for the
    same work at 64 connections, and no difference seen at one.) The calls keep their order,
    and a call is sent whether or not its caller still waits for it (a client that left):
    what it changes in Redis is carried out as if it had been sent on its own.

    A call carries at most ``MOST`` operations: Redis runs a call whole, and a burst of
    thousands in one would hold every other replica's calls (their heartbeats too) for as
    long as they take; the rest leave in the next."""

    MOST = 128

    def __init__(self, send: Callable[[list[Call]], Awaitable[list[Any]]]) -> None:
        self._send = send
        self._next: list[tuple[Call, asyncio.Future[Any]]] = []
        self._busy = False  # a call is on its way
        self._sending: set[asyncio.Task[list[Any]]] = set()  # the batch on its way, held

    async def call(self, call: Call) -> Any:
        """``call``'s reply; it raises what its FCALL raised."""
        if self._busy:
            reply = asyncio.get_running_loop().create_future()
            self._next.append((call, reply))
            return await reply
        self._busy = True  # nothing on the way: it leaves at once, from this task
        try:
            return (await self._send([call]))[0]
        finally:
            self._send_next()

    def _send_next(self) -> None:
        self._busy = bool(self._next)
        if not self._busy:
            return
        batch, self._next = self._next[: self.MOST], self._next[self.MOST :]
        batched = [call for call, _ in batch]
        sending: asyncio.Task[list[Any]] = asyncio.ensure_future(self._send(batched))
        self._sending.add(sending)
        sending.add_done_callback(functools.partial(self._landed, batch))

    def _landed(
        self, batch: list[tuple[Call, asyncio.Future[Any]]], sent: asyncio.Future[Any]
    ) -> None:
        self._sending.discard(sent)
        for at, (_, reply) in enumerate(batch):
            if reply.done():  # its caller left
                continue
            if sent.cancelled():  # the loop ends
                reply.cancel()
            elif (error := sent.exception()) is not None:
                reply.set_exception(error)
            else:
                reply.set_result(sent.result()[at])
        self._send_next()
