"""Prometheus metrics (prefix ``sfq_``): who gets the GPUs, who waits, and why.

Per-flow events are kept in plain dicts and rendered at scrape time, so that orgs can be
*folded*: at most ``max_labelled_orgs`` orgs carry their own ``org`` label; when another
needs one, the least recently active org's series are added into ``org="other"`` and
removed, so a flood of keys cannot blow up Prometheus and ``other`` only ever grows.
Levels (queue length, in flight, meter lag, health) are read from the live state at
scrape time: a flow's gauges vanish when the fair queue forgets it. The registry also
serves ``sfq_build_info`` and the process's own metrics (``process_metrics.py``), and under
``serve --workers N`` every worker's counts (``worker_metrics.py``).
"""

from __future__ import annotations

import bisect
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..core.calibration import Calibration, InputModel
from ..core.flows import org_and_class
from ..core.usage import Level
from ..state.pool import Pool
from . import process_metrics, worker_metrics

FLOW_LABELS = ["org", "class", "pool"]
OTHER = "other"
# 10 ms to 1 h, about three buckets per decade, so p50/p95/p99 resolve at every scale
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900, 1800, 3600)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# counter name → (help, name of its extra label or None)
COUNTERS = {
    "requests": ("Finished requests by outcome: completed, rejected, cancelled_queued, "
                 "cancelled_running, upstream_error, failed", "outcome"),
    "rejections": ("Requests refused before being queued or while queued, by reason", "reason"),
    "failures": ("Requests that failed once dispatched (or by a fault of the proxy), by the "
                 "code of their error: upstream_timeout, upstream_cut, deadline, bad_gateway, "
                 "internal_error", "reason"),
    "upstream_errors": ("Error answers of backends passed to clients, by status", "status"),
    "cost_charged": ("Estimated cost charged at dispatch (share: its rate per flow)", None),
    "cost_actual": ("The cost formula on the tokens backends reported using (compare with "
                    "cost_charged: a gap is mis-estimation or gaming)", None),
    "cost_trued_up": ("What the flows' charges were trued up by when their requests ended "
                      "(the cost the backend reported, or at least the estimate without a "
                      "report, minus the estimate), by direction: up (a debt) or down (a "
                      "refund)", "direction"),
    "prompt_tokens": ("Prompt tokens the backends reported using", None),
    "completion_tokens": ("Completion tokens the backends reported (or streamed) generating", None),
    "retries": ("Requests sent again, by what failed (unreachable or the status)", "reason"),
    "retry_budget_refusals": ("Retries refused because the flow's budget was spent", None),
}  # fmt: skip
HISTOGRAMS = {
    "queue_wait_seconds": ("Time from admission (or a retry) to dispatch", WAIT_BUCKETS),
    "time_to_first_token_seconds": ("Dispatch to the first streamed chunk", LATENCY_BUCKETS),
    "request_duration_seconds": ("End to end: the request's arrival to the end of its answer, "
                                 "for requests dispatched to a backend", WAIT_BUCKETS),
}  # fmt: skip

# engine dispatch's gauges per backend (sfq_engine_<name>): its last usable reading
ENGINE_GAUGES = {
    "running": "Requests the engine ran at its last usable reading",
    "waiting": "Requests waiting in the engine's own queue at its last usable reading",
    "kv_usage": "The engine's KV cache in use at its last usable reading (1 is full)",
    "reading_age_seconds": "Time since the last usable reading was requested (past the "
    "pool's dispatch.max_age_s: static slots)",
    "capacity": "Requests the gate takes the engine to run at once (configured, reported or "
    "learned)",
}

Key = tuple[str, str, str]  # (org, class, pool) as labelled


@dataclass(slots=True)
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def add(self, other: _Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total

    def cumulative(self) -> list[tuple[str, int]]:
        edges = [*map(str, self.buckets), "+Inf"]
        running, out = 0, []
        for edge, count in zip(edges, self.counts, strict=True):
            running += count
            out.append((edge, running))
        return out


@dataclass(slots=True)
class _Series:
    """Everything counted for one labelled flow."""

    counters: Counter[tuple[str, str]] = field(default_factory=Counter)  # (name, label value)
    histograms: dict[str, _Histogram] = field(default_factory=dict)

    def add(self, other: _Series) -> None:
        self.counters.update(other.counters)
        for name, hist in other.histograms.items():
            self.histogram(name).add(hist)

    def histogram(self, name: str) -> _Histogram:
        hist = self.histograms.get(name)
        if hist is None:
            hist = self.histograms[name] = _Histogram(HISTOGRAMS[name][1])
        return hist


class Metrics(Collector):
    """The proxy's metrics: call the event methods, scrape ``registry``."""

    def __init__(
        self,
        pools: Mapping[str, Pool],
        max_labelled_orgs: int = 200,
        calibration: Calibration | None = None,
    ) -> None:
        self._pools = pools
        self._calibration = calibration
        self._max_orgs = max_labelled_orgs
        self._orgs: OrderedDict[str, None] = OrderedDict()  # labelled orgs, least recent first
        self._series: dict[Key, _Series] = {}
        self._first_byte: dict[tuple[str, str], _Histogram] = {}
        self._placements: Counter[tuple[str, str, str]] = Counter()  # (pool, backend, reason)
        # every budget as of now (state/usage_store.py), read at scrape time
        self.budget_levels: Callable[[], list[Level]] = list
        self.registry = CollectorRegistry()
        # under `serve --workers N`, every worker's counts (worker_metrics.py)
        self.group = worker_metrics.group_view(self, process_metrics.worker_index())
        self.registry.register(self.group)
        process_metrics.register(self.registry)

    # -- events --------------------------------------------------------------------------

    def seen(self, flow: Key) -> None:
        """A request of ``flow`` was admitted: its org is among the most recently active."""
        self._activate(flow)

    def count(self, flow: Key, name: str, label: str = "", amount: float = 1.0) -> None:
        """Add ``amount`` to counter ``name`` (with its extra label value) for ``flow``."""
        # typeshed's Counter is int-valued; this one also sums float amounts (the costs)
        self._at(flow).counters[(name, label)] += amount  # type: ignore[assignment]

    def observe(self, flow: Key, name: str, seconds: float) -> None:
        self._at(flow).histogram(name).observe(seconds)

    def first_byte(self, pool: str, backend: str, seconds: float) -> None:
        hist = self._first_byte.get((pool, backend))
        if hist is None:
            hist = self._first_byte[(pool, backend)] = _Histogram(LATENCY_BUCKETS)
        hist.observe(seconds)

    def placed(self, pool: str, backend: str, reason: str) -> None:
        """A dispatch went to ``backend``: to its key's first choice (``affinity``), further
        down its key's order (``overflow``), or to the least loaded (``fallback``)."""
        self._placements[(pool, backend, reason)] += 1

    def costs(self, pool: str) -> dict[str, dict[str, float]]:
        """Each flow of ``pool``: the estimates charged at its dispatches (``charged``) and
        what they were trued up to so far (``actual``: the running requests' still at their
        estimates), as counted since start by this process (a folded org's as ``other``)."""
        out: dict[str, dict[str, float]] = {}
        for (org, cls, of_pool), series in sorted(self._series.items()):
            if of_pool != pool:
                continue
            counters = series.counters
            charged = counters[("cost_charged", "")]
            if charged:
                up, down = counters[("cost_trued_up", "up")], counters[("cost_trued_up", "down")]
                out[f"{org}/{cls}"] = {"charged": charged, "actual": charged + up - down}
        return out

    def totals(self, name: str) -> dict[Key, float]:
        """Counter ``name`` summed per labelled flow (over its extra label)."""
        out: dict[Key, float] = {}
        for key, series in self._series.items():
            for (counter, _), value in series.counters.items():
                if counter == name:
                    out[key] = out.get(key, 0.0) + value
        return out

    # -- org folding ------------------------------------------------------------------------

    def org_label(self, org: str) -> str:
        """``org`` itself while it is among the labelled ones, else ``other`` (no change)."""
        return org if org in self._orgs or org == "" else OTHER

    def _at(self, flow: Key) -> _Series:
        """``flow``'s series. One that is there is its org's, labelled (folding an org takes
        its series): only admission (``seen``) and a new series make an org recent."""
        series = self._series.get(flow)
        return self._activate(flow) if series is None else series

    def _activate(self, flow: Key) -> _Series:
        org = flow[0]
        if org and org not in self._orgs:
            if len(self._orgs) >= self._max_orgs:
                self._fold(next(iter(self._orgs)))
            self._orgs[org] = None
        elif org:
            self._orgs.move_to_end(org)
        series = self._series.get(flow)
        if series is None:
            series = self._series[flow] = _Series()
        return series

    def _fold(self, org: str) -> None:
        """Move the least recently active org's series into ``other``."""
        del self._orgs[org]
        for key in [k for k in self._series if k[0] == org]:
            other = (OTHER, key[1], key[2])
            self._series.setdefault(other, _Series()).add(self._series.pop(key))

    # -- scrape -----------------------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        yield from self._flow_counters()
        yield from self._flow_histograms()
        yield from self._flow_gauges()
        yield from self._backend_metrics()
        yield from self._engine_metrics()
        yield from self._provider_metrics()
        yield from self._calibration_metrics()
        yield from self._budget_metrics()

    def _flow_counters(self) -> Iterable[Metric]:
        for name, (doc, extra) in COUNTERS.items():
            labels = FLOW_LABELS + ([extra] if extra else [])
            family = CounterMetricFamily(f"sfq_{name}", doc, labels=labels)
            for key, series in self._series.items():
                for (counter, label), value in series.counters.items():
                    if counter == name:
                        family.add_metric([*key, label] if extra else list(key), value)
            yield family

    def _flow_histograms(self) -> Iterable[Metric]:
        for name, (doc, _) in HISTOGRAMS.items():
            family = HistogramMetricFamily(f"sfq_{name}", doc, labels=FLOW_LABELS)
            for key, series in self._series.items():
                hist = series.histograms.get(name)
                if hist is not None:
                    family.add_metric(list(key), hist.cumulative(), hist.total)
            yield family

    def _flow_gauges(self) -> Iterable[Metric]:
        queued = GaugeMetricFamily("sfq_queue_length", "Requests waiting", labels=FLOW_LABELS)
        running = GaugeMetricFamily("sfq_in_flight", "Requests dispatched", labels=FLOW_LABELS)
        lag = GaugeMetricFamily(
            "sfq_meter_lag", "Meter minus virtual time (S − v), largest", labels=FLOW_LABELS
        )
        vtime = GaugeMetricFamily("sfq_virtual_time", "SFQ virtual time", labels=["pool"])
        for pool_name, pool in self._pools.items():
            vtime.add_metric([pool_name], pool.virtual_time())
            levels: dict[Key, list[float]] = {}
            for view in pool.flow_views():
                key = self._gauge_key(view.flow, pool_name)
                level = levels.setdefault(key, [0, 0, view.lag])
                level[0] += view.backlog
                level[2] = max(level[2], view.lag)
            for flow, n in pool.flow_running().items():
                levels.setdefault(self._gauge_key(flow, pool_name), [0, 0, 0.0])[1] += n
            for key, (backlog, n_running, meter_lag) in levels.items():
                queued.add_metric(list(key), backlog)
                running.add_metric(list(key), n_running)
                lag.add_metric(list(key), meter_lag)
        yield from (queued, running, lag, vtime)

    def _gauge_key(self, flow: str, pool: str) -> Key:
        org, cls = org_and_class(flow)
        return self.org_label(org), cls, pool

    def _calibration_metrics(self) -> Iterable[Metric]:
        """What calibration learned; org="" is the pool's own value. The input model's two
        parameters share its sample count."""
        labels = ["pool", "org", "quantity"]
        value = GaugeMetricFamily("sfq_calibration", "Learned estimate parameter", labels=labels)
        samples = GaugeMetricFamily(
            "sfq_calibration_samples", "Requests it was learned from", labels=labels
        )
        priors = {
            name: InputModel(pool.cost.spec.tokens_per_message, pool.cost.spec.chars_per_token)
            for name, pool in self._pools.items()
        }
        snapshot = self._calibration.snapshot(priors) if self._calibration else {}
        for pool, learned in snapshot.items():
            fit = learned["input"]
            entries = [
                ("", name, {"value": fit[name], "samples": fit["samples"]})
                for name in ("tokens_per_message", "chars_per_token")
            ]
            entries.append(("", "output_ratio", learned["output_ratio"]))
            entries += [
                (org, "output_ratio", v)
                for org, v in learned["orgs"].items()
                if self.org_label(org) == org
            ]
            for org, quantity, entry in entries:
                if entry["value"] is not None:
                    value.add_metric([pool, org, quantity], entry["value"])
                samples.add_metric([pool, org, quantity], entry["samples"])
        yield from (value, samples)

    def _budget_metrics(self) -> Iterable[Metric]:
        """Each budget's used fraction and its ``warn_at`` (the alert compares the two); orgs
        past the cardinality guard share ``other``, with the largest fraction."""
        labels = ["org", "key", "period", "unit"]
        used = GaugeMetricFamily(
            "sfq_budget_used_ratio", "Budget used this period over its limit", labels=labels
        )
        warn = GaugeMetricFamily(
            "sfq_budget_warn_ratio", "The fraction at which the budget warns", labels=labels
        )
        ratios: dict[tuple[str, ...], tuple[float, float]] = {}
        for level in self.budget_levels():
            b = level.budget
            key = b.name if b.kind == "key" else ""
            labelled = (self.org_label(b.org), key, b.spec.period, b.unit)
            ratios[labelled] = max(ratios.get(labelled, (0.0, 0.0)), (level.ratio, b.spec.warn_at))
        for values, (ratio, warn_at) in sorted(ratios.items()):
            used.add_metric(list(values), ratio)
            warn.add_metric(list(values), warn_at)
        yield from (used, warn)

    def _provider_metrics(self) -> Iterable[Metric]:
        """A provider's feedback (its 429s and rate-limit headers) on each pool's dispatch."""
        throttled = CounterMetricFamily(
            "sfq_upstream_throttled",
            "Times the upstream held the pool's dispatch: 429, remaining_requests, "
            "remaining_tokens",
            labels=["pool", "reason"],
        )
        factor = GaugeMetricFamily(
            "sfq_upstream_rate_factor",
            "Effective dispatch rate over the configured rate (halved per 429, grows back)",
            labels=["pool"],
        )
        paused = GaugeMetricFamily(
            "sfq_upstream_paused_seconds",
            "Seconds until the upstream's 429 or exhausted limit lets the pool dispatch again",
            labels=["pool"],
        )
        for pool_name, pool in self._pools.items():
            now = pool.clock()
            for reason, n in sorted(pool.throttle.throttled.items()):
                throttled.add_metric([pool_name, reason], n)
            factor.add_metric([pool_name], pool.throttle.factor(now))
            paused.add_metric([pool_name], max(0.0, pool.throttle.paused_until - now))
        yield from (throttled, factor, paused)

    def _backend_metrics(self) -> Iterable[Metric]:
        labels = ["pool", "backend"]
        slots = GaugeMetricFamily("sfq_backend_slots", "Concurrency slots", labels=labels)
        busy = GaugeMetricFamily("sfq_backend_in_flight", "Requests in flight", labels=labels)
        healthy = GaugeMetricFamily("sfq_backend_healthy", "1 if it takes requests", labels=labels)
        first_byte = HistogramMetricFamily(
            "sfq_upstream_first_byte_seconds", "Send to response headers", labels=labels
        )
        placements = CounterMetricFamily(
            "sfq_placement",
            "Dispatches per backend, by why placement chose it: affinity (the key's first "
            "choice), overflow (later in the key's order), fallback (no key: least loaded)",
            labels=[*labels, "reason"],
        )
        for (pool_name, backend, reason), n in sorted(self._placements.items()):
            placements.add_metric([pool_name, backend, reason], n)
        for pool_name, pool in self._pools.items():
            for b in pool.placement.backends:
                slots.add_metric([pool_name, b.name], b.slots)
                busy.add_metric([pool_name, b.name], b.in_flight)
                healthy.add_metric([pool_name, b.name], int(b.healthy))
                hist = self._first_byte.get((pool_name, b.name))
                if hist is not None:
                    first_byte.add_metric([pool_name, b.name], hist.cumulative(), hist.total)
        yield from (slots, busy, healthy, first_byte, placements)

    def _engine_metrics(self) -> Iterable[Metric]:
        """Engine dispatch (docs/design.md §5): each gated backend's last usable reading,
        its age, the gate's capacity, and the dispatch attempts its gate refused while a
        static slot was free. A reading's gauges are absent until there is one."""
        labels = ["pool", "backend"]
        gauges = {
            name: GaugeMetricFamily(f"sfq_engine_{name}", doc, labels=labels)
            for name, doc in ENGINE_GAUGES.items()
        }
        gated = CounterMetricFamily(
            "sfq_dispatch_gated",
            "Dispatch attempts (a request, a completion, a reading) in which the engine's "
            "gate refused a backend with a free slot, by reason: engine_queue, kv_cache, "
            "capacity, stale",
            labels=[*labels, "reason"],
        )
        for pool_name, pool in self._pools.items():
            now = pool.clock()
            for b in pool.placement.backends:
                gate = b.gate
                if gate is None:
                    continue
                at = [pool_name, b.name]
                gauges["capacity"].add_metric(at, gate.capacity())
                for reason, n in sorted(b.refused.items()):
                    gated.add_metric([*at, reason], n)
                reading = gate.reading
                if reading is None:
                    continue
                gauges["reading_age_seconds"].add_metric(at, now - gate.requested_at)
                for name in ("running", "waiting", "kv_usage"):
                    value = getattr(reading, name)
                    if value is not None:
                        gauges[name].add_metric(at, value)
        yield from (*gauges.values(), gated)
