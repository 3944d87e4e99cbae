"""No client can hold the event loop by what it asks the proxy to parse (issue 39;
docs/design.md §6, Bounded numbers and Parsing off the loop).

Eight senders, in a process of their own, post ~10 MiB hostile bodies to a real
``sfq-proxy serve`` process over and over: 300,000 one-character messages and an escaped
surrogate pair; 9.6 MiB of tool definitions; 23,000 content parts, each with arrays nested
200 deep. Meanwhile an honest org sends small chats and ``/healthz`` is probed. Each
hostile body must get its 400 naming the limit it broke, the honest org's median latency
must stay within 50 ms and ``/healthz``'s 99th percentile within 100 ms.

These are the bounds the issue asks for, held against an adversary on a shared machine
(two cores for the proxy, its parse worker, the senders and this test), not a benchmark:
each run prints its figures. With the caps and the parse worker: honest p50 2–3 ms,
``/healthz`` p99 4–34 ms. Before them (3328b37) the loop spent 0.3–2.7 s of CPU on each
hostile body (bench/hostile_bodies.py): in the same run one honest request ended within
the 9 s measured, after 11–13 s (a 502 or 504), and ``/healthz`` answered once or twice,
after 6–11 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
from proxy_lab import KEYS, MODEL, Lab, config_yaml, serve_process

SENDERS = 8
HOSTILE_S = 10.0  # how long the senders keep sending
SETTLE_S = 1.0  # the honest org starts measuring once the senders are under way
HONEST_P50_S = 0.050
HEALTHZ_P99_S = 0.100
# what each kind of hostile body is refused for: the limit its 400 names
LIMITS = {
    "messages": "limits.max_messages",
    "tools": "limits.max_tools",
    "nested_parts": "limits.max_content_parts",
}

# The senders: argv is the proxy's URL, the key, the model and the seconds to send for.
# They print "ready" once their bodies are built, then, at the end, every answer's status
# and error message, by kind of body, as JSON.
HOSTILE = r"""
import asyncio, json, sys, time
import aiohttp

url, key, model = sys.argv[1:4]
seconds, senders = float(sys.argv[4]), int(sys.argv[5])
SIZE = int(9.6 * 2**20)
head = '{"model":"' + model + '","max_tokens":0,'

def messages():
    tiny = '{"role":"user","content":"a"},' * 300_000
    return head + '"messages":[' + tiny + '{"role":"user","content":"\\ud83d\\ude00"}]}'

def tools():
    tool = '{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}'
    tools = ",".join([tool] * (SIZE // (len(tool) + 1)))
    return head + '"messages":[{"role":"user","content":"hi"}],"tools":[' + tools + "]}"

def nested_parts():
    part = '{"type":"text","text":"a","x":' + "[" * 200 + "]" * 200 + "}"
    parts = ",".join([part] * (SIZE // (len(part) + 1)))
    return head + '"messages":[{"role":"user","content":[' + parts + "]}]}"

bodies = {name: make().encode() for name, make in
          [("messages", messages), ("tools", tools), ("nested_parts", nested_parts)]}
kinds = [list(bodies)[i % len(bodies)] for i in range(senders)]
answers = {name: [] for name in bodies}

async def send(http, kind, until):
    headers = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
    while time.monotonic() < until:
        async with http.post(url + "/v1/chat/completions", data=bodies[kind], headers=headers) as r:
            text = await r.text()
            try:
                message = json.loads(text)["error"]["message"]
            except Exception:
                message = text[:200]
            answers[kind].append([r.status, message])

async def main():
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        print("ready", flush=True)
        until = time.monotonic() + seconds
        await asyncio.gather(*(send(http, kind, until) for kind in kinds))
    print(json.dumps(answers), flush=True)

asyncio.run(main())
"""


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _honest(
    http: aiohttp.ClientSession, url: str, until: float, statuses: list[int]
) -> list[float]:
    """Small chats of org A, one after the other: their latencies (and ``statuses``)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEYS['A']}"}
    latencies = []
    while time.monotonic() < until:
        start = time.perf_counter()
        async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
        latencies.append(time.perf_counter() - start)
        statuses.append(r.status)
        await asyncio.sleep(0.01)
    return latencies


async def _healthz(
    http: aiohttp.ClientSession, url: str, until: float, statuses: list[int]
) -> list[float]:
    latencies = []
    while time.monotonic() < until:
        start = time.perf_counter()
        async with http.get(f"{url}/healthz") as r:
            await r.read()
        latencies.append(time.perf_counter() - start)
        statuses.append(r.status)
        await asyncio.sleep(0.02)
    return latencies


async def test_hostile_bodies_get_their_400_and_hold_nobody_up(lab: Lab, tmp_path: Path) -> None:
    sim = await lab.backend(time_scale=1000.0)
    proc, url = await serve_process(config_yaml([sim.url]), tmp_path)
    senders = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOSTILE, url, KEYS["B"], MODEL, str(HOSTILE_S), str(SENDERS),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert senders.stdout is not None
    try:
        assert (await asyncio.wait_for(senders.stdout.readline(), 60)).strip() == b"ready"
        await asyncio.sleep(SETTLE_S)
        until = time.monotonic() + HOSTILE_S - SETTLE_S
        http = await lab.http()
        statuses: list[int] = []
        honest, healthz = await asyncio.gather(
            _honest(http, url, until, statuses), _healthz(http, url, until, statuses)
        )
        out, _ = await asyncio.wait_for(senders.communicate(), 120)
    finally:
        if senders.returncode is None:
            senders.kill()
            await senders.wait()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)
    answers: dict[str, list[list[object]]] = json.loads(out.decode().splitlines()[-1])
    print(
        f"\nhonest: {len(honest)} requests, p50 {statistics.median(honest) * 1e3:.1f} ms, "
        f"p99 {_p(honest, 0.99) * 1e3:.1f} ms; /healthz: {len(healthz)} probes, "
        f"p50 {statistics.median(healthz) * 1e3:.1f} ms, p99 {_p(healthz, 0.99) * 1e3:.1f} ms; "
        f"hostile answers: { {kind: len(got) for kind, got in answers.items()} }"
    )
    assert set(statuses) == {200}
    for kind, limit in LIMITS.items():
        assert answers[kind], f"no {kind} body was answered"
        for status, message in answers[kind]:
            assert status == 400, (kind, status, message)
            assert isinstance(message, str)
            assert limit in message, (kind, message)
    assert statistics.median(honest) <= HONEST_P50_S
    assert _p(healthz, 0.99) <= HEALTHZ_P99_S
