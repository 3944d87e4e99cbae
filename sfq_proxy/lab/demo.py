"""``sfq-proxy demo``: the proxy on its embedded config, in front of two simulated servers.

With ``--traffic`` it also plays three teams against each other, so fair sharing can be
watched with nothing else installed: analytics floods batch work, research sends a
steady batch stream, product's chat users send short interactive requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from urllib.parse import urlsplit

import aiohttp

from ..config import Config, default_config
from ..core.flows import flow_id
from ..http.runtime import PROXY, Proxy
from ..http.server import bound_url, running, wait_for_signal
from ..sim.server import SimBackend, SimConfig

DEMO_KEYS = {
    "sk-demo-product": "org product: interactive (default) or batch, weight 2",
    "sk-demo-analytics": "org analytics: batch only, at most 8 in flight",
    "sk-demo-research": "org research: batch (default) or interactive",
    "sk-demo-ops": "org ops: system (priority band) or interactive",
}


# (key, concurrent clients, max_tokens): each client sends its next request when one ends
TEAMS = (
    ("sk-demo-analytics", 24, 256),
    ("sk-demo-research", 4, 256),
    ("sk-demo-product", 2, 32),
)
REPORT_EVERY_S = 5.0


async def demo(config: Config | None = None, *, traffic: bool = False) -> None:
    config = config or default_config()
    async with contextlib.AsyncExitStack() as stack:
        for pool in config.pools.values():
            for backend in pool.backends:
                port = urlsplit(backend.url).port
                if port is None:  # the simulator must listen where the proxy will connect
                    raise ValueError(f"demo backend {backend.url} needs an explicit port")
                sim = SimBackend(SimConfig(models=list(pool.models), max_num_seqs=backend.slots))
                await sim.start(host="127.0.0.1", port=port)
                stack.push_async_callback(sim.stop)
        runner = await stack.enter_async_context(running(config))
        url = bound_url(runner)
        print(_banner(url, config), flush=True)
        if traffic:
            model = next(iter(config.pools.values())).models[0]
            driver = asyncio.create_task(_play(url, model, runner.app[PROXY]))
            stack.callback(driver.cancel)
        await wait_for_signal()
        print("stopping…", flush=True)


async def _play(url: str, model: str, proxy: Proxy) -> None:
    """Run the teams' clients and print, per flow, what it got in each interval."""
    latencies: dict[str, list[float]] = defaultdict(list)
    async with aiohttp.ClientSession() as session:
        clients = [
            asyncio.create_task(_client(session, url, model, key, max_tokens, latencies))
            for key, concurrency, max_tokens in TEAMS
            for _ in range(concurrency)
        ]
        try:
            while True:
                before = _charged(proxy)
                await asyncio.sleep(REPORT_EVERY_S)
                _report(before, _charged(proxy), latencies)
        finally:
            for task in clients:
                task.cancel()


async def _client(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    key: str,
    max_tokens: int,
    latencies: dict[str, list[float]],
) -> None:
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"Authorization": f"Bearer {key}"}
    while True:
        start = time.monotonic()
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
        latencies[key].append(time.monotonic() - start)


def _charged(proxy: Proxy) -> dict[str, float]:
    """Cost charged so far per flow, read from the proxy's own metrics."""
    totals = proxy.metrics.totals("cost_charged")
    return {flow_id(org, cls): v for (org, cls, _), v in totals.items()}


def _report(
    before: dict[str, float], after: dict[str, float], latencies: dict[str, list[float]]
) -> None:
    served = {flow: after[flow] - before.get(flow, 0.0) for flow in after}
    total = sum(served.values()) or 1.0
    lines = [f"-- last {REPORT_EVERY_S:g} s: {'share of cost':>13}"]
    lines += [f"{flow:<24} {value / total:>13.0%}" for flow, value in sorted(served.items())]
    for key, values in sorted(latencies.items()):
        if values:
            values.sort()
            median = values[len(values) // 2]
            lines.append(f"  {key:<20} {len(values):>4} done, median latency {median:5.2f} s")
        values.clear()
    print("\n".join(lines), flush=True)


def _banner(url: str, config: Config) -> str:
    model = next(iter(config.pools.values())).models[0]
    keys = "\n".join(f"  {key:<20} {what}" for key, what in DEMO_KEYS.items())
    backends = sum(len(p.backends) for p in config.pools.values())
    return f"""\
sfq-proxy demo: proxy on {url}, {backends} simulated backends

API keys:
{keys}

Try it:
  curl {url}/v1/chat/completions -H 'Authorization: Bearer sk-demo-product' \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 32, "messages": [{{"role": "user", "content": "hi"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="sk-demo-analytics")
  print(client.chat.completions.create(model="{model}", max_tokens=32,
        messages=[{{"role": "user", "content": "hi"}}]).choices[0].message.content)

Metrics: {url}/metrics    Ctrl-C stops everything."""
