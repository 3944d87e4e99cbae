"""Prometheus metrics (prefix ``sfq_``) on a registry of the proxy's own.

Event counts are recorded as they happen; levels (queue lengths, in-flight, health,
virtual time) are read from the live state at scrape time, so they can never drift.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .pool import Pool

FLOW_LABELS = ("org", "class", "pool")
# 10 ms to 1 h, about three buckets per decade, so p50/p95/p99 resolve at every scale
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 300, 900, 1800, 3600)


class Metrics:
    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "sfq_requests",
            "Requests by outcome (completed, rejected_<reason>, cancelled_queued, "
            "cancelled_running, upstream_<status>, failed)",
            [*FLOW_LABELS, "outcome"],
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "sfq_queue_wait_seconds",
            "Time from admission to dispatch",
            FLOW_LABELS,
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.cost_charged = Counter(
            "sfq_cost_charged",
            "Estimated cost charged at dispatch",
            FLOW_LABELS,
            registry=self.registry,
        )
        self.retries = Counter(
            "sfq_retries", "Requests sent again, by what failed (unreachable or the status)",
            [*FLOW_LABELS, "reason"], registry=self.registry,
        )  # fmt: skip
        self.retry_refusals = Counter(
            "sfq_retry_budget_refusals", "Retries refused because the flow's budget was spent",
            FLOW_LABELS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_StateCollector(pools))


class _StateCollector(Collector):
    def __init__(self, pools: Mapping[str, Pool]) -> None:
        self._pools = pools

    def collect(self) -> Iterable[Metric]:
        vtime = GaugeMetricFamily("sfq_virtual_time", "SFQ virtual time per pool", labels=["pool"])
        queued = GaugeMetricFamily(
            "sfq_queue_length", "Requests waiting per flow", labels=["flow", "pool"]
        )
        per_backend = {
            name: GaugeMetricFamily(f"sfq_backend_{name}", doc, labels=["pool", "backend"])
            for name, doc in (
                ("slots", "Concurrency slots of the backend"),
                ("in_flight", "Requests the proxy has in flight on the backend"),
                ("healthy", "1 when the backend takes new requests"),
            )
        }
        for pool_name, pool in self._pools.items():
            vtime.add_metric([pool_name], pool.scheduler.queue.virtual_time)
            for view in pool.scheduler.queue.flows():
                queued.add_metric([view.flow, pool_name], view.backlog)
            for b in pool.placement.backends:
                labels = [pool_name, b.name]
                per_backend["slots"].add_metric(labels, b.slots)
                per_backend["in_flight"].add_metric(labels, b.in_flight)
                per_backend["healthy"].add_metric(labels, int(b.healthy))
        yield vtime
        yield queued
        yield from per_backend.values()
