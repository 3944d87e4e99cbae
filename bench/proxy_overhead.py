"""Quick overhead check: requests/s straight to a simulated backend vs through sfq-proxy.

Starts `sfq-proxy sim-backend` (answers at once: --time-scale 1e6) and `sfq-proxy serve` as
separate processes, drives both with an aiohttp client from this process, and prints req/s,
p50/p99 latency and the proxy's CPU time per request (utime+stime from /proc).

    python bench/proxy_overhead.py [--seconds 5] [--concurrency 1 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

SIM_PORT, PROXY_PORT = 18101, 18080
DRAINS: list[asyncio.Task[None]] = []
HEADER = f"{'target':<8}{'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu µs/req':>8}"
KEY = "sk-bench"
BODY = {
    "model": "sim-llama",
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "Summarise the quarterly report in one line."}],
}


async def spawn(*args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sfq_proxy.cli", *args, stdout=asyncio.subprocess.PIPE
    )
    await proc.stdout.readline()  # both print one line once they listen
    DRAINS.append(asyncio.create_task(_drain(proc.stdout)))  # the access log goes on
    return proc


async def _drain(stream: asyncio.StreamReader) -> None:
    """Read and drop the access log: a full pipe would stall the proxy's event loop."""
    while await stream.read(65536):
        pass


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, concurrency: int, seconds: float) -> list[float]:
    """Closed-loop load: ``concurrency`` clients, each sending its next request at once."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {KEY}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            while (start := time.monotonic()) < deadline:
                async with session.post(url, json=BODY, headers=headers) as r:
                    await r.read()
                    assert r.status == 200, r.status
                latencies.append(time.monotonic() - start)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def row(name: str, c: int, lat: list[float], seconds: float, cpu: float | None) -> str:
    lat.sort()
    p99 = lat[int(len(lat) * 0.99)]
    cpu_us = f"{cpu / len(lat) * 1e6:8.0f}" if cpu is not None else f"{'':>8}"
    return (
        f"{name:<8}{c:>4} {len(lat) / seconds:>9.0f} {statistics.median(lat) * 1e3:>8.2f}"
        f" {p99 * 1e3:>8.2f} {cpu_us}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    config = {
        "listen": {"host": "127.0.0.1", "port": PROXY_PORT},
        "keys": [{"key": KEY, "org": "bench", "classes": ["interactive"]}],
        "pools": {
            "sim": {
                "models": ["sim-llama"],
                "backends": [{"url": f"http://127.0.0.1:{SIM_PORT}", "slots": 1024}],
            }
        },
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        yaml.safe_dump(config, file)
        file.flush()
        sim = await spawn(
            "sim-backend", "--port", str(SIM_PORT), "--time-scale", "1e6",
            "--max-num-seqs", "4096",
        )  # fmt: skip
        proxy = await spawn("serve", "--config", file.name)
        try:
            print(HEADER)
            for c in args.concurrency:
                direct = await load(
                    f"http://127.0.0.1:{SIM_PORT}/v1/chat/completions", c, args.seconds
                )
                before = cpu_seconds(proxy.pid)
                proxied = await load(
                    f"http://127.0.0.1:{PROXY_PORT}/v1/chat/completions", c, args.seconds
                )
                cpu = cpu_seconds(proxy.pid) - before
                print(row("direct", c, direct, args.seconds, None))
                print(row("proxy", c, proxied, args.seconds, cpu))
                print(f"{'':<12} proxy/direct throughput: {len(proxied) / len(direct):.2f}")
        finally:
            for proc in (proxy, sim):
                proc.terminate()
                await proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
