"""What a hostile body costs the proxy's event loop, and its parse worker (issue 39).

    python bench/hostile_bodies.py [--bodies 5] [--checkout DIR]

Runs ``sfq-proxy serve`` (of this checkout, or of ``--checkout DIR``: a ``git worktree`` or
``git archive`` of another commit, for a before/after) and posts, one at a time, ~10 MiB
bodies the proxy must refuse: 300,000 one-character messages and an escaped surrogate pair;
9.6 MiB of tool definitions; 23,000 content parts each nesting arrays 200 deep; and, within
every cap, one message whose text part holds 10,000 arrays nesting 500 deep, with
``max_tokens`` 0 (a 400 after a whole parse). For each kind: the CPU its main thread (the
event loop) spent per body, from ``/proc/<pid>/task/<pid>/schedstat`` (nanoseconds), the CPU
of its other processes (the parse worker) per body, and the slowest ``/healthz`` answer
while the bodies were sent (probed every 5 ms). A small chat's cost is the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import harness
import yaml

KEY = "sk-bench-hostile"
MODEL = "bench-model"
SIZE = int(9.6 * 2**20)
CONFIG = f"""
listen: {{host: 127.0.0.1, port: 0}}
keys: [{{key: {KEY}, org: hostile, classes: [batch]}}]
pools:
  bench:
    models: [{MODEL}]
    backends: [{{url: "http://127.0.0.1:9", slots: 4}}]
"""
HEAD = '{"model":"' + MODEL + '","max_tokens":0,'


def _messages() -> bytes:
    tiny = '{"role":"user","content":"a"},' * 300_000
    return (HEAD + '"messages":[' + tiny + '{"role":"user","content":"\\ud83d\\ude00"}]}').encode()


def _tools() -> bytes:
    tool = '{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}'
    tools = ",".join([tool] * (SIZE // (len(tool) + 1)))
    return (HEAD + '"messages":[{"role":"user","content":"hi"}],"tools":[' + tools + "]}").encode()


def _nested_parts() -> bytes:
    part = '{"type":"text","text":"a","x":' + "[" * 200 + "]" * 200 + "}"
    parts = ",".join([part] * (SIZE // (len(part) + 1)))
    return (HEAD + '"messages":[{"role":"user","content":[' + parts + "]}]}").encode()


def _within_caps() -> bytes:
    deep = ",".join(["[" * 500 + "]" * 500] * (SIZE // 1001))
    part = '{"type":"text","text":"a","x":[' + deep + "]}"
    return (HEAD + '"messages":[{"role":"user","content":[' + part + "]}]}").encode()


def _small() -> bytes:
    return (HEAD + '"messages":[{"role":"user","content":"Hello there"}]}').encode()


KINDS = {
    "small chat": _small,
    "300k messages": _messages,
    "9.6 MiB tools": _tools,
    "23k nested parts": _nested_parts,
    "nested, within caps": _within_caps,
}


def _cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
        return int(stat.read().split()[0])


def _process_cpu_ns(pid: int) -> int:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += _cpu_ns(pid, int(task))
        except OSError:
            continue
    return total


async def _probe(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> float:
    slowest = 0.0
    while not stop.is_set():
        start = time.perf_counter()
        async with http.get(f"{url}/healthz") as reply:
            await reply.read()
        slowest = max(slowest, time.perf_counter() - start)
        await asyncio.sleep(0.005)
    return slowest


async def _send(http: aiohttp.ClientSession, url: str, raw: bytes) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    async with http.post(f"{url}/v1/chat/completions", data=raw, headers=headers) as reply:
        text = await reply.text()
    return reply.status, json.loads(text)["error"]["message"] if reply.status != 200 else ""


async def _measure(url: str, pid: int, bodies: int) -> None:
    """Each kind's bodies one at a time, nothing else sent, for the CPU; then again with
    ``/healthz`` probed, for its slowest answer."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        print(f"{'body':<22}{'MiB':>6}  {'status':<8}{'loop ms':>9}{'worker ms':>11}"
              f"{'answer ms':>11}{'healthz max ms':>16}  message")  # fmt: skip
        for name, make in KINDS.items():
            raw = make()
            count = bodies * 20 if name == "small chat" else bodies
            loop_ns = others_ns = 0
            wall = 0.0
            for _ in range(count):
                others = harness.tree_pids(pid)[1:]
                before = _cpu_ns(pid, pid), sum(_process_cpu_ns(p) for p in others)
                start = time.perf_counter()
                status, message = await _send(http, url, raw)
                wall += time.perf_counter() - start
                await asyncio.sleep(0.05)  # the worker's threads are done handing it back
                others = harness.tree_pids(pid)[1:]
                loop_ns += _cpu_ns(pid, pid) - before[0]
                others_ns += sum(_process_cpu_ns(p) for p in others) - before[1]
            stop = asyncio.Event()
            probe = asyncio.create_task(_probe(http, url, stop))
            for _ in range(count):
                await _send(http, url, raw)
            stop.set()
            slowest = await probe
            print(f"{name:<22}{len(raw) / 2**20:>6.2f}  {status:<8}{loop_ns / count / 1e6:>9.2f}"
                  f"{others_ns / count / 1e6:>11.1f}{wall / count * 1e3:>11.1f}"
                  f"{slowest * 1e3:>16.1f}  {message[:50]}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bodies", type=int, default=5, help="bodies of each kind")
    parser.add_argument(
        "--checkout", type=harness.checkout, default=harness.ROOT, help="whose sfq_proxy to run"
    )
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory() as tmp, harness.Processes(Path(tmp)) as procs:
        config = yaml.safe_load(CONFIG)  # its backend answers nothing: /healthz, not /readyz
        proxy = harness.sfq_proxy(procs, "sfq-proxy", config, src=checkout, ready_path="/healthz")
        proxy.ready()
        print(f"sfq-proxy of {checkout} at {proxy.url} (pid {proxy.proc.pid})")
        asyncio.run(_measure(proxy.url, proxy.proc.pid, args.bodies))


if __name__ == "__main__":
    main()
