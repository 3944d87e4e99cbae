"""A backend that paces its stream: each SSE event its own write, a fixed pause apart.

    python bench/paced_backend.py PORT [--events 200] [--pause-ms 1]

nginx sends a stored stream in one burst, so a proxy relays it in a few large chunks; a
model server writes one event per token. This server does that with as little CPU of its
own as it can (a raw asyncio protocol on uvloop, every byte built before it starts: ~12–18
µs per event), so that what a proxy in front of it spends per event can be measured: it
answers any POST with a 200 stream of ``--events`` chat-completion chunks, a usage chunk
and ``[DONE]``, each written and drained on its own, ``--pause-ms`` apart; ``GET /health``
gets a 200. Keep-alive; the request's body is read and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import uvloop

HEADERS = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"
)
HEALTH = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: keep-alive\r\n\r\n"


def events(count: int) -> list[bytes]:
    """The stream's events, each an HTTP chunk ready to write; the last is the chunked end."""

    def event(data: dict[str, object]) -> bytes:
        line = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
        return b"%x\r\n%s\r\n" % (len(line), line)

    head = {"id": "chatcmpl-paced", "object": "chat.completion.chunk", "created": 0,
            "model": "bench-paced"}  # fmt: skip

    def chunk(delta: dict[str, str], finish: str | None = None) -> bytes:
        return event({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    usage = {"prompt_tokens": 42, "completion_tokens": count, "total_tokens": 42 + count}
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"content": f" tok{i}"}) for i in range(count - 2)]
    out.append(chunk({"content": " end"}, "stop"))
    out.append(event({**head, "choices": [], "usage": usage}))
    done = b"data: [DONE]\n\n"
    out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    return out


class Paced(asyncio.Protocol):
    def __init__(self, stream: list[bytes], pause_s: float) -> None:
        self.stream, self.pause_s = stream, pause_s
        self.buffer = b""
        self.busy: asyncio.Task[None] | None = None
        self.drained = asyncio.Event()
        self.drained.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.drained.clear()

    def resume_writing(self) -> None:
        self.drained.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.busy is not None:
            self.busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.busy is None or self.busy.done():
            self.busy = asyncio.ensure_future(self.serve())

    async def serve(self) -> None:
        """Answer each whole request in the buffer, in order (keep-alive)."""
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            head = self.buffer[:end].lower()
            length = 0
            for line in head.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if len(self.buffer) < end + 4 + length:
                return  # the rest of the body has not come yet
            self.buffer = self.buffer[end + 4 + length :]
            if head.startswith(b"get"):
                self.transport.write(HEALTH)
                continue
            self.transport.write(HEADERS)
            for piece in self.stream:
                self.transport.write(piece)
                await self.drained.wait()
                await asyncio.sleep(self.pause_s)


async def main(port: int, count: int, pause_ms: float) -> None:
    stream = events(count)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Paced(stream, pause_ms / 1000), "127.0.0.1", port, backlog=4096
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--pause-ms", type=float, default=1.0)
    args = parser.parse_args()
    uvloop.run(main(args.port, args.events, args.pause_ms))
