"""A TCP relay that can hold back what one side sends: a replica's link to its primary made
slow at will, for the tests of what a failover loses. Threads, not the test's event loop,
carry it: a replica's link must keep flowing while a fixture waits on it synchronously."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from server_process import free_port


class LagRelay:
    """Listens on a loopback ``port`` and relays each connection to ``target_port``. hold()
    stops passing on what the target sends (the replica falls behind, as over a congested
    link; what it sends still goes through, so the primary hears its acknowledgements of
    what it has); cut() drops what was held and closes every connection, as the target's
    death does."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._held = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def hold(self) -> None:
        self._held.set()

    def cut(self) -> None:
        for sock in [self._listener, *self._sockets]:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._listener = None

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):  # closed by cut()
            while True:
                near, _ = listener.accept()
                far = socket.create_connection(("127.0.0.1", self.target_port))
                self._sockets += [near, far]
                threading.Thread(target=self._pass, args=(near, far, False), daemon=True).start()
                threading.Thread(target=self._pass, args=(far, near, True), daemon=True).start()

    def _pass(self, source: socket.socket, sink: socket.socket, holdable: bool) -> None:
        with contextlib.suppress(OSError):
            while True:
                if holdable and self._held.is_set():
                    time.sleep(0.01)  # left in the kernel's buffers, lost when cut
                    continue
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
