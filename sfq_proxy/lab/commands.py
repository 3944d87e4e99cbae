"""The scenario lab: one scenario, every policy simulated, and the real proxy measured.

``simulate_all`` runs the discrete-event simulator once per policy. ``run_real`` builds a
proxy config from the scenario (one key per team, weights as the scenario gives them, no
admission limits that the simulator does not model), starts simulated backends with the
scenario's engine ``time_scale`` times faster, puts the real proxy in front, and replays
the scenario through it with ``loadgen``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml

from ..config import Config, parse_config
from ..core.fair_queue import check_size
from ..core.flows import flow_id
from ..http.proxy import PROXY, Proxy
from ..runner.server import bound_url, running
from ..sim.server import SimBackend
from ..sim.settings import SimConfig
from . import report
from .loadgen import check_replayable, run_load
from .policies import (
    DEFAULT_PRIORITY_ORDER,
    POLICY_NAMES,
    SFQ_ESTIMATE_ONLY,
    SFQ_FIFO,
    make_policy,
    trues_up,
)
from .pool import Dispatch, DispatchMode
from .scenario import Scenario, Served, Team, load_scenario
from .simulator import POOL, EngineSample, cost_of, simulate

MODEL = "lab"


def default_quantum(scenario: Scenario) -> float:
    """DRR's quantum at the largest request cost (before calibration, which only lowers
    estimates), so every visit can send a request."""
    return max((cost_of(r, scenario.pool) for r in scenario.requests), default=1.0)


def default_policies(scenario: Scenario) -> list[str]:
    """Every policy, and before ``sfq``: ``sfq-fifo`` when a class of the scenario has size
    buckets (what they change, on the same run), ``sfq-estimate-only`` when some of its
    requests have hidden input tokens (what the true-up buys)."""
    names = [name for name in POLICY_NAMES if name not in (SFQ_FIFO, SFQ_ESTIMATE_ONLY)]
    if any(team.size_buckets is not None for team in scenario.teams):
        names.insert(names.index("sfq"), SFQ_FIFO)
    if any(r.hidden_input_tokens for r in scenario.requests):
        names.insert(names.index("sfq"), SFQ_ESTIMATE_ONLY)
    return names


def simulate_all(
    scenario: Scenario,
    policies: Sequence[str] | None = None,
    *,
    quantum: float | None = None,
    priority_order: Sequence[str] = DEFAULT_PRIORITY_ORDER,
    engine_logs: dict[str, list[EngineSample]] | None = None,
) -> dict[str, list[Served]]:
    """Each policy's run (``default_policies`` when not given). ``engine_logs``, when given,
    receives each run's ``engine_log`` (the simulator's samples of the engines), by policy."""
    quantum = quantum or default_quantum(scenario)
    if policies is None:
        policies = default_policies(scenario)
    runs = {}
    for name in policies:
        log: list[EngineSample] | None = None
        if engine_logs is not None:
            log = engine_logs.setdefault(name, [])
        runs[name] = simulate(
            scenario,
            make_policy(name, quantum=quantum, priority_order=priority_order),
            true_up=trues_up(name),
            engine_log=log,
        )
    return runs


def has_engine_limits(scenario: Scenario) -> bool:
    """Whether the scenario's engine declares a scheduler of its own (``max_num_seqs``, a KV
    cache or the priority policy) or the proxy dispatches by its readings, so the engines'
    queues are worth a table."""
    engine = scenario.pool.engine
    return (
        engine.max_num_seqs is not None
        or engine.kv_cache_tokens is not None
        or engine.scheduling_policy != "fcfs"
        or scenario.pool.dispatch.engine
    )


def with_slots(scenario: Scenario, slots: int | Literal["auto"]) -> Scenario:
    """``scenario`` with the proxy's ``slots`` per backend (``auto``: engine dispatch only);
    the engines keep their batch (``max_num_seqs``, the old slots if the scenario left it to
    them): the same backends, another proxy setting."""
    if slots != "auto" and slots < 1:
        raise ValueError("slots must be positive, or auto")
    pool = scenario.pool
    if slots == "auto" and not pool.dispatch.engine:
        raise ValueError("slots auto only with engine dispatch")
    engine = replace(pool.engine, max_num_seqs=pool.max_num_seqs)
    return replace(scenario, pool=replace(pool, slots=slots, engine=engine))


def with_dispatch(scenario: Scenario, mode: DispatchMode) -> Scenario:
    """``scenario`` with the proxy's dispatch ``mode``; the rest of its ``dispatch`` section
    (or the defaults) stays."""
    pool = scenario.pool
    return replace(scenario, pool=replace(pool, dispatch=replace(pool.dispatch, mode=mode)))


def with_engine_ceiling(scenario: Scenario, cls: str, ceiling: float) -> Scenario:
    """``scenario`` with ``engine_ceiling`` = ``ceiling`` for class ``cls``."""
    if not (0 < ceiling <= 1):
        raise ValueError("an engine ceiling is in (0, 1]")
    if all(team.cls != cls for team in scenario.teams):
        raise ValueError(f"no team of the scenario is of class {cls!r}")
    teams = tuple(replace(t, engine_ceiling=ceiling) if t.cls == cls else t for t in scenario.teams)
    return replace(scenario, teams=teams)


def team_keys(scenario: Scenario) -> dict[str, str]:
    return {team.name: f"sk-lab-{team.name}" for team in scenario.teams}


def proxy_config(
    scenario: Scenario, backend_urls: Sequence[str], time_scale: float = 1.0
) -> Config:
    """The proxy's config for ``scenario``: its flows' weights, its classes' size buckets,
    engine ceilings and priorities, its pool's dispatch (engine dispatch's periods in real
    seconds: ``time_scale`` times shorter, within the proxy's bounds), and nothing the
    simulator does not model (no caps, rate limits, queue limits or deadlines)."""
    org_weights: dict[str, float] = {}
    for team in scenario.teams:
        if org_weights.setdefault(team.org, team.weight) != team.weight:
            raise ValueError(f"org {team.org} has teams of different weights: not expressible")
    keys = team_keys(scenario)
    pool = scenario.pool
    backend: dict[str, Any] = {"slots": pool.slots}
    if pool.capacity is not None:
        backend["capacity"] = pool.capacity
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "keys": [{"key": keys[t.name], "org": t.org, "classes": [t.cls]} for t in scenario.teams],
        "classes": {team.cls: _class_section(team) for team in scenario.teams},
        "orgs": {org: {"weight": weight} for org, weight in org_weights.items()},
        "pools": {
            POOL: {
                "models": [MODEL],
                "cost": {
                    "input_weight": pool.input_weight,
                    "output_weight": pool.output_weight,
                    "output_ratio": pool.output_ratio,
                },
                "timeouts": {"first_byte_s": 3600},
                "backends": [{"url": url, **backend} for url in backend_urls],
                **_dispatch_section(pool.dispatch, time_scale),
            }
        },
        "retry": {"budget_ratio": 0},
    }
    return parse_config(yaml.safe_dump(data), environ={})


def _class_section(team: Team) -> dict[str, Any]:
    """A team's class in the proxy's config: weight 1 (the org carries the team's weight),
    its size buckets, its engine ceiling and its engine priority."""
    section: dict[str, Any] = {"weight": 1, "engine_ceiling": team.engine_ceiling}
    if team.engine_priority:
        section["engine_priority"] = team.engine_priority
    if team.size_buckets is not None:
        section |= {"size_buckets": list(team.size_buckets), "max_overtaken": team.max_overtaken}
    return section


def _dispatch_section(dispatch: Dispatch, time_scale: float) -> dict[str, Any]:
    """The pool's ``dispatch`` section: none for static dispatch; engine dispatch's periods
    scaled to real seconds, at least the proxy's shortest interval (0.05 s), its age bound
    four intervals at least and its scrape's timeout half of it."""
    if not dispatch.engine:
        return {}
    interval = max(0.05, dispatch.interval_s / time_scale)
    max_age = max(4 * interval, dispatch.max_age_s / time_scale)
    return {"dispatch": {
        "mode": "engine", "interval_s": interval, "max_age_s": max_age,
        "timeout_s": max_age / 2, "allowance": dispatch.allowance,
        "kv_ceiling": dispatch.kv_ceiling, "settle_s": dispatch.settle_s / time_scale,
        "fallback_slots": dispatch.fallback_slots,
    }}  # fmt: skip


async def run_real(
    scenario: Scenario,
    *,
    time_scale: float,
    on_start: Callable[[Proxy], None] | None = None,
    on_served: Callable[[Served], None] | None = None,
) -> list[Served]:
    """The scenario through the real proxy in front of simulated backends, time-scaled."""
    engine, pool = scenario.pool.engine, scenario.pool
    sim_config = SimConfig(
        models=[MODEL],
        max_num_seqs=pool.max_num_seqs,
        kv_cache_tokens=engine.kv_cache_tokens,
        scheduling_policy=engine.scheduling_policy,
        prefill_tokens_per_s=engine.prefill_tokens_per_s,
        decode_tokens_per_s=engine.decode_tokens_per_s,
        batch_slowdown=engine.batch_slowdown,
        output_mode="min_tokens",  # generate the scenario's output (loadgen sends min_tokens)
        time_scale=time_scale,
        # a context of the whole cache (vLLM's limit); every request fits (load_scenario)
        max_model_len=engine.kv_cache_tokens or 1 << 24,
    )
    async with contextlib.AsyncExitStack() as stack:
        urls = []
        for _ in range(pool.backends):
            sim = await stack.enter_async_context(SimBackend(sim_config))
            urls.append(sim.url)
        runner = await stack.enter_async_context(running(proxy_config(scenario, urls, time_scale)))
        if on_start is not None:
            on_start(runner.app[PROXY])
        served, refused = await run_load(
            scenario, bound_url(runner), team_keys(scenario), time_scale=time_scale,
            on_served=on_served,
        )  # fmt: skip
    if refused:
        raise RuntimeError(f"the proxy refused {len(refused)} requests, e.g. {refused[0]}")
    return served


# -- the commands -------------------------------------------------------------------------


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``simulate`` and ``loadgen``; ``demo --scenario`` calls :func:`demo_scenario`."""
    p = sub.add_parser("simulate", help="run a scenario under each policy, in virtual time")
    _scenario_arguments(p)
    p.add_argument("--policy", action="append", choices=POLICY_NAMES, help="repeatable")
    p.add_argument("--quantum", type=float, help="DRR quantum (default: the largest cost)")
    p.add_argument(
        "--priority-order", default=",".join(DEFAULT_PRIORITY_ORDER),
        help="classes for strict priority, highest first",
    )  # fmt: skip
    p.add_argument(
        "--max-overtaken", type=int, metavar="K",
        help="override max_overtaken of every class with size buckets (try several K)",
    )  # fmt: skip
    p.add_argument(
        "--slots", type=_slots, action="append", metavar="N|auto",
        help="override the proxy's slots per backend (the engines keep their max_num_seqs); "
        "repeatable: a run each; auto: engine dispatch only",
    )  # fmt: skip
    p.add_argument(
        "--dispatch", choices=("static", "engine"), action="append",
        help="override the pool's dispatch mode; repeatable: a run each (with every --slots)",
    )  # fmt: skip
    p.add_argument(
        "--engine-ceiling", type=_class_ceiling, action="append", default=[],
        metavar="CLASS=F", help="override a class's engine_ceiling (a fraction in (0, 1])",
    )  # fmt: skip
    p.set_defaults(func=_simulate_command)

    p = sub.add_parser("loadgen", help="drive a scenario against a running proxy")
    _scenario_arguments(p)
    p.add_argument("--url", required=True, help="the proxy, e.g. http://127.0.0.1:8080")
    p.add_argument("--key", action="append", default=[], metavar="TEAM=KEY",
                   help="API key per team (default sk-lab-TEAM)")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0, help="replay N times faster")
    p.set_defaults(func=_loadgen_command)


def _slots(text: str) -> int | Literal["auto"]:
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected an integer, or auto") from None


def _class_ceiling(text: str) -> tuple[str, float]:
    cls, _, value = text.partition("=")
    try:
        return cls, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError("expected CLASS=F, e.g. batch=0.75") from None


def _scenario_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", help="scenario YAML, e.g. config/scenarios/abc.yaml")
    p.add_argument("--duration", type=float, help="cut the scenario to its first N seconds")
    p.add_argument("--out", type=Path, help="write the report (tables, PNGs) to this folder")
    p.add_argument("--no-plots", action="store_true", help="tables only")


def with_max_overtaken(scenario: Scenario, k: int) -> Scenario:
    """``scenario`` with ``max_overtaken`` = ``k`` in every class that has size buckets."""
    check_size(0, k)
    teams = tuple(
        t if t.size_buckets is None else replace(t, max_overtaken=k) for t in scenario.teams
    )
    return replace(scenario, teams=teams)


def variants(
    scenario: Scenario,
    modes: Sequence[DispatchMode | None],
    slots: Sequence[int | Literal["auto"] | None],
) -> dict[str, Scenario]:
    """``scenario`` under each dispatch mode with each slots setting (None: the scenario's
    own), by a label such as ``engine auto``; static dispatch with ``auto`` is left out.
    One variant only: labelled ``""``."""
    out = {}
    for mode in modes:
        moded = scenario if mode is None else with_dispatch(scenario, mode)
        for n in slots:
            if n == "auto" and not moded.pool.dispatch.engine:
                continue
            variant = moded if n is None else with_slots(moded, n)
            out[f"{variant.pool.dispatch.mode} {variant.pool.slots}"] = variant
    if not out:
        raise ValueError("slots auto only with engine dispatch (--dispatch engine)")
    return out if len(out) > 1 else {"": next(iter(out.values()))}


def _simulate_command(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.scenario, duration_s=args.duration)
    if args.max_overtaken is not None:
        scenario = with_max_overtaken(scenario, args.max_overtaken)
    try:
        for cls, ceiling in args.engine_ceiling:
            scenario = with_engine_ceiling(scenario, cls, ceiling)
        runs_of = variants(scenario, args.dispatch or [None], args.slots or [None])
    except ValueError as err:
        sys.exit(f"{args.scenario}: {err}")
    engine = any(has_engine_limits(v) for v in runs_of.values())
    logs: dict[str, list[EngineSample]] | None = {} if engine else None
    runs: dict[str, list[Served]] = {}
    for label, variant in runs_of.items():
        own: dict[str, list[EngineSample]] = {}
        for name, run in simulate_all(
            variant, args.policy, quantum=args.quantum,
            priority_order=args.priority_order.split(","), engine_logs=own,
        ).items():  # fmt: skip
            key = f"{name} {label}".rstrip()
            runs[key] = run
            if logs is not None:
                logs[key] = own[name]
    _report(args, scenario, runs, logs)
    return 0


def _replayable(path: str, duration_s: float | None) -> Scenario:
    """The scenario at ``path`` if a real run can replay it; else exit saying why."""
    scenario = load_scenario(path, duration_s=duration_s)
    try:
        check_replayable(scenario)
    except ValueError as err:
        sys.exit(f"{path}: {err}")
    return scenario


def _loadgen_command(args: argparse.Namespace) -> int:
    scenario = _replayable(args.scenario, args.duration)
    keys = team_keys(scenario) | dict(k.split("=", 1) for k in args.key)
    served, refused = asyncio.run(
        run_load(scenario, args.url.rstrip("/"), keys, time_scale=args.time_scale)
    )
    for request, status in refused:
        print(f"refused: request {request.id} of team {request.team}: HTTP {status}")
    _report(args, scenario, {"proxy": served})
    return 0


def _report(
    args: argparse.Namespace,
    scenario: Scenario,
    runs: dict[str, list[Served]],
    engine_logs: dict[str, list[EngineSample]] | None = None,
) -> None:
    table = report.rows(runs, scenario.teams)
    print(report.format_table(table))
    print(report.LEGEND)
    buckets = report.size_buckets_table(table)
    if buckets:
        print(buckets)
    true_up = report.true_up_table(runs, scenario.teams)
    if true_up:
        print(true_up)
    checks = [
        c for name, run in runs.items() for c in report.bound_checks(run, scenario.teams, name)
    ]
    print(report.bound_table(checks))
    engines = report.engine_table(runs, engine_logs or {}, scenario.teams)
    if engines:
        print(engines)
    if args.out:
        written = report.write_report(
            args.out, scenario.name, table, runs, scenario.teams, plots=not args.no_plots
        )
        print("\n".join(f"wrote {path}" for path in written))


async def demo_scenario(path: str, *, time_scale: float, duration_s: float | None) -> None:
    """``sfq-proxy demo --scenario``: backends, proxy and load in one go, a live per-flow
    table every second, then the report beside the simulator's SFQ prediction."""
    scenario = _replayable(path, duration_s)
    served: list[Served] = []
    proxy: list[Proxy] = []
    ticker = asyncio.create_task(_tick(scenario, served, proxy))
    try:
        real = await run_real(
            scenario, time_scale=time_scale, on_start=proxy.append, on_served=served.append
        )
    finally:
        ticker.cancel()
    runs = {"proxy": real, "sfq (simulated)": simulate_all(scenario, ["sfq"])["sfq"]}
    print(report.format_table(report.rows(runs, scenario.teams)))


async def _tick(scenario: Scenario, served: list[Served], proxy: list[Proxy]) -> None:
    while True:
        await asyncio.sleep(1.0)
        if proxy:
            print(_live_table(scenario, served, proxy[0]), flush=True)


def _live_table(scenario: Scenario, served: list[Served], proxy: Proxy) -> str:
    lags = {v.flow: v.lag for pool in proxy.pools.values() for v in pool.scheduler.queue.flows()}
    total = sum(s.served_cost for s in served) or 1.0
    lines = [f"{'team':<10} {'done':>6} {'cost share':>10} {'wait p50':>9} {'wait p99':>9} "
             f"{'meter lag':>10}"]  # fmt: skip
    for team in scenario.teams:
        mine = [s for s in served if s.request.team == team.name]
        waits = sorted(s.start_s - s.request.time_s for s in mine) or [math.nan]
        share = sum(s.served_cost for s in mine) / total
        lag = lags.get(flow_id(team.org, team.cls), math.nan)
        lines.append(
            f"{team.name:<10} {len(mine):>6} {share:>10.0%} {_rank(waits, 50):>8.2f}s "
            f"{_rank(waits, 99):>8.2f}s {lag:>10.0f}"
        )
    return "\n".join(lines)


def _rank(values: list[float], p: float) -> float:
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]
