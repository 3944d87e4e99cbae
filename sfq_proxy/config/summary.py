"""What ``sfq-proxy check-config`` prints: a config in words, and no secret.

Per pool its cost, the ceiling per request and c_max, its backends and health; each class's
worst-case share of each pool; the keys (by source, never the secret), the orgs and the
weight of every flow the keys can create. Then warnings: what is valid but will not work
on this machine (a calibration state file the proxy could not write).

In the config package because it reads nothing but a validated :class:`Config`; apart from
the models because nothing but ``check-config`` needs it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from .classes import ClassSpec, band_cap, granted_classes
from .cost import CostSpec
from .errors import format_number as _num
from .keys import Access, OrgSpec, usable_models
from .paths import ExtraPathSpec
from .pools import (
    AffinitySpec,
    BackendSpec,
    DispatchSpec,
    HealthSpec,
    PoolSpec,
    RateSpec,
    pool_slots,
    without_credentials,
)
from .proxy import Config
from .state import RedisState
from .tracing import TracingSpec
from .usage import BudgetSpec


def summary(config: Config) -> str:
    """Human summary for ``sfq-proxy check-config``; shows no secret."""
    lines = [
        f"listen {config.listen.host}:{config.listen.port} "
        f"(max body {config.limits.max_body_bytes} B, drain {_num(config.drain_timeout_s)} s)",
        _state_summary(config.state),
        _tracing_summary(config.tracing),
    ]
    granted = granted_classes(config.keys, config.classes)
    for name, pool in config.pools.items():
        lines += _pool_summary(name, pool)
        lines += _share_summary(pool_slots(pool), granted)
    lines.append("classes:")
    lines += [
        f"  {name}: {_class_summary(spec)}" + ("" if name in granted else " (no key grants it)")
        for name, spec in config.classes.items()
    ]
    lines.append("keys:")
    lines += [
        f"  keys[{i}]: {f'name={k.name}, ' if k.name else ''}org={k.org}, "
        f"classes=[{', '.join(k.classes)}] ({k.source})"
        + _key_access(config.key_access(k.org, k.pools, k.models))
        + _budgets(k.budgets)
        for i, k in enumerate(config.keys)
    ]
    lines += _stores(config)
    lines.append("orgs (the pools their keys reach):")
    lines += [
        f"  {name}: {_org_summary(config.org(name))}; {_reach(config, name)}"
        for name in dict.fromkeys([*config.orgs, *(k.org for k in config.keys)])
    ]
    lines.append("flows (org/class/pool: weight):")
    lines += [f"  {flow}" for flow in _flow_summary(config)]
    cal = config.calibration
    lines.append(
        f"calibration: learns chars/token and output_ratio from usage, starting from each "
        f"pool's cost settings; half-life {cal.half_life_requests} requests, an org's own "
        f"ratio after {cal.min_org_samples} requests; state "
        f"{cal.state_file or 'in memory only'}"
    )
    return "\n".join(lines)


def _state_summary(state: RedisState | None) -> str:
    if state is None:
        return "state: memory (this process alone is each pool's fairness domain)"
    where = f"redis from env {state.redis_env}" if state.redis_env else "redis"
    if state.redis and not state.redis_env:
        where = f"redis {without_credentials(state.redis)}"
    cluster = " cluster" if state.cluster else ""
    return (
        f"state: {where}{cluster}: every process sharing it is one fairness domain per pool; "
        f"a dead one's slots back within {_num(state.lease_ttl_s)} s; "
        + _WHEN_LOST[state.when_unreachable]
    )


def _tracing_summary(spec: TracingSpec | None) -> str:
    if spec is None or not spec.enabled:
        return "tracing: off"
    headers = ", ".join(f"{h} from env {v}" for h, v in spec.headers_env.items())
    return (
        f"tracing: a span per request to {without_credentials(spec.endpoint)} (OTLP/HTTP) as "
        f"service {spec.service_name}; spans kept at {_num(spec.sample_ratio)}, a client's "
        f"trace alike; up to {spec.max_queue_size} spans queued, sent "
        f"{spec.max_export_batch_size} at a time every {_num(spec.schedule_delay_s)} s"
        + (f"; headers {headers}" if headers else "")
    )


_WHEN_LOST = {
    "fail_closed": "Redis unreachable: requests refused (503)",
    "local": "Redis unreachable: each replica schedules alone on its share of every backend",
}


def _flow_summary(config: Config) -> list[str]:
    """Effective weight of every flow the keys can create (priority flows have none): each
    key's classes in the pools it may use."""
    flows = dict.fromkeys(
        (k.org, cls, pool)
        for k in config.keys
        for cls in k.classes
        for pool in _usable(config, k.org, k.pools, k.models)
    )
    return [
        f"{org}/{cls}/{pool}: "
        + ("priority" if config.classes[cls].priority else _num(config.flow_weight(org, cls)))
        for org, cls, pool in flows
    ]


def _health_summary(health: HealthSpec, keyed: bool) -> str:
    """One line for ``check-config``; ``keyed`` when the pool has an upstream key."""
    streak = health.consecutive_failures
    failures = "1 failure" if streak == 1 else f"{streak} failures in a row"
    out = f"out for {_num(health.cooldown_s)} s after {failures}"
    if health.mode == "passive":
        failing = "connect errors, 5xx, timeouts"
        return f"health: passive, no probe; {out} ({failing}), then trusted again"
    key = ", with the upstream key" if keyed and health.send_key else ""
    return (
        f"health: active, {health.method} {health.path} every {_num(health.interval_s)} s "
        f"(timeout {_num(health.timeout_s)} s{key}); {out}, back at the next good probe"
    )


def _fmt_caps(spec: BaseModel, names: Iterable[str]) -> list[str]:
    """``name=value`` for the optional settings of ``spec`` that are set."""
    return [f"{n}={_num(getattr(spec, n))}" for n in names if getattr(spec, n) is not None]


def _class_summary(spec: ClassSpec) -> str:
    head = ["priority"] if spec.priority else [f"weight={_num(spec.weight)}"]
    caps = ("max_in_flight", "max_queue_age_s", "max_queue_len", "max_request_tokens")
    sizes = []
    if spec.size_buckets is not None:  # docs/design.md §3, Size buckets inside a flow
        bounds = ", ".join(_num(b) for b in spec.size_buckets)
        sizes = [f"size_buckets=[{bounds}] (cost), max_overtaken={spec.overtaken_at_most}"]
    engine = [] if spec.engine_ceiling == 1 else [f"engine_ceiling={_num(spec.engine_ceiling)}"]
    return ", ".join(head + _fmt_caps(spec, caps) + sizes + engine)


def _pct(share: float, *, up: bool) -> str:
    """``share`` as a percentage to 0.1, rounded up for an upper bound, down for a lower one."""
    tenths = round(share * 1000, 6)  # so that 0.5 stays 500, not 500.0000001
    return f"{(math.ceil(tenths) if up else math.floor(tenths)) / 10:g}%"


def _share_summary(slots: int, classes: Mapping[str, ClassSpec]) -> list[str]:
    """Each granted class's worst-case share of a pool's ``slots``, every class backlogged.

    A priority class runs at most its ``max_in_flight``; the fair queue gets at least the
    rest, divided by class weight — assuming the same orgs, of equal weight, behind every
    class (a class with more orgs backlogged gets more). An SFQ class's own
    ``max_in_flight`` can hold it lower.
    """
    band = band_cap(classes)
    rest = 1 - band / slots
    sfq_weight = sum(spec.weight for spec in classes.values() if not spec.priority)
    lines = [f"  worst-case shares of {slots} slots (all classes backlogged, equal org weights):"]
    for name, spec in classes.items():
        cap = spec.max_in_flight
        if spec.priority:
            share = _pct((cap or slots) / slots, up=True)
            lines.append(f"    {name}: up to {share} (priority, max_in_flight={cap})")
            continue
        of_rest = spec.weight / sfq_weight
        share_f, note = rest * of_rest, f" ({_pct(of_rest, up=False)} of the rest)" if band else ""
        if cap is not None and cap / slots < share_f:
            share_f, note = cap / slots, f" (held by its max_in_flight={cap})"
        lines.append(f"    {name}: at least {_pct(share_f, up=False)}{note}")
    return lines


def _key_access(access: Access) -> str:
    """``, may use …`` for a key whose access is restricted (docs/access.md); else nothing.
    Its models when listed (they are kept to its pools, so they say it all), else its pools."""
    pools, models = access
    kind, names = ("models", models) if models is not None else ("pools", pools)
    return "" if names is None else f", may use {kind} [{', '.join(sorted(names))}]"


def _reach(config: Config, org: str) -> str:
    """The pools an org's keys of the file reach; for an org whose keys come from the admin
    API only, the pools its own lists allow such keys."""
    keys = [k for k in config.keys if k.org == org]
    if not keys:
        allowed = ", ".join(_usable(config, org, None, None))
        return f"no key in this file; admin API keys reach at most [{allowed}]"
    reached = {pool for k in keys for pool in _usable(config, org, k.pools, k.models)}
    return f"reaches [{', '.join(pool for pool in config.pools if pool in reached)}]"


def _usable(
    config: Config, org: str, pools: Iterable[str] | None, models: Iterable[str] | None
) -> list[str]:
    """The pools a key of ``org`` listing ``pools`` and ``models`` can call a model of."""
    return list(usable_models(config.pools, config.key_access(org, pools, models)))


def _org_summary(spec: OrgSpec) -> str:
    caps = _fmt_caps(spec, ("max_in_flight", "rpm", "tpm"))
    return ", ".join([f"weight={_num(spec.weight)}", *caps]) + _budgets(spec.budgets)


def _budgets(budgets: list[BudgetSpec]) -> str:
    """``, budgets [day 100000 tokens (warn 80%), month 50 money (warn 90%)]``, or nothing."""
    if not budgets:
        return ""
    each = [
        f"{b.period} {_num(b.tokens)} tokens" if b.tokens is not None else
        f"{b.period} {_num(b.money or 0)} money"
        for b in budgets
    ]  # fmt: skip
    warns = [f" (warn {_num(b.warn_at * 100)}%)" for b in budgets]
    return f", budgets [{', '.join(a + w for a, w in zip(each, warns, strict=True))}]"


def _stores(config: Config) -> list[str]:
    """Where the admin API keeps the keys it makes, and where usage is kept."""
    if config.state is not None:
        return ["admin API keys: in Redis", "usage: in Redis"]
    keys = config.key_store_file or "off (no key_store_file: only the keys of this file)"
    usage = config.usage.file or "in the process only (no usage.file)"
    return [f"admin API keys: {keys}", f"usage: {usage}"]


def _injection(cost: CostSpec) -> str:
    field = cost.inject_max_tokens
    if field is False:
        return "none asked: sent unchanged"
    return f"none asked: sent {field}={cost.default_max_tokens}"


def _affinity_summary(affinity: AffinitySpec) -> str:
    """Where a request goes when it has a key (docs/design.md §5, Affinity)."""
    named = [f"header {affinity.session_header}"] if affinity.session_header else []
    named += ["the body's user field"] if affinity.use_user_field else []
    keys = [f"the session named by {' or '.join(named)}"] if named else []
    if affinity.prefix_chars:
        keys.append(
            f"the prompt's first {affinity.prefix_chars} chars (chat: up to its first answer)"
        )
    return (
        f"affinity: by {', else '.join(keys)}; a backend takes at most "
        f"{_num(affinity.load_factor)}× the pool's average load + {affinity.slack}, else the "
        "key's next"
    )


def _backend_slots(backend: BackendSpec) -> str:
    slots = "slots auto" if backend.slots == "auto" else f"{backend.slots} slots"
    return slots + ("" if backend.capacity is None else f", capacity {backend.capacity}")


def _dispatch_summary(dispatch: DispatchSpec) -> str:
    """Engine dispatch's timeline and bounds, so that a reading's life can be checked."""
    kv = "off" if dispatch.kv_ceiling is None else _num(dispatch.kv_ceiling)
    return (
        f"dispatch: engine (reads {dispatch.metrics_path} every {_num(dispatch.interval_s)} s, "
        f"timeout {_num(dispatch.timeout_s)} s; older than {_num(dispatch.max_age_s)} s: "
        f"static slots, at least {dispatch.fallback_slots} for auto), allowance "
        f"{dispatch.allowance} waiting per engine, KV ceiling {kv}"
    )


def _extra_path_summary(extra: ExtraPathSpec) -> str:
    """A path and its cost rule, so that what such a request is charged (a fixed count, the
    text of which fields) can be checked before traffic shows it."""
    parts = [f"{extra.cost.fixed} tokens"] if extra.cost.fixed else []
    if extra.cost.input_fields:
        parts.append(f"the text of {', '.join(extra.cost.input_fields)}")
    return f"{extra.path} ({' + '.join(parts)}, as input)"


def _pool_summary(name: str, pool: PoolSpec) -> list[str]:
    cost = pool.cost
    tokens = (
        f"tokenizer {cost.tokenizer}"
        if cost.tokenizer
        else f"{_num(cost.chars_per_token)} chars/token"
    )
    lines = [
        f"pool {name}: models [{', '.join(pool.models)}], {pool.family} servers",
        f"  cost: {_num(cost.input_weight)}·in + {_num(cost.output_weight)}·out "
        f"(default_max_tokens={cost.default_max_tokens}, output_ratio={_num(cost.output_ratio)}, "
        f"{tokens})",
        f"  per request: at most {cost.max_request_tokens} tokens in + out (c_max "
        f"{_num(max(cost.input_weight, cost.output_weight) * cost.max_request_tokens)}), "
        f"more is {cost.over_limit.replace('refuse', 'refus')}ed; {_injection(cost)}",
    ]
    lines += [f"  backend {b.name}: {b.url}, {_backend_slots(b)}" for b in pool.backends]
    if pool.engine:
        lines.append("  " + _dispatch_summary(pool.dispatch))
    if pool.extra_paths:
        lines.append("  extra paths: " + "; ".join(map(_extra_path_summary, pool.extra_paths)))
    if not pool.stream_usage:
        lines.append("  streams: no usage reported; output tokens counted from their events")
    lines.append("  " + _health_summary(pool.health, keyed=pool.upstream_key_env is not None))
    if pool.affinity is not None:
        lines.append("  " + _affinity_summary(pool.affinity))
    if pool.rate is not None:
        lines.append(f"  rate: {', '.join(_fmt_caps(pool.rate, RateSpec.model_fields))}")
    if pool.upstream_key_env is not None:
        lines.append(f"  upstream key from env {pool.upstream_key_env}")
    return lines


def warnings(config: Config) -> list[str]:
    """What is valid in ``config`` but will not work here, as this user: one line each."""
    used = {key.org for key in config.keys}
    out = [
        f"warning: orgs.{name}: no key in this file uses this org (keys_from_api: its keys "
        "are made through the admin API); check its name if that is not so"
        for name, spec in config.orgs.items()
        if spec.keys_from_api and name not in used
    ]
    state_file = config.calibration.state_file
    if state_file:
        problem = _unwritable(Path(state_file))
        if problem:
            out.append(
                f"warning: calibration.state_file {state_file}: {problem}: what calibration "
                "learns will not be kept across restarts (the proxy logs a warning at every "
                "save); create it, or run as a user who may write there"
            )
    return out + _usage_warnings(config)


def _usage_warnings(config: Config) -> list[str]:
    """Usage that would be lost, or would count no money (docs/usage-and-budgets.md)."""
    out = []
    budgets = any(o.budgets for o in config.orgs.values()) or any(k.budgets for k in config.keys)
    billing = budgets or any(pool.prices for pool in config.pools.values())
    file = config.usage.file
    if config.state is None and file is None and billing:
        out.append(
            "warning: usage.file is not set: usage is kept in this process only, lost at "
            "restart (and budgets start again from nothing); set it to a SQLite file"
        )
    elif config.state is None and file is not None and (problem := _unwritable(Path(file))):
        out.append(f"warning: usage.file {file}: {problem}: the proxy will not start")
    if config.state is not None and file is not None:
        out.append("warning: usage.file is not used with state: redis (usage is in Redis)")
    if any(pool.prices for pool in config.pools.values()):
        out += [
            f"warning: pools.{name} has no prices: its requests count no money"
            for name, pool in config.pools.items()
            if not pool.prices
        ]
    return out


def _unwritable(path: Path) -> str | None:
    """Why the proxy, as this user, could not replace ``path`` (a new file in its directory,
    renamed over it), or None."""
    directory = path.parent
    if path.is_dir():
        return "is a directory"
    if not directory.exists():
        return f"directory {directory} does not exist"
    if not directory.is_dir():
        return f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable by this user (uid {os.getuid()})"
    if path.exists() and not os.access(path, os.R_OK):
        return "not readable by this user: the proxy would start afresh"
    return None
