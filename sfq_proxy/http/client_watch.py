"""The client of an answer, written to without waiting for it to read (docs/design.md §5,
Relay): the backend is read, and let go, at its own pace, and a client that falls too far
behind, or takes nothing for too long, is cut. The relay (``relay.py``) writes; this watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import sys
import termios

from aiohttp import web
from aiohttp.http_writer import StreamWriter

log = logging.getLogger(__name__)
# why the proxy cut a client that did not take its answer (``client_timeout``: no byte for
# ``timeouts.client_write_s``; ``client_too_slow``: more than ``limits.answer_buffer_mb``
# behind), on its request: the handler then bills it as a client that left (handler.py)
CLIENT_CUT = web.RequestKey("sfq_client_cut", str)
_LOOKS = 4  # looks per client_write_s at a client that is behind: cut within 1.25 × of it
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # SIOCOUTQ on a TCP socket (Linux)


class ClientCut(ConnectionResetError):
    """The proxy cut a client that fell too far behind its answer (``CLIENT_CUT``)."""


class ClientWatch:
    """An answer's client, which the proxy writes to without waiting for it to read.

    What the client has not taken yet waits in its connection (the transport's buffer), so
    the backend is read, and let go, at its own pace: the slot never waits for a client.
    That costs memory, so the client is **cut** when it is more than ``bound`` bytes
    behind (``client_too_slow``), or takes no byte for ``write_s`` seconds while some wait
    for it (``client_timeout``). Cut, its connection is reset: it reads nothing, so nothing
    more can reach it, and the bytes it did not take are dropped. Its handler then ends
    as a client that left does (aiohttp cancels it): ``CLIENT_CUT`` on the request says why.

    Nothing is done for a client that keeps up (the usual: the kernel takes every write):
    one look at the buffer's size after a write. Behind, one timer looks at it
    ``_LOOKS`` times per ``write_s`` until it is empty or the client is cut; the timer
    outlives the handler (the end of an answer a client has not taken yet is watched too).
    """

    __slots__ = (
        "_bound",
        "_fd",
        "_request",
        "_still",
        "_taken",
        "_timer",
        "_transport",
        "_write_s",
        "writer",
    )  # fmt: skip

    def __init__(
        self, request: web.Request, writer: StreamWriter, write_s: float, bound: float
    ) -> None:
        transport = request.transport
        if transport is None:  # it left this instant: its handler is being cancelled
            raise ConnectionResetError("the client left")
        self._request, self._transport, self.writer = request, transport, writer
        self._write_s, self._bound = write_s, bound
        self._timer: asyncio.TimerHandle | None = None
        self._fd = -1  # its socket's, once it is watched
        self._taken = 0  # the bytes the client had taken at the last look
        self._still = 0  # looks in a row that found it had taken nothing more

    def wrote(self) -> None:
        """After a write: watched while its connection holds bytes it has not taken."""
        held = self._transport.get_write_buffer_size()
        if held:
            if held > self._bound:
                self.cut("client_too_slow")
                raise ClientCut(f"the client is more than {self._bound:.0f} bytes behind")
            if self._timer is None:
                self.watch(held)

    def watch(self, held: int | None = None) -> None:
        """Look at the client from now on, until it has taken everything or is cut;
        ``held``: what its connection holds now (None: unknown yet, the first look counts
        as progress)."""
        if self._timer is None:
            if self._fd < 0:
                sock = self._transport.get_extra_info("socket")
                self._fd = -1 if sock is None else sock.fileno()
            self._taken = -1 if held is None else self._taken_with(held)
            self._still = 0
            self._timer = asyncio.get_running_loop().call_later(self._step(), self._look)

    def _taken_with(self, held: int) -> int:
        """The bytes the client has taken: all written, less what its connection holds and
        what the kernel sent it but it has not acknowledged (a TCP window opens as the
        client reads; the kernel's buffer, megabytes, would hide a slow reader's reading
        until half of it was free, the kernel waking a writer only then)."""
        return self.writer.output_size - held - _unacknowledged(self._fd)

    def _step(self) -> float:
        return self._write_s / _LOOKS

    def _look(self) -> None:
        self._timer = None
        transport = self._transport
        held = transport.get_write_buffer_size()
        if not held or transport.is_closing():  # it caught up, or is gone
            return
        taken = self._taken_with(held)
        if taken != self._taken:
            self._taken, self._still = taken, 0
        else:
            self._still += 1
            if self._still >= _LOOKS:
                self.cut("client_timeout")
                return
        self._timer = asyncio.get_running_loop().call_later(self._step(), self._look)

    def cut(self, why: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._request[CLIENT_CUT] = why
        log.debug("a client was cut (%s): %d bytes of its answer not taken", why,
                  self._transport.get_write_buffer_size())  # fmt: skip
        sock = self._transport.get_extra_info("socket")
        if sock is not None:  # reset, not closed: else the kernel would go on holding what
            with contextlib.suppress(OSError):  # it took and the client did not, a FIN last
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self._transport.abort()


def _unacknowledged(fd: int) -> int:
    """What the kernel holds of a connection's bytes that its peer has not acknowledged
    (Linux's SIOCOUTQ); 0 where that is not known."""
    if fd < 0 or _OUTQ is None:
        return 0
    try:
        return int.from_bytes(fcntl.ioctl(fd, _OUTQ, bytes(4)), sys.byteorder, signed=True)
    except OSError:
        return 0
