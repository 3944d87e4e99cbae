"""Overload soak: ten times more clients than slots through the real proxy, for minutes.

    python bench/soak.py [--seconds 180] [--slots 4] [--clients 80] [--seed 1]

Two simulated vLLM servers (`sfq-proxy sim-backend`, --slots sequences each, ~50-300 ms per
request) and `sfq-proxy serve` run as subprocesses on free loopback ports. The proxy has
small queues (5 requests per flow, 1-1.5 s of queue age), four orgs (one capped in flight, one
rate limited) and two classes, so it refuses much of what it is sent. From this process,
10 × slots closed-loop aiohttp clients send chat requests for --seconds: most read their
answer to the end, about 10 % hang up before the response headers (while queued) and about
5 % after the first streamed chunk. Each client draws its requests from its own seeded
random.Random, so a run sends the same requests whatever the timing.

Every request ends in exactly one outcome (a status, or a hang-up of ours; anything else is
counted as an error by type). At the end: a table per org, and checks, each PASS or FAIL
with its figures (exit status 1 if one fails): 200s read to the end == the backends'
completed count (a hang-up mid-stream is an abort there, not a completion); one access-log
line per request, agreeing with what the client saw; the backends' own peak concurrency and
the proxy's `/admin/state` (polled every second) never above the slots; the proxy's RSS
flat after warm-up; the pool whole afterwards (nothing queued or running) and a burst of
one request per slot all served at once.

    python bench/soak.py --hostile [--seconds 60]

soaks twice, fresh processes each time, the same seed and config: the honest clients alone,
then beside a hostile mix from a process of its own (an org of its own, "mallory"), each
kind a few at a time and bounded in time, again and again until the end: slow readers
(streams never read, 4 KB receive buffers), slow heads (a byte every 2 s, from three
addresses, one over its connection cap), uploads that declare 10 MiB and stall after 9, and
~10 MiB bombs (300k messages and a surrogate pair; 9.6 MiB of tools). The proxy's limits are
short so that they shed it within seconds. Every check above holds of the honest clients
(the backends' completed counts leave out the slow readers', told apart by their body's
"user"); the RSS check takes each quarter's median; and each hostile kind must be shed as
its limit says, in time, no slot held for a slow reader. Then the honest clients' figures,
latency percentiles of the 200s included, without and with the mix side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

import aiohttp
import harness
import uvloop
import yaml
from harness import Processes

MODEL = "sim-llama"
CHAT_PATH = "/v1/chat/completions"
ADMIN_ENV = "SOAK_ADMIN_KEY"
BACKENDS = 2
TIME_SCALE = 2.0  # the sims decode 160 tokens/s per sequence: 8-48 tokens take 50-300 ms
# org: (share of the requests, its settings in the proxy)
ORGS: dict[str, tuple[float, dict[str, Any]]] = {
    "alpha": (0.35, {"weight": 2}),
    "beta": (0.25, {"weight": 1}),
    "gamma": (0.20, {"weight": 1, "max_in_flight": 3}),
    "delta": (0.20, {"weight": 1, "rpm": 120}),
}
CLASSES = {
    "interactive": {"weight": 4, "max_queue_len": 5, "max_queue_age_s": 1},
    "batch": {"weight": 1, "max_queue_len": 5, "max_queue_age_s": 1.5},
}
INTERACTIVE_SHARE = 0.4
MAX_TOKENS = {"interactive": (8, 24), "batch": (16, 48)}
LEAVE_QUEUED_P, LEAVE_MID_STREAM_P = 0.10, 0.05
LEAVE_AFTER_S = (0.02, 1.5)  # how long a leaver waits for the response headers
THINK_S = (0.0, 0.05)  # pause after an answer
RETRY_AFTER_CAP_S = 2.0  # clients honour a 429's or 503's Retry-After up to this
REQUEST_TIMEOUT_S = 30.0  # far above queue age + generation: a request this slow is an error
FINISH_TIMEOUT_S = 30.0  # for the clients' last requests once the time is up
SETTLE_TIMEOUT_S = 10.0  # for the pool and the sims to be idle after the soak
RSS_GROWTH_LIMIT = 0.10  # from the 25 % mark to the end
BURST_MAX_WAIT_S = 0.05  # a burst into an idle pool must not queue
# What a client may hold while its request is read or its answer written (design.md §5 Slow
# clients, §6 Slow senders): the defaults (10 s, 30 s, 5 s, 32 KiB/s, 30 s, 32 MiB) would
# shed the hostile mix's clients too slowly for a short run; honest clients never come near
# them (they send at once and read as the answer comes). The connection caps are left to
# what the open files allow, but for a peer's: above the honest clients' (all from
# 127.0.0.1), below what a hostile peer opens.
LIMITS = {
    "header_timeout_s": 3,
    "body_timeout_s": 4,
    "body_grace_s": 1,
    "min_body_kib_per_s": 64,
    "max_connections_per_peer": 128,
    "queue_memory_mb": 64,
    "answer_buffer_mb": 1,
}
POOL_TIMEOUTS = {"client_write_s": 5}

# Outcomes of a request, as the client saw it
OK = "200"  # read to the end (a stream's [DONE], a JSON body with choices)
LEFT_QUEUED = "left queued"  # we hung up before the response headers
LEFT_MID_STREAM = "left mid-stream"  # we hung up after the first streamed chunk
REJECTIONS = {
    "queue_full": "429 queue_full",
    "queue_age": "429 queue_age",
    "rpm": "429 rate",  # the org's or pool's requests per minute
    "tpm": "429 rate",  # its tokens per minute
}
MEMORY = "429 memory"  # queue_full for the queue memory: bodies of the largest flow
# and: "429 other", "status <n> <code>", "200 truncated", "timeout", "conn <Type>",
# "exception <Type>"

COMPLETE, LEAVE_QUEUED, LEAVE_MID_STREAM = "complete", "leave queued", "leave mid-stream"


class Failed(Exception):
    """The soak could not run (a process did not start, warm-up failed)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One request, drawn whole before it is sent (a fixed number of draws each), so the
    n-th request of a client is the same in every run with the same seed."""

    org: str
    cls: str
    stream: bool
    max_tokens: int
    prompt: str
    behaviour: str
    leave_after_s: float
    think_s: float
    backoff_factor: float


def draw_plan(rng: Random) -> Plan:
    org = rng.choices(list(ORGS), weights=[share for share, _ in ORGS.values()])[0]
    cls = "interactive" if rng.random() < INTERACTIVE_SHARE else "batch"
    roll = rng.random()
    if roll < LEAVE_QUEUED_P:
        behaviour = LEAVE_QUEUED
    elif roll < LEAVE_QUEUED_P + LEAVE_MID_STREAM_P:
        behaviour = LEAVE_MID_STREAM
    else:
        behaviour = COMPLETE
    # Leavers stream: the proxy sends a stream's headers only once it is dispatched, so "no
    # headers yet" means "still queued", and no backend can have completed it yet. A JSON
    # answer's headers come with its body: a hang-up just then would count as completed
    # at the backend and not here.
    stream = rng.random() < 0.5 or behaviour != COMPLETE
    return Plan(
        org=org,
        cls=cls,
        stream=stream,
        max_tokens=rng.randint(*MAX_TOKENS[cls]),
        prompt="lorem ipsum " * rng.randint(2, 40),
        behaviour=behaviour,
        leave_after_s=rng.uniform(*LEAVE_AFTER_S),
        think_s=rng.uniform(*THINK_S),
        backoff_factor=rng.uniform(0.5, 1.0),
    )


def api_key(org: str) -> str:
    return f"sk-soak-{org}"


# --- one request ----------------------------------------------------------------------------


async def one_request(
    session: aiohttp.ClientSession, url: str, plan: Plan, request_id: str
) -> tuple[str, float | None]:
    """Send ``plan``; return its one outcome and an error's Retry-After. Raises nothing but
    cancellation: every other exception becomes an outcome named by its type."""
    headers = {
        "Authorization": f"Bearer {api_key(plan.org)}",
        "X-Workload-Class": plan.cls,
        "X-Request-Id": request_id,
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": plan.prompt}],
        "max_tokens": plan.max_tokens,
        "stream": plan.stream,
    }
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            response = await _send(session, url + CHAT_PATH, body, headers, plan)
            if response is None:
                return LEFT_QUEUED, None
            try:
                return await _read_answer(response, plan)
            finally:
                response.release()
    except TimeoutError:
        return "timeout", None
    except aiohttp.ClientError as err:
        return f"conn {type(err).__name__}", None
    except Exception as err:
        return f"exception {type(err).__name__}", None


async def _send(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict, plan: Plan
) -> aiohttp.ClientResponse | None:
    """POST and wait for the response headers; None if a leaver's patience ran out first
    (the cancelled request closes its connection: the proxy sees the client go)."""
    post = session.post(url, json=body, headers=headers)
    if plan.behaviour != LEAVE_QUEUED:
        return await post
    try:
        async with asyncio.timeout(plan.leave_after_s):
            return await post
    except TimeoutError:
        return None


async def _read_answer(response: aiohttp.ClientResponse, plan: Plan) -> tuple[str, float | None]:
    if response.status != 200:
        return await _refusal(response)
    if plan.behaviour == LEAVE_MID_STREAM:
        first = await response.content.readany()
        response.close()  # hang up: the proxy must abort the generation upstream
        return (LEFT_MID_STREAM if first else "200 truncated"), None
    body = await response.read()
    return (OK if _complete(body, plan.stream) else "200 truncated"), None


async def _refusal(response: aiohttp.ClientResponse) -> tuple[str, float | None]:
    """An error answer named by its status and the ``code`` of its OpenAI-style body, with
    its Retry-After (a 429's, or a 503's), which the client honours as real clients do."""
    try:
        error = (await response.json(content_type=None))["error"]
        code, message = error["code"], str(error.get("message"))
    except (ValueError, KeyError, TypeError):
        code, message = None, ""
    try:
        retry_after = float(response.headers.get("Retry-After", ""))
    except ValueError:
        retry_after = None
    if response.status == 429:
        if code == "queue_full" and message.startswith("The proxy's queue memory is full"):
            return MEMORY, retry_after  # never an honest org's: theirs are the smallest flows
        return REJECTIONS.get(code, "429 other"), retry_after
    return f"status {response.status} {code}", retry_after


def _complete(body: bytes, stream: bool) -> bool:
    """Whether a 200's body is whole: a stream ends with [DONE], a JSON answer has choices."""
    if stream:
        return body.rstrip().endswith(b"data: [DONE]")
    try:
        answer = json.loads(body)
    except ValueError:
        return False
    return bool(answer.get("choices")) and "usage" in answer


# --- the clients ------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the clients sent and how each request ended, by request id."""

    started: int = 0
    outcomes: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # org, behaviour, …
    latency: dict[str, float] = field(default_factory=dict)  # a 200 read to the end: seconds

    def by_org(self) -> dict[str, Counter[str]]:
        table: dict[str, Counter[str]] = {org: Counter() for org in ORGS}
        for org, _, outcome in self.outcomes.values():
            table[org][outcome] += 1
        return table

    def total(self) -> Counter[str]:
        return Counter(outcome for _, _, outcome in self.outcomes.values())

    def latencies(self, org: str | None = None) -> list[float]:
        """Seconds from sending to the answer's end, of the 200s read to the end (of ``org``)."""
        return sorted(
            seconds
            for request_id, seconds in self.latency.items()
            if org is None or self.outcomes[request_id][0] == org
        )


async def client(
    index: int,
    session: aiohttp.ClientSession,
    url: str,
    seed: int,
    stop: asyncio.Event,
    tally: Tally,
) -> None:
    """A closed-loop client: one request at a time until ``stop``, then its last one ends."""
    rng = Random(f"{seed}/{index}")  # str seeds are hashed by SHA-512: stable across runs
    n = 0
    while not stop.is_set():
        plan = draw_plan(rng)
        request_id = f"soak-{index}-{n}"
        n += 1
        tally.started += 1
        sent = time.perf_counter()
        outcome, retry_after = await one_request(session, url, plan, request_id)
        tally.outcomes[request_id] = (plan.org, plan.behaviour, outcome)
        if outcome == OK:
            tally.latency[request_id] = time.perf_counter() - sent
        pause = plan.think_s
        if retry_after is not None:
            pause = min(retry_after, RETRY_AFTER_CAP_S) * plan.backoff_factor
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)


# --- the hostile mix (--hostile) ------------------------------------------------------------
#
# Clients that try to hold what the honest ones need, in a process of their own (its CPU is
# not the honest clients' loop's), each kind a few at a time, every attempt bounded in time,
# again and again until the soak's end. Each kind comes from a loopback address of its own:
# a peer with its own connection cap. Those that authenticate are HOSTILE_ORG's, an org
# with the weight of the smallest honest one and no cap, so the fair queue gives them their
# share and no more.

HOSTILE_ORG = "mallory"
HOSTILE_USER = "hostile"  # the body's "user" of its requests that reach a backend (sim log)
HOSTILE_ID = "hostile-"  # their X-Request-Id's prefix
READERS, READER_ADDR = 6, "127.0.0.2"
# ~46 KB of events, 1.25 s of a slot: far beyond a 4 KB receive buffer, though not beyond
# what the kernel's send buffer takes on loopback (megabytes), so the proxy holds none of
# it and has no cause to cut the reader (the cut is tests/http/test_hostile_readers.py's,
# with answers of 4 MB); what is checked is that no slot waits for the reader
READER_TOKENS = 200
READER_RCVBUF = 4096
READER_HOLD_S = 20.0  # a reader lets go then if the proxy has not cut it
# slow heads from three peers: two below LIMITS' max_connections_per_peer, whose heads run
# out of header_timeout_s, and one above it, whose own connections give way to each other
HEADS = {"127.0.0.3": 100, "127.0.0.4": 100, "127.0.0.5": 160}
HEAD_BYTE_EVERY_S = 2.0
SLOW_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
)
UPLOADS, UPLOAD_ADDR = 8, "127.0.0.6"
UPLOAD_DECLARED, UPLOAD_SENT = 10 * 2**20, 9 * 2**20  # a 10 MiB body that stalls after 9
# One sender of each kind of bomb, a bomb every answer + BOMB_PAUSE_S, each on a connection
# of its own: after an answer that came before its body was read (a 429), the proxy drops
# the rest of the body and closes the connection, without saying so in the answer (no
# Connection: close), so a bomb sent next on it would be cut with it
BOMB_ADDR = "127.0.0.7"
BOMB_PAUSE_S = 0.5
ANSWER_WAIT_S = 30.0  # the longest an attempt waits for an answer
ESTABLISHED = 1  # Linux's TCP state (include/net/tcp_states.h)
READER, HEAD, UPLOAD = "slow reader", "slow head", "stalled upload"
BOMB_MESSAGES, BOMB_TOOLS = "bomb: 300k messages", "bomb: 9.6 MiB of tools"
HOSTILE_KINDS = (READER, HEAD, UPLOAD, BOMB_MESSAGES, BOMB_TOOLS)
# what each kind may end in, when it ends before the soak does; an attempt still under way
# at the end (AT_END) is neither
CUT = "200, cut by the proxy"
HELD = "200, never read, let go"  # after READER_HOLD_S, the kernel holding its answer
AT_END = "still under way at the end"
SHED = {
    READER: {CUT, HELD, "429 queue_full", "429 queue_age", "429 queue_full (memory)"},
    # closed or reset: gave way at its peer's cap
    HEAD: {"408 limits.header_timeout_s", "closed, no answer", "reset, no answer"},
    UPLOAD: {"408 request_timeout", "429 queue_full (memory)"},
    # a 429: the queue memory is full of the org's own stalled uploads
    BOMB_MESSAGES: {"400 limits.max_messages", "429 queue_full (memory)"},
    BOMB_TOOLS: {"400 limits.max_tools", "429 queue_full (memory)"},
}
# within how long each must end: its limit's time, and 2 s for the loop to get to it
SHED_WITHIN_S = {
    READER: READER_HOLD_S + 2,
    HEAD: LIMITS["header_timeout_s"] + 2,
    UPLOAD: LIMITS["body_timeout_s"] + 2,
    BOMB_MESSAGES: 2.0,
    BOMB_TOOLS: 2.0,
}


def describe_answer(data: bytes) -> str:
    """An HTTP answer's first bytes as '<status> <the limit it names, or its code>'."""
    if not data:
        return "closed, no answer"
    status = re.match(rb"HTTP/1\.[01] (\d{3}) ", data)
    if status is None:
        return "not HTTP"
    detail = re.search(rb"\((limits\.\w+)\)", data) or re.search(rb'"code": ?"(\w+)"', data)
    text = status.group(1).decode() + (f" {detail.group(1).decode()}" if detail else "")
    return text + (" (memory)" if b"queue memory is full" in data else "")


def raw_head(request_id: str, length: int) -> bytes:
    return (
        f"POST {CHAT_PATH} HTTP/1.1\r\nHost: proxy\r\n"
        f"Authorization: Bearer {api_key(HOSTILE_ORG)}\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: {request_id}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def slow_reader(port: int, request_id: str) -> tuple[str, str]:
    """A stream asked for and never read, on a 4 KB receive buffer. Its status is peeked at
    (MSG_PEEK takes nothing), and the proxy's cut seen in the socket's TCP state."""
    loop = asyncio.get_running_loop()
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me everything"}],
            "max_tokens": READER_TOKENS,
            "stream": True,
            "user": HOSTILE_USER,
        }
    ).encode()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, READER_RCVBUF)
        sock.setblocking(False)
        sock.bind((READER_ADDR, 0))
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, raw_head(request_id, len(body)) + body)
        seen, ends = b"", time.monotonic() + READER_HOLD_S
        while time.monotonic() < ends:
            await asyncio.sleep(0.05)
            try:
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != ESTABLISHED:
                    break
                seen = sock.recv(4096, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError:  # reset between the two looks
                break
            if seen and not seen.startswith(b"HTTP/1.1 200"):
                return describe_answer(seen), request_id  # refused: the answer is all there
        else:
            return (HELD if seen else "no answer in time"), request_id
        ok = seen.startswith(b"HTTP/1.1 200")
        return (CUT if ok else f"{describe_answer(seen)}, then cut"), request_id


async def slow_head(port: int, source: str) -> str:
    """Request headers a byte every HEAD_BYTE_EVERY_S, until the proxy answers or closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        for i in range(len(SLOW_HEAD)):
            writer.write(SLOW_HEAD[i : i + 1])
            with contextlib.suppress(TimeoutError):
                return describe_answer(await asyncio.wait_for(reader.read(4096), HEAD_BYTE_EVERY_S))
        return "head sent whole"
    except ConnectionResetError:  # closed with a byte of ours unread
        return "reset, no answer"
    finally:
        writer.close()


async def stalled_upload(port: int, request_id: str) -> str:
    """An authenticated body that declares 10 MiB, sends 9 as fast as the proxy takes them,
    then nothing: the proxy's answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(UPLOAD_ADDR, 0))
    start = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "'.encode()

    async def upload() -> None:
        writer.write(raw_head(request_id, UPLOAD_DECLARED) + start)
        piece, left = b"x" * 2**18, UPLOAD_SENT - len(start)
        while left > 0:
            writer.write(piece[: min(left, len(piece))])
            left -= len(piece)
            await writer.drain()

    sending = asyncio.create_task(upload())
    try:
        return describe_answer(await asyncio.wait_for(reader.read(4096), ANSWER_WAIT_S))
    except TimeoutError:
        return "no answer in time"
    finally:
        sending.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await sending
        writer.close()


def bomb_bodies() -> dict[str, bytes]:
    """~10 MiB bodies within max_body_bytes, each beyond one of the caps on structure (as in
    tests/http/test_hostile_bodies.py): the proxy must refuse them, 400, without holding up
    anyone else while it reads and parses them."""
    head = f'{{"model":"{MODEL}","max_tokens":1,'
    tiny = '{"role":"user","content":"a"},' * 300_000
    pair = '{"role":"user","content":"\\ud83d\\ude00"}'
    tool = '{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}'
    tools = ",".join([tool] * (int(9.6 * 2**20) // (len(tool) + 1)))
    hi = '"messages":[{"role":"user","content":"hi"}],'
    return {
        BOMB_MESSAGES: (head + '"messages":[' + tiny + pair + "]}").encode(),
        BOMB_TOOLS: (head + hi + '"tools":[' + tools + "]}").encode(),
    }


async def bomb(http: aiohttp.ClientSession, url: str, body: bytes, request_id: str) -> str:
    headers = {
        "Authorization": f"Bearer {api_key(HOSTILE_ORG)}",
        "Content-Type": "application/json",
        "X-Request-Id": request_id,
    }
    async with http.post(url + CHAT_PATH, data=body, headers=headers) as response:
        data = await response.read()
    return describe_answer(f"HTTP/1.1 {response.status} ".encode() + data)


@dataclass
class Mix:
    """How each attempt of the hostile mix ended, and after how long, by kind."""

    seconds: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    ids: dict[str, str] = field(default_factory=dict)  # a slow reader's request id: outcome

    def add(self, kind: str, outcome: str, seconds: float) -> None:
        self.seconds.setdefault(kind, {}).setdefault(outcome, []).append(round(seconds, 3))

    def outcomes(self, kind: str) -> Counter[str]:
        return Counter({o: len(s) for o, s in self.seconds.get(kind, {}).items()})


async def attempts(mix: Mix, kind: str, one: Any, deadline: float, pause: float) -> None:
    """``one(n)`` again and again until ``deadline``; each attempt's outcome into ``mix``."""
    n = 0
    while time.monotonic() < deadline:
        began = time.monotonic()
        try:
            outcome = await one(n)
            if isinstance(outcome, tuple):
                outcome, request_id = outcome
                mix.ids[request_id] = outcome
        except asyncio.CancelledError:
            mix.add(kind, AT_END, time.monotonic() - began)
            raise
        except (OSError, TimeoutError, aiohttp.ClientError) as err:
            outcome = f"conn {type(err).__name__}"
        mix.add(kind, outcome, time.monotonic() - began)
        n += 1
        await asyncio.sleep(pause)


async def hostile_mix(url: str, until: float) -> Mix:
    """The hostile mix against ``url`` until the wall-clock time ``until``."""
    port = int(url.rsplit(":", 1)[1])
    bombs = bomb_bodies()
    mix = Mix()
    deadline = time.monotonic() + max(0.0, until - time.time())
    connector = aiohttp.TCPConnector(limit=0, force_close=True, local_addr=(BOMB_ADDR, 0))
    timeout = aiohttp.ClientTimeout(total=ANSWER_WAIT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        def reader(i: int) -> Any:
            return lambda n: slow_reader(port, f"{HOSTILE_ID}reader-{i}-{n}")

        def head(address: str) -> Any:  # one connection after another, each its head
            return lambda n: slow_head(port, address)

        def upload(i: int) -> Any:
            return lambda n: stalled_upload(port, f"{HOSTILE_ID}upload-{i}-{n}")

        def bomber(kind: str) -> Any:
            name = "messages" if kind == BOMB_MESSAGES else "tools"
            return lambda n: bomb(http, url, bombs[kind], f"{HOSTILE_ID}bomb-{name}-{n}")

        jobs = [
            *(attempts(mix, READER, reader(i), deadline, 1.0) for i in range(READERS)),
            *(
                attempts(mix, HEAD, head(address), deadline, 1.0)
                for address, count in HEADS.items()
                for _ in range(count)
            ),
            *(attempts(mix, UPLOAD, upload(i), deadline, 1.0) for i in range(UPLOADS)),
            *(attempts(mix, kind, bomber(kind), deadline, BOMB_PAUSE_S) for kind in bombs),
        ]
        tasks = [asyncio.create_task(job) for job in jobs]
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return mix


def run_hostile_mix(url: str, until: float) -> None:
    """The child process's work (--hostile-mix): the mix, then its outcomes as JSON."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    mix = uvloop.run(hostile_mix(url, until))
    print(json.dumps({"seconds": mix.seconds, "ids": mix.ids}), flush=True)


# --- watching the proxy -------------------------------------------------------------------


@dataclass
class Watch:
    """The proxy seen every second: its RSS and its /admin/state."""

    rss: list[tuple[float, int]] = field(default_factory=list)  # (s since start, bytes)
    polls: int = 0
    poll_errors: Counter[str] = field(default_factory=Counter)
    max_queued: int = 0
    max_running: int = 0
    max_in_flight: dict[str, int] = field(default_factory=dict)  # backend -> peak
    slots: dict[str, int] = field(default_factory=dict)
    over_slots: list[str] = field(default_factory=list)  # every sample that broke a limit

    def sample_state(self, pools: dict[str, Any], elapsed: float) -> None:
        pool = pools["sim"]
        self.max_queued = max(self.max_queued, pool["queued"])
        self.max_running = max(self.max_running, pool["running"])
        total_slots = 0
        for b in pool["backends"]:
            name, slots, in_flight = b["name"], b["slots"], b["in_flight"]
            total_slots += slots
            self.slots[name] = slots
            self.max_in_flight[name] = max(self.max_in_flight.get(name, 0), in_flight)
            if in_flight > slots:
                self.over_slots.append(f"t={elapsed:.0f}s {name} in_flight {in_flight}>{slots}")
        if pool["running"] > total_slots:
            self.over_slots.append(f"t={elapsed:.0f}s running {pool['running']}>{total_slots}")

    def rss_at(self, fraction: float, seconds: float) -> int:
        """The RSS sample nearest ``fraction`` of the run."""
        return min(self.rss, key=lambda s: abs(s[0] - fraction * seconds))[1]


async def admin_state(session: aiohttp.ClientSession, url: str, admin_key: str) -> dict:
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with session.get(url + "/admin/state", headers=headers) as response:
        response.raise_for_status()
        return (await response.json())["pools"]


async def watch_proxy(
    session: aiohttp.ClientSession,
    url: str,
    admin_key: str,
    pid: int,
    watch: Watch,
    tally: Tally,
    started: float,
) -> None:
    """Sample every second until cancelled; a progress line every 10 s."""
    while True:
        elapsed = time.monotonic() - started
        try:
            watch.rss.append((elapsed, harness.rss_bytes(pid)))
            pools = await admin_state(session, url, admin_key)
            watch.polls += 1
            watch.sample_state(pools, elapsed)
        except (aiohttp.ClientError, TimeoutError, KeyError, OSError) as err:  # OSError: no pid
            watch.poll_errors[type(err).__name__] += 1
            pools = None
        if watch.polls % 10 == 1 and pools:
            done = tally.total()[OK]
            print(
                f"  t={elapsed:5.0f} s  requests {len(tally.outcomes):6d}  200 {done:6d}  "
                f"queued {pools['sim']['queued']:3d}  running {pools['sim']['running']:2d}  "
                f"rss {watch.rss[-1][1] / 2**20:.1f} MiB",
                flush=True,
            )
        await asyncio.sleep(1.0)


# --- the processes --------------------------------------------------------------------------


def proxy_config(port: int, backends: list[str], slots: int) -> str:
    return yaml.safe_dump(
        {
            "listen": {"host": "127.0.0.1", "port": port},
            "drain_timeout_s": 2,
            "admin_key_env": ADMIN_ENV,
            "keys": [
                {"key": api_key(org), "org": org, "classes": list(CLASSES)}
                for org in [*ORGS, HOSTILE_ORG]
            ],
            "classes": CLASSES,
            "orgs": {**{org: spec for org, (_, spec) in ORGS.items()}, HOSTILE_ORG: {"weight": 1}},
            "limits": LIMITS,
            "pools": {
                "sim": {
                    "models": [MODEL],
                    "health": {"interval_s": 0.5, "cooldown_s": 1, "timeout_s": 2},
                    "timeouts": POOL_TIMEOUTS,
                    "backends": [{"url": url, "slots": slots} for url in backends],
                }
            },
        },
        sort_keys=False,
    )


def start_sims(fleet: Processes, slots: int) -> list[str]:
    """The simulated backends (`sfq-proxy sim-backend` of this tree); returns their URLs."""
    urls = []
    for i, port in enumerate(harness.free_ports(BACKENDS)):
        args = ["sim-backend", "--port", str(port), "--max-num-seqs", str(slots)]
        fleet.start(
            f"sim-{i}", harness.cli(*args, "--time-scale", str(TIME_SCALE), "--seed", str(i))
        )
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def start_proxy(fleet: Processes, sims: list[str], slots: int, admin_key: str) -> tuple[str, int]:
    """The proxy in front of ``sims``; returns its URL and pid. Started once the sims listen:
    its first health probe would find them refusing, and take them out for a cooldown."""
    port = harness.free_port()
    config = fleet.work / "proxy.yaml"
    config.write_text(proxy_config(port, sims, slots))
    command = harness.proxy_command(config, env={ADMIN_ENV: admin_key})
    return f"http://127.0.0.1:{port}", fleet.start("proxy", command).pid


async def wait_ready(session: aiohttp.ClientSession, fleet: Processes, urls: list[str]) -> None:
    """Until every URL answers 200 (the sims' /health, the proxy's /readyz)."""
    deadline = time.monotonic() + 20
    for url in urls:
        while True:
            try:
                fleet.check_alive()
            except RuntimeError as err:
                raise Failed(str(err)) from err
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise Failed(f"{url} did not answer 200 in 20 s")
            await asyncio.sleep(0.1)


async def sim_stats(session: aiohttp.ClientSession, sims: list[str]) -> list[dict[str, Any]]:
    """Each sim's counters, and from its per-request log those of the hostile mix's requests
    (the slow readers', whose body names ``HOSTILE_USER``): ``hostile_<outcome>``."""
    stats = []
    for sim in sims:
        async with session.get(sim + "/sim/stats") as response:
            got = await response.json()
        hostile = Counter(r["outcome"] for r in got.pop("log") if r["user"] == HOSTILE_USER)
        got |= {"hostile_seen": hostile.total()}
        got |= {f"hostile_{outcome}": hostile[outcome] for outcome in ("completed", "aborted")}
        stats.append(got)
    return stats


def honest_completed(stats: list[dict[str, Any]]) -> int:
    """What the backends completed of the honest clients' requests."""
    return sum(s["completed"] - s["hostile_completed"] for s in stats)


# --- before and after -----------------------------------------------------------------------


def simple_plan(org: str) -> Plan:
    return Plan(org, "interactive", False, 8, "hello", COMPLETE, 0.0, 0.0, 1.0)


async def warm_up(session: aiohttp.ClientSession, url: str, sims: list[str], slots: int) -> None:
    """Two rounds of requests through every slot, all 200; then the sims' counters to zero."""
    for round_ in range(2):
        outcomes = await asyncio.gather(
            *(
                one_request(session, url, simple_plan(org), f"warm-{round_}-{i}")
                for i, org in enumerate(["alpha", "beta"] * slots)
            )
        )
        if any(outcome != OK for outcome, _ in outcomes):
            raise Failed(f"warm-up failed: {Counter(o for o, _ in outcomes)}")
    for sim in sims:
        async with session.post(sim + "/sim/reset") as response:
            response.raise_for_status()


async def settle(
    session: aiohttp.ClientSession, url: str, admin_key: str, sims: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Wait (bounded) until the pool is idle and every backend healthy, and the sims idle
    (a sim ends an aborted request a moment after the proxy let go of it); return the last
    state seen."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        pool = (await admin_state(session, url, admin_key))["sim"]
        stats = await sim_stats(session, sims)
        idle = pool["queued"] == 0 and pool["running"] == 0
        idle = idle and all(b["in_flight"] == 0 and b["healthy"] for b in pool["backends"])
        idle = idle and all(s["running"] == 0 and s["waiting"] == 0 for s in stats)
        if idle or time.monotonic() > deadline:
            return pool, stats
        await asyncio.sleep(0.2)


async def burst(session: aiohttp.ClientSession, url: str, n: int) -> list[tuple[int, float]]:
    """``n`` requests at once into the idle pool: (status, the proxy's X-Queue-Wait) each.
    Each takes ~200 ms: with a slot missing, one would wait that long, far above the limit."""

    async def one(i: int) -> tuple[int, float]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}
        headers = {
            "Authorization": f"Bearer {api_key(['alpha', 'beta'][i % 2])}",
            "X-Workload-Class": "interactive",
            "X-Request-Id": f"burst-{i}",
        }
        try:
            async with session.post(url + CHAT_PATH, json=body, headers=headers) as response:
                await response.read()
                return response.status, float(response.headers.get("X-Queue-Wait", "nan"))
        except aiohttp.ClientError:
            return 0, float("nan")

    return await asyncio.gather(*(one(i) for i in range(n)))


def access_log(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The proxy's JSON access lines by request id (other stdout lines are skipped)."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            lines.setdefault(entry["request_id"], []).append(entry)
    return lines


# What the proxy's access log may say of a request, by what its client saw.
EXPECTED_LOG = {
    OK: {("completed", 200)},
    LEFT_QUEUED: {("cancelled_queued", None), ("cancelled_running", None)},
    LEFT_MID_STREAM: {("cancelled_running", None)},
    **{rejection: {("rejected", 429)} for rejection in REJECTIONS.values()},
}


def agrees(outcome: str, logged: tuple[str, int | None]) -> bool:
    """Whether the proxy's (outcome, status) fits what the client saw; another status
    (already a failure of its own) only has to be the same status."""
    if outcome.startswith("status "):
        return logged[1] == int(outcome.split()[1])
    return logged in EXPECTED_LOG.get(outcome, set())


@dataclass
class LogCheck:
    """The access log held against the clients' outcomes."""

    pairs: Counter[tuple[str, str]] = field(default_factory=Counter)  # (ours, proxy's)
    missing: int = 0
    never_sent: int = 0  # leavers that hung up before the proxy had the request: fine
    duplicated: int = 0
    unknown: int = 0  # soak ids in the log that no client recorded
    mismatches: list[str] = field(default_factory=list)


def check_log(tally: Tally, log: dict[str, list[dict[str, Any]]]) -> LogCheck:
    result = LogCheck()
    for request_id, (_, _, outcome) in tally.outcomes.items():
        entries = log.get(request_id, [])
        if not entries:
            if outcome == LEFT_QUEUED:
                result.never_sent += 1
            else:
                result.missing += 1
            continue
        result.duplicated += len(entries) > 1
        entry = entries[0]
        seen = (entry["outcome"], entry["status"])
        result.pairs[outcome, f"{entry['outcome']} {entry['status'] or ''}".strip()] += 1
        if not agrees(outcome, seen):
            result.mismatches.append(f"{request_id}: client {outcome!r}, proxy {seen}")
    result.unknown = sum(1 for rid in log if rid.startswith("soak-") and rid not in tally.outcomes)
    return result


# --- the report -----------------------------------------------------------------------------

COLUMNS = [
    ("requests", None),
    ("200 done", {OK}),
    ("429 full", {"429 queue_full"}),
    ("429 age", {"429 queue_age"}),
    ("429 rate", {"429 rate"}),
    ("left queued", {LEFT_QUEUED}),
    ("left mid", {LEFT_MID_STREAM}),
]
KNOWN = set().union(*(outcomes for _, outcomes in COLUMNS if outcomes))


def is_error(outcome: str) -> bool:
    """Outcomes that mean the client did not get a proper answer."""
    return outcome.split()[0] in ("conn", "exception", "timeout") or "truncated" in outcome


def print_table(tally: Tally) -> None:
    heads = [name for name, _ in COLUMNS] + ["other status", "errors"]
    print(f"{'org':<8}" + "".join(f"{h:>13}" for h in heads))
    rows = [*tally.by_org().items(), ("total", tally.total())]
    for org, counts in rows:
        cells = [sum(counts.values())]
        cells += [sum(counts[o] for o in outcomes) for _, outcomes in COLUMNS[1:]]
        cells.append(sum(n for o, n in counts.items() if o not in KNOWN and not is_error(o)))
        cells.append(sum(n for o, n in counts.items() if is_error(o)))
        print(f"{org:<8}" + "".join(f"{c:>13}" for c in cells))
    odd = {o: n for o, n in tally.total().items() if o not in KNOWN}
    if odd:
        print(f"other outcomes: {dict(odd)}")


def print_intents(tally: Tally) -> None:
    """How the planned hang-ups went: a leaver may be answered or refused before it leaves."""
    by_intent: dict[str, Counter[str]] = {}
    for _, behaviour, outcome in tally.outcomes.values():
        by_intent.setdefault(behaviour, Counter())[outcome] += 1
    for behaviour in (LEAVE_QUEUED, LEAVE_MID_STREAM):
        counts = by_intent.get(behaviour, Counter())
        print(f"planned to {behaviour}: {sum(counts.values())} → {dict(counts.most_common())}")


def percentile(ordered: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of sorted values (nan if none)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def print_latency(tally: Tally) -> None:
    """From sending to the answer's end, of the 200s read to the end."""
    parts = []
    for org in [*ORGS, None]:
        got = tally.latencies(org)
        parts.append(
            f"{org or 'all'} p50 {percentile(got, 0.5) * 1e3:.0f} ms p99 "
            f"{percentile(got, 0.99) * 1e3:.0f} ms"
        )
    print(f"latency of the 200s: {'; '.join(parts)}")


def hostile_kind(request_id: str) -> str:
    return {"reader": READER, "upload": UPLOAD, "bomb": "bomb"}.get(
        request_id.removeprefix(HOSTILE_ID).split("-")[0], "?"
    )


def print_mix(run: Run, lines: dict[str, list[dict[str, Any]]]) -> None:
    """How the hostile mix's attempts ended, as it saw them and as the access log did."""
    print(f"hostile mix (its process's exit status {run.mix_status}):")
    mix = run.mix or Mix()
    for kind in HOSTILE_KINDS:
        ends = mix.seconds.get(kind, {})
        detail = "; ".join(
            f"{outcome} {len(took)} (p50 {percentile(sorted(took), 0.5):.1f} s, max "
            f"{max(took):.1f} s)"
            for outcome, took in sorted(ends.items(), key=lambda item: -len(item[1]))
        )
        print(f"  {kind:<24}{sum(map(len, ends.values())):>6} attempts: {detail}")
    logged = Counter(
        (hostile_kind(rid), f"{e['outcome']} {e['status'] or ''} {e['reason'] or ''}".strip())
        for rid, entries in lines.items()
        if rid.startswith(HOSTILE_ID)
        for e in entries
    )
    print(
        "  in the access log: "
        + ", ".join(f"{kind} {what} {n}" for (kind, what), n in sorted(logged.items()))
    )


@dataclass
class Checks:
    results: list[tuple[bool, str, str]] = field(default_factory=list)

    def add(self, passed: bool, name: str, detail: str) -> None:
        self.results.append((passed, name, detail))

    def print(self) -> None:
        for passed, name, detail in self.results:
            print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")

    @property
    def ok(self) -> bool:
        return all(passed for passed, _, _ in self.results)


def mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


def rss_check(checks: Checks, watch: Watch, seconds: float, hostile: bool) -> None:
    """Honest clients alone: the samples at 25 %, 50 %, 75 % and the end. With the hostile
    mix, what the proxy holds for it at any one second (up to queue_memory_mb of stalled
    bodies, the bombs in their reading and parsing) moves a sample by tens of MiB either
    way, so each mark is the median of its quarter's samples: a leak still moves those."""
    if hostile:
        quarters = {
            f: statistics.median(
                [rss for t, rss in watch.rss if f - 0.25 < t / seconds <= f] or [0]
            )
            for f in (0.25, 0.5, 0.75, 1.0)
        }
        marks, first, name = quarters, 0.5, "medians of each quarter; from the 2nd to the 4th"
    else:
        marks = {f: watch.rss_at(f, seconds) for f in (0.25, 0.5, 0.75, 1.0)}
        first, name = 0.25, "from 25 % to end"
    growth = (marks[1.0] - marks[first]) / marks[first]
    detail = "  ".join(f"{f:.0%} {mib(rss)}" for f, rss in marks.items())
    checks.add(
        growth < RSS_GROWTH_LIMIT,
        f"proxy RSS flat ({name}: growth < {RSS_GROWTH_LIMIT:.0%})",
        f"{detail}; growth {growth:+.1%} ({len(watch.rss)} samples, "
        f"min {mib(min(r for _, r in watch.rss))}, max {mib(max(r for _, r in watch.rss))})",
    )


def stderr_lines(fleet: Processes, name: str) -> list[str]:
    return [line for line in fleet.err(name).read_text(errors="replace").splitlines() if line]


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Run:
    args: argparse.Namespace
    fleet: Processes
    url: str = ""
    sims: list[str] = field(default_factory=list)
    pid: int = 0
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16))
    tally: Tally = field(default_factory=Tally)
    watch: Watch = field(default_factory=Watch)
    checks: Checks = field(default_factory=Checks)
    hostile: bool = False  # the hostile mix beside the honest clients
    mix: Mix | None = None  # how its attempts ended (None: it did not report)
    mix_status: int | None = None  # its process's exit status
    rss_settled: int = 0  # the proxy's RSS once the pool is idle after the soak


async def soak(run: Run) -> None:
    args = run.args
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        run.sims = start_sims(run.fleet, args.slots)
        await wait_ready(session, run.fleet, [s + "/health" for s in run.sims])
        run.url, run.pid = start_proxy(run.fleet, run.sims, args.slots, run.admin_key)
        await wait_ready(session, run.fleet, [run.url + "/readyz"])
        await warm_up(session, run.url, run.sims, args.slots)
        print(
            f"soak{' with the hostile mix' if run.hostile else ''}: {args.clients} clients, "
            f"{BACKENDS} backends × {args.slots} slots, "
            f"{args.seconds:g} s, seed {args.seed}; proxy pid {run.pid}\n"
            f"  orgs {', '.join(f'{org} {spec}' for org, (_, spec) in ORGS.items())}\n"
            f"  classes {', '.join(f'{cls} {spec}' for cls, spec in CLASSES.items())}\n"
            f"  limits {LIMITS}, pool timeouts {POOL_TIMEOUTS}",
            flush=True,
        )
        if run.hostile:
            print(
                f"  hostile mix ({HOSTILE_ORG}, weight 1): {READERS} slow readers "
                f"({READER_TOKENS}-token streams, {READER_RCVBUF} B receive buffer, never read, "
                f"let go after {READER_HOLD_S:g} s), {sum(HEADS.values())} slow heads from "
                f"{len(HEADS)} addresses (a byte every {HEAD_BYTE_EVERY_S:g} s), "
                f"{UPLOADS} uploads declaring {mib(UPLOAD_DECLARED)} that stall after "
                f"{mib(UPLOAD_SENT)}, 2 senders of ~10 MiB bombs; each again until the end",
                flush=True,
            )
        hung, crashed = await run_clients(session, run)
        pool, stats = await settle(session, run.url, run.admin_key, run.sims)
        run.rss_settled = harness.rss_bytes(run.pid)
        burst_results = await burst(session, run.url, BACKENDS * args.slots)
        after = await sim_stats(session, run.sims)
    await asyncio.sleep(0.2)  # the proxy writes its access lines at the next turn of its loop
    report(run, hung, crashed, pool, stats, burst_results, after)


async def run_clients(session: aiohttp.ClientSession, run: Run) -> tuple[int, int]:
    """The clients for --seconds, then their last requests; returns (hung, crashed) clients."""
    args = run.args
    stop = asyncio.Event()
    started = time.monotonic()
    if run.hostile:  # it stops when the clients do (it builds its bombs meanwhile)
        until = f"{time.time() + args.seconds:.3f}"
        argv = [sys.executable, __file__, "--hostile-mix", run.url, "--until", until]
        run.fleet.start("hostile", harness.Command(argv))
    watcher = asyncio.create_task(
        watch_proxy(session, run.url, run.admin_key, run.pid, run.watch, run.tally, started)
    )
    clients = [
        asyncio.create_task(client(i, session, run.url, args.seed, stop, run.tally))
        for i in range(args.clients)
    ]
    await asyncio.sleep(args.seconds)
    stop.set()
    done, pending = await asyncio.wait(clients, timeout=FINISH_TIMEOUT_S)
    for task in (*pending, watcher):
        task.cancel()
    await asyncio.gather(*pending, watcher, return_exceptions=True)
    if run.hostile:
        await collect_mix(run)
    crashed = [t.exception() for t in done if t.exception() is not None]
    for err in crashed[:3]:
        print(f"client crashed: {err!r}")
    return len(pending), len(crashed)


async def collect_mix(run: Run) -> None:
    """Wait (bounded) for the hostile mix's process to end, and take its outcomes."""
    proc = run.fleet.procs["hostile"]
    try:
        await asyncio.to_thread(proc.wait, FINISH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
    run.mix_status = proc.wait()
    lines = run.fleet.out("hostile").read_text().splitlines()
    with contextlib.suppress(IndexError, ValueError):
        run.mix = Mix(**json.loads(lines[-1]))


def report(
    run: Run,
    hung: int,
    crashed: int,
    pool: dict[str, Any],
    stats: list[dict[str, Any]],
    burst_results: list[tuple[int, float]],
    after: list[dict[str, Any]],
) -> None:
    """The table, what the backends and the proxy saw, then the checks."""
    lines = access_log(run.fleet.out("proxy"))
    log = check_log(run.tally, lines)
    samples = "".join(f"{t:.1f} {rss}\n" for t, rss in run.watch.rss)
    (run.fleet.work / "rss.txt").write_text(samples)  # seconds, bytes; kept with --logs
    print()
    print_table(run.tally)
    print_latency(run.tally)
    print_intents(run.tally)
    print_sides(run, stats, log)
    if run.hostile:
        print_mix(run, lines)
    print()
    accounting_checks(run, hung, crashed, stats, log)
    capacity_checks(run, stats)
    rss_check(run.checks, run.watch, run.args.seconds, run.hostile)
    if run.hostile:
        hostile_checks(run, lines)
    after_checks(run, pool, burst_results, after, sum(s["completed"] for s in stats))
    run.checks.print()


def print_sides(run: Run, stats: list[dict[str, Any]], log: LogCheck) -> None:
    """What the backends, /admin/state and the access log saw."""
    backends = "; ".join(
        f"{url} completed {s['completed']} aborted {s['aborted']} seen {s['requests_seen']} "
        f"max_concurrent {s['max_concurrent']}"
        + (
            f" (of them the slow readers': seen {s['hostile_seen']}, completed "
            f"{s['hostile_completed']}, aborted {s['hostile_aborted']})"
            if run.hostile
            else ""
        )
        for url, s in zip(run.sims, stats, strict=True)
    )
    print(f"backends: {backends}")
    watch = run.watch
    print(
        f"/admin/state: {watch.polls} polls, peak queued {watch.max_queued}, peak running "
        f"{watch.max_running}, peak in_flight {watch.max_in_flight}; the proxy's RSS once "
        f"the pool was idle after the soak {mib(run.rss_settled)}"
    )
    pairs = ", ".join(f"{ours} → {theirs} {n}" for (ours, theirs), n in sorted(log.pairs.items()))
    print(f"client outcome → proxy access log: {pairs}")


def accounting_checks(
    run: Run, hung: int, crashed: int, stats: list[dict[str, Any]], log: LogCheck
) -> None:
    """One answer per request, each a proper one, and the same count on every side."""
    tally, checks = run.tally, run.checks
    total, recorded = tally.total(), len(tally.outcomes)
    checks.add(
        recorded == tally.started and not hung and not crashed,
        "every request has exactly one outcome",
        f"{tally.started} sent, {recorded} outcomes, {hung} clients hung, {crashed} crashed",
    )
    errors = {o: n for o, n in total.items() if is_error(o)}
    checks.add(
        not errors,
        "no connection errors, timeouts or truncated answers",
        f"{sum(errors.values())} {errors or ''}".strip(),
    )
    others = {o: n for o, n in total.items() if o not in KNOWN and not is_error(o)}
    checks.add(
        not others,
        "no status but 200 and 429 (no 5xx, no 429 for the queue memory)",
        f"{sum(others.values())} {others or ''}".strip(),
    )
    completed = honest_completed(stats)
    hostile = (
        f"; the slow readers' left out: completed {sum(s['hostile_completed'] for s in stats)}"
        f", aborted {sum(s['hostile_aborted'] for s in stats)}"
        if run.hostile
        else ""
    )
    checks.add(
        total[OK] == completed,
        "200s read to the end == backends' completed",
        f"{total[OK]} vs {completed} (difference {total[OK] - completed}); backends aborted "
        f"{sum(s['aborted'] - s['hostile_aborted'] for s in stats)}, clients left mid-stream "
        f"{total[LEFT_MID_STREAM]}{hostile}",
    )
    checks.add(
        not (log.missing or log.duplicated or log.unknown or log.mismatches),
        "one access-log line per request, agreeing with the client",
        f"{recorded - log.missing - log.never_sent} logged, {log.missing} missing, "
        f"{log.duplicated} duplicated, {log.unknown} unknown, {len(log.mismatches)} disagree"
        f"{f' {log.mismatches[:3]}' if log.mismatches else ''}; "
        f"{log.never_sent} leavers hung up before sending",
    )


def capacity_checks(run: Run, stats: list[dict[str, Any]]) -> None:
    """Slots never exceeded, as the backends count (running + waiting) and as the proxy does."""
    slots, watch = run.args.slots, run.watch
    peaks = [s["max_concurrent"] for s in stats]
    run.checks.add(
        all(p <= slots for p in peaks),
        "backends never over their slots (sim max_concurrent)",
        f"max_concurrent {peaks}, slots {slots} each",
    )
    run.checks.add(
        not watch.over_slots and not watch.poll_errors and watch.polls > 0,
        "proxy never over the slots (/admin/state every second)",
        f"peak in_flight {watch.max_in_flight} of {watch.slots}, peak running "
        f"{watch.max_running}; {watch.polls} polls, errors {dict(watch.poll_errors)}, "
        f"violations {watch.over_slots[:3]}",
    )


def hostile_checks(run: Run, lines: dict[str, list[dict[str, Any]]]) -> None:
    """The hostile mix ran, and each kind was shed as its limit says, in time: a slow head
    answered 408 or closed, a stalled upload answered 408 or 429, a bomb refused 400 naming
    its cap (or 429), a slow reader refused or served, and its slot not held for it: every
    reader answered 200 that ended before the soak did is logged completed (the slot given
    back with the backend's end), or cut; held until the reader let go, it would be logged
    cancelled_running."""
    mix = run.mix
    run.checks.add(
        run.mix_status == 0 and mix is not None,
        "the hostile mix ran to the end",
        f"exit status {run.mix_status}, "
        f"{sum(mix.outcomes(k).total() for k in HOSTILE_KINDS) if mix else 0} attempts",
    )
    if mix is None:
        return
    for kind in HOSTILE_KINDS:
        ends = mix.seconds.get(kind, {})
        shed = {o: took for o, took in ends.items() if o in SHED[kind]}
        others = {o: len(took) for o, took in ends.items() if o not in SHED[kind] | {AT_END}}
        within = SHED_WITHIN_S[kind]
        slowest = max((max(took) for took in shed.values()), default=float("nan"))
        run.checks.add(
            bool(shed) and not others and slowest <= within,
            f"{kind}: each shed, within {within:g} s",
            f"{', '.join(f'{o} {len(t)}' for o, t in shed.items()) or 'none'}; slowest "
            f"{slowest:.1f} s; {len(ends.get(AT_END, []))} under way at the end"
            f"{f'; else {others}' if others else ''}",
        )
    served = [rid for rid, outcome in mix.ids.items() if outcome in (CUT, HELD)]
    logged = Counter(
        " ".join(str(e[k]) for k in ("outcome", "status", "reason") if e[k] is not None)
        for rid in served
        for e in lines.get(rid, [{"outcome": "missing", "status": None, "reason": None}])
    )
    fine = {"completed 200", "failed 200 client_timeout", "failed 200 client_too_slow"}
    run.checks.add(
        bool(served) and set(logged) <= fine and logged.total() == len(served),
        "no slot held for a slow reader (each answered 200 logged completed, or cut)",
        f"{len(served)} answered 200: {dict(logged)}",
    )


def after_checks(
    run: Run,
    pool: dict[str, Any],
    burst_results: list[tuple[int, float]],
    after: list[dict[str, Any]],
    completed: int,
) -> None:
    """The pool whole once the load is gone, and nothing in the proxy's stderr."""
    in_flight = [b["in_flight"] for b in pool["backends"]]
    healthy = [b["healthy"] for b in pool["backends"]]
    run.checks.add(
        pool["queued"] == 0 and pool["running"] == 0 and not any(in_flight) and all(healthy),
        f"pool whole after the soak (within {SETTLE_TIMEOUT_S:g} s)",
        f"queued {pool['queued']}, running {pool['running']}, in_flight {in_flight}, "
        f"healthy {healthy}",
    )
    statuses = Counter(status for status, _ in burst_results)
    max_wait = max(wait for _, wait in burst_results)
    served = sum(s["completed"] for s in after) - completed
    run.checks.add(
        statuses == {200: len(burst_results)}
        and max_wait < BURST_MAX_WAIT_S
        and served == len(burst_results),
        f"a burst of {len(burst_results)} (one per slot) served at once",
        f"statuses {dict(statuses)}, max queue wait {max_wait * 1e3:.1f} ms "
        f"(< {BURST_MAX_WAIT_S * 1e3:.0f}), backends completed {served}",
    )
    noise = stderr_lines(run.fleet, "proxy")
    run.checks.add(
        not noise,
        "proxy stderr empty (no backend marked down, no traceback)",
        f"{len(noise)} lines {noise[:5] or ''}".strip(),
    )


def print_side_by_side(quiet: Run, hostile: Run) -> None:
    """The honest clients' figures in both runs, org by org."""
    print(
        f"\nhonest clients without and with the hostile mix ({quiet.args.seconds:g} s each, "
        f"same seed and config, fresh processes); latency of the 200s read to the end"
    )
    cells = ("requests", "200 done", "429", "p50 ms", "p99 ms")
    width = 9 * len(cells)
    print(f"{'':<8}{'without':^{width}} |{'with the hostile mix':^{width}}")
    print(f"{'org':<8}" + " |".join("".join(f"{c:>9}" for c in cells) for _ in range(2)))
    for org in [*ORGS, None]:
        row = []
        for run in (quiet, hostile):
            counts = run.tally.by_org()[org] if org else run.tally.total()
            refused = sum(n for o, n in counts.items() if o.startswith("429"))
            got = run.tally.latencies(org)
            row.append(
                f"{counts.total():>9}{counts[OK]:>9}{refused:>9}"
                f"{percentile(got, 0.5) * 1e3:>9.0f}{percentile(got, 0.99) * 1e3:>9.0f}"
            )
        print(f"{org or 'total':<8}" + " |".join(row))
    for name, run in (("without", quiet), ("with the hostile mix", hostile)):
        passed = sum(ok for ok, _, _ in run.checks.results)
        failed = [name for ok, name, _ in run.checks.results if not ok]
        print(
            f"checks {name}: {passed} of {len(run.checks.results)} PASS"
            + (f"; FAIL: {'; '.join(failed)}" if failed else "")
        )


@contextlib.contextmanager
def work_dir(keep: Path | None) -> Iterator[Path]:
    """Where the processes write: ``keep``, or a temporary directory removed afterwards."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="sfq-soak-") as tmp:
        yield Path(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180, help="length of the soak")
    parser.add_argument("--slots", type=int, default=4, help="slots of each of the 2 backends")
    parser.add_argument("--clients", type=int, help="closed-loop clients (default: 10 × all slots)")
    parser.add_argument("--seed", type=int, default=1, help="seeds every client's requests")
    parser.add_argument(
        "--logs", type=Path, help="keep the config and the processes' output (access log) here"
    )
    parser.add_argument(
        "--hostile",
        action="store_true",
        help="soak twice, fresh processes each time: the honest clients alone, then beside "
        "the hostile mix (slow readers, slow heads, stalled uploads, bombs); both tables, "
        "then the honest figures side by side",
    )
    parser.add_argument("--hostile-mix", metavar="URL", help=argparse.SUPPRESS)  # the child
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hostile_mix:
        run_hostile_mix(args.hostile_mix, args.until)
        return
    args.clients = args.clients or 10 * BACKENDS * args.slots
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    began = time.monotonic()
    runs: list[Run] = []
    try:
        for hostile in [False, True] if args.hostile else [False]:
            logs = args.logs
            if logs is not None and args.hostile:
                logs = logs / ("hostile" if hostile else "honest")
            with work_dir(logs) as work, Processes(work) as fleet:
                if runs:
                    print()
                runs.append(Run(args, fleet, hostile=hostile))
                uvloop.run(soak(runs[-1]))
    except Failed as err:
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:
        print("interrupted: the proxy and the backends are stopped", file=sys.stderr)
        sys.exit(130)
    if args.hostile:
        print_side_by_side(*runs)
    print(f"run time {time.monotonic() - began:.1f} s")
    sys.exit(0 if all(run.checks.ok for run in runs) else 1)


if __name__ == "__main__":
    main()
