"""``sfq-proxy demo``: the proxy on its embedded config, in front of two simulated servers.

With ``--traffic`` it also plays three teams against each other, so fair sharing can be
watched with nothing else installed: analytics floods batch work, research sends a
steady batch stream, product's chat users send short interactive requests. Every few
seconds it prints, per flow, its weight, how much of the interval it was backlogged, the
share of the served cost it is entitled to and the share it got.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp

from ..config import Config, default_config
from ..core.flows import flow_id, org_and_class
from ..http.proxy import PROXY, Proxy
from ..runner.server import bound_url, running
from ..sim.server import SimBackend
from ..sim.settings import SimConfig

ADMIN_KEY_ENV = "SFQ_DEMO_ADMIN_KEY"  # demo.yaml's admin_key_env
SIM_PORT_ENVS = ("SFQ_DEMO_SIM_PORT_1", "SFQ_DEMO_SIM_PORT_2")  # in demo.yaml's backend URLs
TRY_KEY, TRY_FLOW = "sk-demo-product", "product/interactive"  # a team that does not flood
DEMO_KEYS = {
    "sk-demo-product": "org product: interactive (default) or batch, weight 2",
    "sk-demo-analytics": "org analytics: batch only, at most 8 in flight",
    "sk-demo-research": "org research: batch (default) or interactive",
    "sk-demo-ops": "org ops: system (priority band) or interactive",
}


@dataclass(frozen=True)
class Team:
    key: str
    flow: str  # the key's default class: where its requests go
    clients: int  # each sends its next request when its last one is answered
    max_tokens: int


TEAMS = (
    Team("sk-demo-analytics", "analytics/batch", 24, 256),  # floods: 24 requests at all times
    Team("sk-demo-research", "research/batch", 8, 256),  # enough to keep a queue too
    Team("sk-demo-product", "product/interactive", 2, 32),  # two chat users: short requests
)
REPORT_EVERY_S = 5.0
SAMPLE_EVERY_S = 0.02  # how often the report looks at who is backlogged: short gaps count
BACKLOGGED_AT = 0.99  # requests waiting at (nearly) every sample: backlogged all along


def admin_key() -> str:
    """The demo's admin key: ``$SFQ_DEMO_ADMIN_KEY``, else a fresh random one."""
    return os.environ.get(ADMIN_KEY_ENV, "").strip() or f"sk-demo-admin-{os.urandom(8).hex()}"


def demo_config(
    admin: str,
    host: str | None = None,
    port: int | None = None,
    sim_ports: Mapping[str, int] | None = None,
) -> Config:
    """demo.yaml with the admin key, the simulated servers' ports, and ``host``/``port`` (when
    given) for the proxy's listen address."""
    config = default_config(
        {ADMIN_KEY_ENV: admin, **{k: str(v) for k, v in (sim_ports or {}).items()}}
    )
    given = {"host": host, "port": port}
    listen = config.listen.model_copy(update={k: v for k, v in given.items() if v is not None})
    return config.model_copy(update={"listen": listen})


async def demo(
    *, host: str | None = None, port: int | None = None, admin: str, traffic: bool = False
) -> None:
    """Start the simulated servers (on free ports), then the proxy, until SIGINT/SIGTERM."""
    async with contextlib.AsyncExitStack() as stack:
        spec = next(iter(demo_config(admin).pools.values()))
        sim_ports = {}
        for env, backend in zip(SIM_PORT_ENVS, spec.backends, strict=True):
            seqs = spec.slots_of(backend)
            sim = SimBackend(SimConfig(models=list(spec.models), max_num_seqs=seqs))
            await sim.start(host="127.0.0.1", port=0)
            stack.push_async_callback(sim.stop)
            sim_ports[env] = sim.port
        config = demo_config(admin, host, port, sim_ports)
        runner = await stack.enter_async_context(running(config))
        url = bound_url(runner)
        stop = asyncio.Event()  # before the banner: whoever reads it may stop the demo at once
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print(banner(url, config, admin, traffic=traffic), flush=True)
        if traffic:
            model = next(iter(config.pools.values())).models[0]
            driver = asyncio.create_task(_play(url, model, runner.app[PROXY]))
            stack.callback(driver.cancel)
        await stop.wait()
        print("stopping…", flush=True)


@dataclass
class Interval:
    """What the report saw of each flow since its last line."""

    backlogged: Counter[str] = field(default_factory=Counter)  # samples with a queue
    samples: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def sample(self, proxy: Proxy) -> None:
        self.samples += 1
        for pool in proxy.pools.values():
            for view in pool.flow_views():
                if view.backlog > 0:
                    self.backlogged[view.flow] += 1


async def _play(url: str, model: str, proxy: Proxy) -> None:
    """Run the teams' clients and print, per flow, what it got in each interval."""
    interval = Interval()
    async with aiohttp.ClientSession() as session:
        clients = [
            asyncio.create_task(_client(session, url, model, team, interval))
            for team in TEAMS
            for _ in range(team.clients)
        ]
        try:
            while True:
                before = _charged(proxy)
                interval.samples, interval.backlogged = 0, Counter()
                for latencies in interval.latencies.values():
                    latencies.clear()
                for _ in range(round(REPORT_EVERY_S / SAMPLE_EVERY_S)):
                    await asyncio.sleep(SAMPLE_EVERY_S)
                    interval.sample(proxy)
                print(report(before, _charged(proxy), interval, proxy.config), flush=True)
        finally:
            for task in clients:
                task.cancel()


async def _client(
    session: aiohttp.ClientSession, url: str, model: str, team: Team, interval: Interval
) -> None:
    body = {
        "model": model,
        "max_tokens": team.max_tokens,
        "messages": [{"role": "user", "content": "hi"}],
    }
    headers = {"Authorization": f"Bearer {team.key}"}
    while True:
        start = time.monotonic()
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            await r.read()
        interval.latencies[team.flow].append(time.monotonic() - start)


def _charged(proxy: Proxy) -> dict[str, float]:
    """Cost charged so far per flow, read from the proxy's own metrics."""
    totals = proxy.metrics.totals("cost_charged")
    return {flow_id(org, cls): v for (org, cls, _), v in totals.items()}


def report(
    before: Mapping[str, float], after: Mapping[str, float], interval: Interval, config: Config
) -> str:
    """One interval: per flow its weight, how much of it the flow was backlogged, the share
    of the served cost it is entitled to, the share it got, and its clients' latency.

    SFQ shares the pool by weight among the flows that have requests waiting; a flow whose
    queue empties gets all it asks for, and what it leaves goes to the backlogged ones. So a
    flow backlogged all along is entitled to its weight over the weights of the flows
    backlogged all along, of what the others left; another flow is entitled to what it
    asked for ("asked"), which it got.
    """
    served = {flow: after[flow] - before.get(flow, 0.0) for flow in after}
    flows = sorted(set(served) | set(interval.latencies) | set(interval.backlogged))
    total = sum(served.values()) or 1.0
    share = {flow: served.get(flow, 0.0) / total for flow in flows}
    weight = {flow: config.flow_weight(*org_and_class(flow)) for flow in flows}
    part = {flow: interval.backlogged[flow] / max(interval.samples, 1) for flow in flows}
    always = [flow for flow in flows if part[flow] >= BACKLOGGED_AT]
    left = 1.0 - sum(share[flow] for flow in flows if flow not in always)
    always_weight = sum(weight[flow] for flow in always) or 1.0
    lines = [
        f"-- last {REPORT_EVERY_S:g} s",
        f"  {'flow':<22}{'weight':>7}{'backlogged':>12}{'entitled':>10}{'served':>8}"
        f"{'done':>6}{'median latency':>16}",
    ]
    for flow in flows:
        backlogged = "always" if flow in always else f"{part[flow]:.0%}"
        entitled = f"{weight[flow] / always_weight * left:.0%}" if flow in always else "asked"
        latencies = sorted(interval.latencies.get(flow, []))
        median = f"{latencies[len(latencies) // 2]:.2f} s" if latencies else "—"
        lines.append(
            f"  {flow:<22}{weight[flow]:>7g}{backlogged:>12}{entitled:>10}{share[flow]:>8.0%}"
            f"{len(latencies):>6}{median:>16}"
        )
    all_weight = sum(weight.values()) or 1.0
    clients = {team.flow: team.clients for team in TEAMS}
    for flow in flows:
        fair = weight[flow] / all_weight  # its share were every flow here backlogged
        if flow not in always and share[flow] < fair:
            few = f" ({clients[flow]} clients, a request each)" if flow in clients else ""
            lines.append(
                f"  * {flow}, not always backlogged{few}, got all it asked for:\n"
                f"    {share[flow]:.0%}, less than its weight's {fair:.0%}; the backlogged "
                "flows split the rest by weight"
            )
    return "\n".join(lines)


def banner(url: str, config: Config, admin: str, *, traffic: bool = False) -> str:
    model = next(iter(config.pools.values())).models[0]
    keys = "\n".join(f"  {key:<20} {what}" for key, what in DEMO_KEYS.items())
    backends = [b.name or b.url for p in config.pools.values() for b in p.backends]
    weight = config.flow_weight(*org_and_class(TRY_FLOW))
    source = (
        f"${ADMIN_KEY_ENV}"
        if os.environ.get(ADMIN_KEY_ENV, "").strip()
        else "generated for this run"
    )
    table = (
        f"""

Every {REPORT_EVERY_S:g} s, per flow (org/class): its weight (org weight × class weight); how
much of the interval it was backlogged (had requests waiting for a slot); the share of the
served cost it is entitled to: a flow backlogged all along, its weight over the weights of the
flows backlogged all along, of what the others left; any other, what it asked for; the share
it got; the requests answered, and their median latency. analytics floods batch work (24
clients), research sends batch work (8), product's 2 chat users send short requests."""
        if traffic
        else ""
    )
    return f"""\
sfq-proxy demo: proxy on {url}, {len(backends)} simulated backends ({", ".join(backends)})

API keys:
{keys}
Admin key: {admin} ({source}; set {ADMIN_KEY_ENV} to choose it)

Try it with product's key ({TRY_FLOW}, weight {weight:g}: not a team that floods the pool):
  curl {url}/v1/chat/completions -H 'Authorization: Bearer {TRY_KEY}' \\
    -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 32, "messages": [{{"role": "user", "content": "hi"}}]}}'

  curl -s {url}/admin/state -H 'Authorization: Bearer {admin}'

  # Python, with the openai package (.venv/bin/python has it)
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="{TRY_KEY}")
  print(client.chat.completions.create(model="{model}", max_tokens=32,
        messages=[{{"role": "user", "content": "hi"}}]).choices[0].message.content)

Metrics: {url}/metrics    Ctrl-C stops everything.{table}"""
