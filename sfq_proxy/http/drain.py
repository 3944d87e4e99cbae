"""The drain: what SIGTERM does to the requests of a process (docs/design.md §8, Lifecycle).

The inference handlers register here while they run. When the drain begins nothing new
joins a line; at ``drain_timeout_s`` the handlers still running are *cut*: their tasks are
cancelled with ``CUT`` as the message, which the relay turns into an error event ending a
stream that has started (``absorbed``), and the handler into a 503 ``shutting_down`` for an
answer that has not. Any other cancellation (a client that left) is not a cut.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from ..core.errors import ApiError

CUT = "sfq-proxy: drain_timeout_s passed"
CUT_GRACE_S = 0.2  # the requests cut at drain_timeout_s: to write their end and return
# set on a request once its answer starts (a stream's headers): a cut can then only end it
# there (the relay's error event) or close its connection, never answer it again
ANSWERING = web.RequestKey("sfq_answering", bool)
CUT_MESSAGE = (
    "The proxy is shutting down and its drain_timeout_s passed before this request's end; "
    "retry the request."
)


class Drain:
    """The inference handlers running in a process, and whether it drains."""

    def __init__(self) -> None:
        self.draining = False
        self._running: set[asyncio.Task[object]] = set()
        self._idle: asyncio.Event | None = None  # made when the drain begins, in its loop

    def enter(self) -> asyncio.Task[object] | None:
        """A handler starts: its task is cut if it still runs at the drain's deadline."""
        task = asyncio.current_task()
        if task is not None:
            self._running.add(task)
        return task

    def exit(self, task: asyncio.Task[object] | None) -> None:
        """The handler ended, whatever its outcome."""
        self._running.discard(task)
        if not self._running and self._idle is not None:
            self._idle.set()

    def __len__(self) -> int:
        return len(self._running)

    def begin(self) -> None:
        self.draining = True
        self._idle = asyncio.Event()
        if not self._running:
            self._idle.set()

    async def finished(self, within_s: float) -> bool:
        """Whether every handler ended within ``within_s`` seconds."""
        if self._idle is None:
            self.begin()
        assert self._idle is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, within_s)):
                await self._idle.wait()
        return self._idle.is_set()

    def cut(self) -> int:
        """End every handler still running; returns how many."""
        running = list(self._running)
        for task in running:
            task.cancel(CUT)
        return len(running)


def is_cut(error: BaseException) -> bool:
    """Whether ``error`` is the drain's cut of the current task."""
    return isinstance(error, asyncio.CancelledError) and error.args[:1] == (CUT,)


def absorbed(error: BaseException) -> bool:
    """The drain's cut, caught where the answer can still end properly: the task goes on as
    if it had not been cancelled. False (and nothing done) for any other cancellation."""
    if not is_cut(error):
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


def cut_error() -> ApiError:
    """A request the drain ended before its answer started."""
    return ApiError(503, CUT_MESSAGE, code="shutting_down", retry_after=1.0)
