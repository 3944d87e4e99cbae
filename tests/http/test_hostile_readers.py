"""No client can hold what others need (docs/design.md §5, Relay): clients that never read
their answers, on raw sockets with a 4 KB receive buffer, in front of a real proxy and a
simulated backend.

The slot (and the backend's connection) is given back as soon as the backend is done,
whatever the client's reading speed: the rest of the answer waits in the proxy, up to
``limits.answer_buffer_mb``, for a client that takes a byte at least every
``timeouts.client_write_s``; a client that does not is cut, and still pays for the work.
A client that leaves a JSON request before its answer pays its estimate at least.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from proxy_lab import (
    KEYS,
    MODEL,
    AccessLines,
    Lab,
    Served,
    eventually,
    leftovers,
    proxy_config,
    scrape,
)
from proxy_lab import sample as metric

from sfq_proxy.sim.server import SimBackend
from sfq_proxy.sim.settings import RequestRecord

CHAT = [{"role": "user", "content": "tell me everything"}]
LONG = 20_000  # tokens of a cheater's answer: ~4 MB of events, far beyond any socket buffer
RATE = 10_000.0  # tokens a second, each sequence: a cheater's answer takes the backend 2 s
FLOW_A = {"org": "A", "class": "batch", "pool": "sim"}
ESTABLISHED = 1  # Linux's TCP states (include/net/tcp_states.h)


async def backend(lab: Lab) -> SimBackend:
    return await lab.backend(
        time_scale=1.0, decode_tokens_per_s=RATE, batch_slowdown=0.0, max_model_len=65536
    )


def served_config(sim: SimBackend, client_write_s: float, answer_buffer_mb: int = 64) -> Any:
    timeouts = {"connect_s": 1, "first_byte_s": 10, "client_write_s": client_write_s}
    return proxy_config(
        [sim.url],
        slots=4,
        pool={"timeouts": timeouts},
        limits={"answer_buffer_mb": answer_buffer_mb},
    )


class NeverReads:
    """A client that sends its request and never reads a byte of the answer: a raw socket
    whose receive buffer is 4 KB, so that the kernel holds almost nothing for it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def send(
        cls, served: Served, body: dict[str, Any], org: str = "A", rcvbuf: int = 4096
    ) -> NeverReads:
        host, port = served.url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (host, int(port)))
        payload = json.dumps(body).encode()
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
            f"Authorization: Bearer {KEYS[org]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        await loop.sock_sendall(sock, head.encode() + payload)
        return cls(sock)

    def open(self) -> bool:
        """Whether the proxy has neither closed nor reset the connection: its TCP state, read
        without taking a byte (reading would make the client one that reads)."""
        return self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == ESTABLISHED

    async def cut(self, within: float) -> bool:
        """Whether the proxy closed or reset the connection within ``within`` seconds."""
        for _ in range(round(within / 0.01)):
            if not self.open():
                return True
            await asyncio.sleep(0.01)
        return not self.open()

    def close(self) -> None:
        self.sock.close()


def stream(tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": CHAT, "max_tokens": tokens, "stream": True, "user": "A"}


def records(sim: SimBackend, user: str) -> list[RequestRecord]:
    return [r for r in sim.stats.log if r.user == user]


async def honest_requests(lab: Lab, served: Served, count: int) -> list[float]:
    """``count`` small JSON requests of org B at once; when each one's answer came."""
    client = lab.client(served, "B")
    done: list[float] = []

    async def one() -> None:
        await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, user="B")
        done.append(time.monotonic())

    await asyncio.gather(*(one() for _ in range(count)))
    return done


async def test_clients_that_never_read_hold_no_slot_once_the_backend_is_done(
    lab: Lab, access_log: AccessLines
) -> None:
    """Four streams whose clients never read fill a 4-slot pool; the backend generates their
    answers in 2 s whatever the clients do, the honest tenant's requests are served at once
    after, and the cheaters are cut ``client_write_s`` later, billed what the backend did."""
    sim = await backend(lab)
    served = await lab.proxy(served_config(sim, client_write_s=5))
    cheaters = [await NeverReads.send(served, stream(LONG)) for _ in range(4)]
    try:
        await eventually(lambda: sim.stats.running == 4, within=5)
        honest = asyncio.create_task(honest_requests(lab, served, 4))
        # on main: the proxy stops reading the backend once the clients' buffers are
        # full, so the simulated backend (blocked on its writes) never finishes
        await eventually(lambda: all(r.ended_at for r in records(sim, "A")), within=10)
        finished = max(r.ended_at or 0.0 for r in records(sim, "A"))
        done = await asyncio.wait_for(honest, 5)
        assert max(done) - finished < 1.0
        assert [r.completion_tokens for r in records(sim, "A")] == [LONG] * 4
        assert all(c.open() for c in cheaters)  # not yet: 5 s after it took its last byte
        await eventually(lambda: not any(c.open() for c in cheaters), within=10)
    finally:
        for cheater in cheaters:
            cheater.close()
    await eventually(lambda: not leftovers(served))

    async def cheaters_settled() -> bool:
        return len([line for line in await access_log() if line["org"] == "A"]) == 4

    await eventually(cheaters_settled)
    lines = [line for line in await access_log() if line["org"] == "A"]
    for line in lines:  # cut, and billed what the backend reported
        assert (line["outcome"], line["reason"]) == ("failed", "client_timeout")
        assert line["completion_tokens"] == LONG
        assert line["prompt_tokens"] == records(sim, "A")[0].prompt_tokens
    got = await scrape(lab, served)
    assert metric(got, "sfq_failures_total", **FLOW_A, reason="client_timeout") == 4
    assert metric(got, "sfq_completion_tokens_total", **FLOW_A) == 4 * LONG
    assert served.state.usage is not None
    (row,) = [c for k, c in await served.state.usage.rows(0, 1 << 40) if k[1] == "A"]
    assert (row.requests, row.completion_tokens) == (4, 4 * LONG)


async def test_a_slow_reader_that_reads_is_not_cut_and_holds_no_slot(
    lab: Lab, access_log: AccessLines
) -> None:
    """A client that reads nothing for 2 s, while the proxy holds what the kernel's buffers
    do not, then reads in small bites (8 KB), gets its whole answer: a client is cut for
    taking nothing for ``client_write_s``, never for taking its time. The slot was free as
    soon as the backend was done, before the client was."""
    sim = await backend(lab)
    served = await lab.proxy(served_config(sim, client_write_s=3))
    reader = await NeverReads.send(served, stream(LONG))
    loop = asyncio.get_running_loop()
    await asyncio.sleep(2)  # the kernel's buffers fill up, then the proxy's
    answer = bytearray()
    freed_while_reading = False
    while not answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # its last chunk
        chunk = await asyncio.wait_for(loop.sock_recv(reader.sock, 8192), 5)
        assert chunk, "cut"
        answer += chunk
        freed_while_reading |= not leftovers(served)
        await asyncio.sleep(0.001)
    reader.close()
    (rec,) = records(sim, "A")
    assert rec.completion_tokens == LONG
    assert freed_while_reading
    assert answer.count(b'"content"') == LONG + 1  # the role's event, then every token

    async def settled() -> bool:
        return len(await access_log()) == 1

    await eventually(settled)
    (line,) = await access_log()
    assert (line["outcome"], line["completion_tokens"]) == ("completed", LONG)


async def test_a_client_that_reads_nothing_while_the_backend_works_is_cut(
    lab: Lab, access_log: AccessLines
) -> None:
    """A stream that would take the backend 6 s: its client, which reads nothing, is cut
    after ``client_write_s``; the backend stops there, and the slot serves the next request.
    No usage came: it pays its estimate (its prompt as estimated and its max_tokens)."""
    sim = await backend(lab)
    served = await lab.proxy(served_config(sim, client_write_s=1))
    cheater = await NeverReads.send(served, stream(3 * LONG))
    try:
        await eventually(lambda: sim.stats.running == 1, within=5)
        started = time.monotonic()
        assert await cheater.cut(within=6)
        # 1 s after the kernel's buffers (up to 4 MB on loopback) stopped taking its bytes
        assert 1.0 <= time.monotonic() - started < 6
    finally:
        cheater.close()
    await eventually(lambda: not leftovers(served))
    (rec,) = records(sim, "A")
    await eventually(lambda: rec.outcome == "aborted")
    assert rec.completion_tokens < 3 * LONG
    (line,) = await access_log()
    assert (line["outcome"], line["reason"]) == ("failed", "client_timeout")
    assert line["completion_tokens"] == 3 * LONG  # its estimate: max_tokens, ratio 1
    assert line["prompt_tokens"] >= 1


async def test_an_answer_beyond_the_buffer_cuts_its_client(
    lab: Lab, access_log: AccessLines
) -> None:
    """A client that falls more than ``answer_buffer_mb`` behind is cut at once, and the
    backend stops: the proxy holds no more of an answer than that for anyone."""
    sim = await backend(lab)
    served = await lab.proxy(served_config(sim, client_write_s=30, answer_buffer_mb=1))
    cheater = await NeverReads.send(served, stream(LONG))
    try:
        assert await cheater.cut(within=5)
    finally:
        cheater.close()
    await eventually(lambda: not leftovers(served))
    (rec,) = records(sim, "A")
    await eventually(lambda: rec.outcome == "aborted")
    (line,) = await access_log()
    assert (line["outcome"], line["reason"]) == ("failed", "client_too_slow")
    assert line["completion_tokens"] == LONG  # its estimate, as nothing was reported


async def big_json_backend(lab: Lab, size: int) -> str:
    """A backend whose every answer is a chat completion of ``size`` characters (larger
    than every socket buffer on the way), with its usage."""

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        message = {"role": "assistant", "content": "x" * size}
        return web.json_response({
            "id": "big", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": size // 4},
        })  # fmt: skip

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/health", health)])
    return f"http://127.0.0.1:{await lab.serve(app)}"


@pytest.mark.parametrize(("max_tokens", "billed"), [(100, 4 << 20), (6_000_000, 6_000_000)])
async def test_a_json_answer_its_client_does_not_take_is_cut_too(
    lab: Lab, access_log: AccessLines, max_tokens: int, billed: int
) -> None:
    """A whole (JSON) answer larger than the socket buffers, to a client that reads nothing:
    the connection is cut after ``client_write_s``, the request billed what was reported,
    and its estimate at least (max_tokens × the output ratio, 1 here): leaving, or being
    cut, never lowers a bill."""
    url = await big_json_backend(lab, 16 << 20)
    timeouts = {"connect_s": 1, "first_byte_s": 10, "client_write_s": 1}
    pool = {"timeouts": timeouts, "cost": {"max_request_tokens": 8_000_000}}
    served = await lab.proxy(proxy_config([url], pool=pool))
    body = {"model": MODEL, "messages": CHAT, "max_tokens": max_tokens, "user": "A"}
    cheater = await NeverReads.send(served, body)
    try:
        assert await cheater.cut(within=8)
    finally:
        cheater.close()

    async def settled() -> bool:
        return len(await access_log()) == 1

    await eventually(settled)
    (line,) = await access_log()
    assert (line["outcome"], line["reason"]) == ("failed", "client_timeout")
    assert (line["prompt_tokens"], line["completion_tokens"]) == (7, billed)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_leaves_pays_its_estimate_at_least(
    lab: Lab, access_log: AccessLines, stream: bool
) -> None:
    """The issue's row: a client hangs up 1.8 s into a 2 s answer (the backend generated
    ~18,000 tokens). It was billed its prompt and no completion; now its estimate at least:
    the prompt as estimated and max_tokens × the output ratio (1 here), in the access log,
    the usage book and its budget."""
    sim = await backend(lab)
    served = await lab.proxy(served_config(sim, client_write_s=30))
    http = await lab.http()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": LONG, "stream": stream, "user": "A"}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}

    async def leave_after_1_8_s() -> None:
        async with http.post(
            f"{served.url}/v1/chat/completions", json=body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=1.8),
        ) as answer:  # fmt: skip
            await answer.read()  # a stream's events as they come, or the whole body

    with pytest.raises(TimeoutError):
        await leave_after_1_8_s()
    await eventually(lambda: not leftovers(served))
    (rec,) = records(sim, "A")
    await eventually(lambda: rec.outcome == "aborted")
    assert 0 < rec.completion_tokens < LONG  # ~16,000 in 1.8 s, on an idle machine
    (line,) = await access_log()
    assert line["outcome"] == "cancelled_running"
    assert line["completion_tokens"] >= rec.completion_tokens
    assert line["completion_tokens"] == LONG
    assert line["prompt_tokens"] >= 1
    assert served.state.usage is not None
    (row,) = [c for _, c in await served.state.usage.rows(0, 1 << 40)]
    assert (row.prompt_tokens, row.completion_tokens) == (line["prompt_tokens"], LONG)
