"""Slow senders cannot take what other clients need (docs/design.md §6, Slow senders): a real
``sfq-proxy serve`` process under ``ulimit -n 1024`` is attacked at once by 1,100
connections that send their headers one byte every 10 s, from 11 addresses, and by 60
uploads of an authenticated org that declare 10 MiB and stall after 10 MiB - 1 bytes. Both
come back as soon as they are shed, for as long as the attack lasts. Meanwhile an honest
org sends ordinary requests through the SDK: at least 95 % of them are served, and the
process's RSS (``VmRSS`` of ``/proc/<pid>/status``) grows by at most 100 MiB.

The config sheds slow clients quickly (headers within 2 s, a body within 4 s), so the test
is short; the defaults are documented in design.md. Each run prints its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import resource
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
from proxy_lab import KEYS, MODEL, Lab, banner_url, config_yaml, eventually, proxy_config
from test_queue_memory_flood import rss_mib

from sfq_proxy.http import body
from sfq_proxy.http.body import READ_AHEAD

FD_LIMIT = 1024
SLOW_SENDERS = 1100
ADDRESSES = [f"127.0.0.{n}" for n in range(2, 13)]  # 100 slow senders from each
BYTE_EVERY_S = 10.0
UPLOADS = 60
DECLARED = 10 * 1024 * 1024
ATTACK_S = 20.0
HONEST_WORKERS = 4
SHEDDING = {  # short, so that the test is: the defaults are 10 s, 30 s, 64 KiB/s after 5 s
    "header_timeout_s": 2,
    "body_timeout_s": 4,
    "body_grace_s": 1,
    "min_body_kib_per_s": 64,
}
CHAT = [{"role": "user", "content": "hello"}]


def _limited() -> None:
    """In the proxy's process, before it runs: ``ulimit -n 1024``."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


async def _serve(config_text: str, tmp_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    path = tmp_path / "config.yaml"
    path.write_text(config_text)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", "serve", "--config", str(path),
        stdout=asyncio.subprocess.PIPE, preexec_fn=_limited,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    url = banner_url(line)
    asyncio.get_running_loop().create_task(_discard(proc.stdout))
    return proc, url


async def _discard(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def _slow_sender(port: int, source: str, stop: asyncio.Event, seen: Counter[str]) -> None:
    """Headers one byte every ``BYTE_EVERY_S``; back at once when the proxy lets go."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: text/plain\r\n"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(source, 0)
            )
        except OSError:
            seen["connect failed"] += 1
            await asyncio.sleep(0.5)
            continue
        seen["connected"] += 1
        try:
            for i in range(len(head)):
                writer.write(head[i : i + 1])
                try:
                    answer = await asyncio.wait_for(reader.read(4096), BYTE_EVERY_S)
                except TimeoutError:
                    continue
                seen["answered" if answer else "closed"] += 1
                break
        except OSError:
            seen["reset"] += 1
        finally:
            writer.close()
        await asyncio.sleep(0.1)


async def _stalled_upload(port: int, stop: asyncio.Event, seen: Counter[str]) -> None:
    """Declare 10 MiB, send 10 MiB - 1 bytes as fast as the proxy takes them, then wait;
    back a second after the proxy answers or lets go."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            seen["connect failed"] += 1
            await asyncio.sleep(1)
            continue
        sending = asyncio.create_task(_upload(writer, seen))
        try:
            answer = await reader.read(4096)
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
            seen[f"upload answered {status}"] += 1
        except OSError:
            seen["upload reset"] += 1
        finally:
            sending.cancel()
            with contextlib.suppress(BaseException):
                await sending
            writer.close()
        await asyncio.sleep(1)


async def _upload(writer: asyncio.StreamWriter, seen: Counter[str]) -> None:
    start = f'{{"model": "{MODEL}", "prompt": "'.encode()
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        f"Authorization: Bearer {KEYS['B']}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {DECLARED}\r\n\r\n".encode()
        + start
    )
    piece = b"x" * (256 * 1024)
    left = DECLARED - 1 - len(start)
    while left > 0:
        writer.write(piece[: min(left, len(piece))])
        left -= min(left, len(piece))
        await writer.drain()
    seen["sent whole"] += 1


async def _honest(client: openai.AsyncOpenAI, stop: asyncio.Event, seen: Counter[str]) -> None:
    while not stop.is_set():
        try:
            reply = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
            seen["served" if reply.choices[0].message.content else "empty"] += 1
        except openai.APIError as err:
            seen[type(err).__name__] += 1
            await asyncio.sleep(0.05)


@pytest.fixture
def many_fds() -> None:
    """The attack itself needs some 1,200 sockets in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if wanted < 2048:
        pytest.skip(f"the attack needs 2,048 open files here; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))


@pytest.mark.usefixtures("many_fds")
async def test_slow_senders_and_stalled_uploads_leave_the_honest_served(
    lab: Lab, tmp_path: Path
) -> None:
    sim = await lab.backend()
    config = config_yaml([sim.url], limits={"queue_memory_mb": 24, **SHEDDING})
    proc, url = await _serve(config, tmp_path)
    port = int(url.rsplit(":", 1)[1])
    stop = asyncio.Event()
    attack: Counter[str] = Counter()
    honest: Counter[str] = Counter()
    tasks: list[asyncio.Task[Any]] = []
    # the honest org's client comes once the attack is on: its connections are new ones
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0, timeout=10)
    try:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"]) as warm:
            for _ in range(5):  # the first requests' imports and caches
                await warm.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5)
        before = peak = rss_mib(proc.pid)
        tasks += [asyncio.create_task(_stalled_upload(port, stop, attack)) for _ in range(UPLOADS)]
        await asyncio.sleep(2)  # the uploads are in, and stall
        for i in range(SLOW_SENDERS):
            source = ADDRESSES[i % len(ADDRESSES)]
            tasks.append(asyncio.create_task(_slow_sender(port, source, stop, attack)))
        await asyncio.sleep(1)  # the slow senders are in: the proxy is full
        peak = max(peak, rss_mib(proc.pid))
        tasks += [asyncio.create_task(_honest(client, stop, honest)) for _ in range(HONEST_WORKERS)]
        ends = time.monotonic() + ATTACK_S
        while time.monotonic() < ends:
            await asyncio.sleep(0.25)
            peak = max(peak, rss_mib(proc.pid))
        stop.set()
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    asked = sum(honest.values())
    print(
        f"\nhonest: {honest['served']} of {asked} served ({dict(honest)}); RSS {before:.1f} MiB "
        f"before, peak {peak:.1f} MiB (+{peak - before:.1f}); attack: {dict(attack)}"
    )
    assert asked >= 20
    assert honest["served"] >= 0.95 * asked
    assert peak - before <= 100


async def _raw(url: str, request: bytes) -> bytes:
    """``request`` sent as it is; the answer, read until the proxy closes."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


SECRET = "sk-secret-of-a-tenant"


@pytest.mark.parametrize(
    "request_bytes",
    [
        f"GET /healthz HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {SECRET}\x01\r\n\r\n",
        f"GET /healthz HTTP/1.1\r\nHost: p\r\nX-Key {SECRET}\r\n\r\n",
        f"GET /healthz HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {SECRET}{'x' * 9000}\r\n\r\n",
        f"GET /{SECRET} HTTP/1.1 extra\r\nHost: p\r\n\r\n",
        f"{SECRET} / HTTP/1.1\r\nHost: p\r\n\r\n",
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: {SECRET}\r\n\r\n",
    ],
    ids=[
        "control character",
        "no colon",
        "header too long",
        "bad request line",
        "bad method",
        "bad length",
    ],
)
async def test_a_request_that_is_not_http_gets_a_json_400_that_echoes_nothing(
    lab: Lab, request_bytes: str, caplog: pytest.LogCaptureFixture
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    answer = await _raw(served.url, request_bytes.encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"400", answer[:200]
    assert b"Content-Type: application/json" in head, answer
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert SECRET.encode() not in answer
    assert SECRET not in caplog.text  # nor written to the log


# In the test's own process: each cap and timer alone, small enough to see.

BODY = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2}).encode()


def _post_head(key: str | None, length: int, *, close: bool = False) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
        f"{'Connection: close' + chr(13) + chr(10) if close else ''}\r\n"
    ).encode()


async def _connect(served_url: str, source: str = "127.0.0.1") -> tuple[Any, Any]:
    host, port = served_url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), local_addr=(source, 0))


async def _answer(reader: asyncio.StreamReader, within: float = 5) -> tuple[int, dict[str, Any]]:
    """One answer's status and JSON body (Content-Length framed)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))  # fmt: skip
    body = await asyncio.wait_for(reader.readexactly(length), within)
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def _closed(reader: asyncio.StreamReader, within: float = 5) -> bool:
    """Whether the proxy closes the connection (what it sent first is dropped)."""
    try:
        while await asyncio.wait_for(reader.read(65536), within):
            pass
    except ConnectionResetError:
        pass
    return True


async def test_a_head_that_trickles_is_answered_408_and_closed(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], limits={"header_timeout_s": 0.3}))
    reader, writer = await _connect(served.url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: pro")
    status, body = await _answer(reader)
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert await _closed(reader)
    writer.close()


async def test_a_kept_alive_connection_may_idle_but_its_next_head_must_come_in_time(
    lab: Lab,
) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url], limits={"header_timeout_s": 0.3}))
    reader, writer = await _connect(served.url)
    for _ in range(2):  # idle longer than the head's time between them: kept alive
        writer.write(_post_head(KEYS["A"], len(BODY)) + BODY)
        assert (await _answer(reader))[0] == 200
        await asyncio.sleep(0.5)
    writer.write(b"POST /v1/chat")  # a head begun, never ended
    assert (await _answer(reader))[0] == 408
    writer.close()


async def test_at_a_peers_cap_its_oldest_idle_connection_gives_way(lab: Lab) -> None:
    sim = await lab.backend()
    limits = {"max_connections": 50, "max_connections_per_peer": 3}
    served = await lab.proxy(proxy_config([sim.url], limits=limits))
    idle = [await _connect(served.url, "127.0.0.2") for _ in range(3)]
    await asyncio.sleep(0.1)  # accepted, in order
    reader, writer = await _connect(served.url, "127.0.0.2")
    writer.write(_post_head(KEYS["A"], len(BODY)) + BODY)
    assert (await _answer(reader))[0] == 200  # served: the oldest idle one gave way
    assert await _closed(idle[0][0], within=2)
    for other, other_writer in idle[1:]:  # the others stay
        other_writer.write(_post_head(KEYS["A"], len(BODY)) + BODY)
        assert (await _answer(other))[0] == 200
    for _, w in [*idle, (reader, writer)]:
        w.close()


async def test_at_a_cap_of_connections_each_serving_a_request_a_newcomer_is_refused(
    lab: Lab,
) -> None:
    sim = await lab.backend()
    limits = {"max_connections": 4, "max_connections_per_peer": 2}
    served = await lab.proxy(proxy_config([sim.url], slots=1, limits=limits))
    sim.hold()  # every request waits: its connection serves it
    busy = []
    for source in ("127.0.0.2", "127.0.0.2", "127.0.0.3", "127.0.0.3"):
        reader, writer = await _connect(served.url, source)
        writer.write(_post_head(KEYS["A"], len(BODY)) + BODY)
        busy.append((reader, writer))
    await eventually(lambda: len(served.state.drain) == 4)
    for source in ("127.0.0.2", "127.0.0.4"):  # its peer's cap; the total
        reader, writer = await _connect(served.url, source)
        writer.write(_post_head(KEYS["A"], len(BODY)) + BODY)
        assert await reader.read() == b""  # closed at once, nothing read
        writer.close()
    sim.release()
    for reader, writer in busy:
        assert (await _answer(reader, within=10))[0] == 200
        writer.close()


async def test_a_body_must_come_in_time_and_at_a_pace(lab: Lab) -> None:
    sim = await lab.backend()
    limits = {"body_timeout_s": 1.5, "body_grace_s": 0.3, "min_body_kib_per_s": 1}
    served = await lab.proxy(proxy_config([sim.url], limits=limits))
    stalled, trickling, steady = [await _connect(served.url) for _ in range(3)]
    started = time.monotonic()
    for _, writer in (stalled, trickling, steady):
        writer.write(_post_head(KEYS["A"], 4096) + b"{")
    for _ in range(12):  # 2 KiB/s: paid for; 10 B/s: not
        await asyncio.sleep(0.1)
        steady[1].write(b" " * 200)
        trickling[1].write(b" ")
    status, body = await _answer(stalled[0])
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert (await _answer(trickling[0]))[0] == 408
    status, body = await _answer(steady[0])  # cut by body_timeout_s alone
    assert (status, body["error"]["code"]) == (408, "request_timeout")
    assert time.monotonic() - started >= 1.5
    assert "1.5 s" in body["error"]["message"]
    assert served.state.memory is not None
    assert served.state.memory.used == 0
    for _, writer in (stalled, trickling, steady):
        writer.close()


async def test_bodies_being_read_count_in_the_queue_memory(lab: Lab) -> None:
    """At 1 MiB of queue memory, two stalled uploads of B's hold most of it (their bytes, and
    what aiohttp may read ahead of each); B's third is refused; A's request takes the place
    of B's newest upload, which is cut, and is served."""
    sim = await lab.backend()
    limits = {"max_body_bytes": 256 * 1024, "queue_memory_mb": 1}
    served = await lab.proxy(proxy_config([sim.url], limits=limits))
    memory = served.state.memory
    assert memory is not None
    uploads = []
    for n in range(1, 3):
        uploads.append(await _connect(served.url))
        uploads[-1][1].write(_post_head(KEYS["B"], 200_000) + b"{" + b" " * 100_000)
        await eventually(lambda n=n: memory.used >= n * (100_000 + READ_AHEAD))
    third = await _connect(served.url)
    third[1].write(_post_head(KEYS["B"], 200_000) + b"{" + b" " * 100_000)
    status, body = await _answer(third[0])
    assert (status, body["error"]["code"]) == (429, "queue_full")
    assert "bodies your org is sending" in body["error"]["message"]
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}],
                        "max_tokens": 2}).encode()  # fmt: skip
    mine = await _connect(served.url)
    mine[1].write(_post_head(KEYS["A"], len(small)) + small[:1000])  # read as it comes
    await asyncio.sleep(0.1)
    mine[1].write(small[1000:])
    status, body = await _answer(uploads[1][0])  # B's newest gave its place
    assert (status, body["error"]["code"]) == (429, "queue_full")
    assert "gave its place" in body["error"]["message"]
    assert (await _answer(mine[0]))[0] == 200
    assert memory.used >= 100_000 + READ_AHEAD  # B's first still waits for its bytes
    for _, writer in (*uploads, third, mine):
        writer.close()
    await eventually(lambda: memory.used == 0)


async def test_a_body_not_framed_as_its_headers_say_is_a_json_400(lab: Lab) -> None:
    sim = await lab.backend()
    served = await lab.proxy(proxy_config([sim.url]))
    reader, writer = await _connect(served.url)
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer {KEYS['A']}\r\n"
        'Transfer-Encoding: chunked\r\n\r\n5\r\n{"mod\r\nzz\r\n'.encode()
    )
    status, body = await _answer(reader)
    assert (status, body["error"]["code"]) == (400, "invalid_request")
    writer.close()


async def test_a_body_cut_for_its_pace_leaves_no_cycle_behind(lab: Lab) -> None:
    """A cut read's error was raised from a frame that held it: error, traceback and frame
    made a cycle that held the request and its read-ahead (~380 KiB) until the collector
    ran (rarely, at the proxy's thresholds): the soak's RSS grew under stalled uploads.
    Freed by reference counts now, as the read ends."""
    sim = await lab.backend()
    limits = {"body_timeout_s": 0.5, "body_grace_s": 0.1, "min_body_kib_per_s": 1}
    served = await lab.proxy(proxy_config([sim.url], limits=limits))
    gc.collect()
    gc.disable()  # what is left in a cycle stays in sight until the assertion
    try:
        stalled = [await _connect(served.url) for _ in range(4)]
        for _, writer in stalled:
            writer.write(_post_head(KEYS["A"], 4096) + b"{")
        for reader, writer in stalled:
            assert (await _answer(reader))[0] == 408
            writer.close()
        await asyncio.sleep(0.1)
        left = [o for o in gc.get_objects() if isinstance(o, body.Reading)]
        assert left == []
    finally:
        gc.enable()
