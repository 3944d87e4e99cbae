"""deploy/prometheus and deploy/grafana against what a running proxy really exposes.

Every metric a dashboard panel or an alert queries must be a sample the proxy's /metrics
serves after a small workload, and the rules and the dashboard's queries must pass promtool
(Debian's, from `make tools`: skipped without it, failed under CI), so a renamed metric
cannot leave a blank panel or a silent alert. The
process metrics beside the proxy's (process_*, python_*, sfq_build_info) are checked on a
real proxy, and on `serve --workers 2`.
"""

from __future__ import annotations

import asyncio
import json
import platform
import re
import signal
import subprocess
from collections import defaultdict
from importlib import metadata
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from proxy_lab import KEYS, MODEL, Lab, config_yaml, eventually, proxy_config, serve_process
from tools import need_tool

from sfq_proxy.config import default_classes
from sfq_proxy.core.flows import CLASS_HEADER
from sfq_proxy.observability.metrics import WAIT_BUCKETS

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "sfq-proxy.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}  # the dashboard's variable

METRIC = re.compile(r"\bsfq_[a-zA-Z0-9_]+")
# prometheus-client's standard metrics, which the proxy serves beside its own
PROCESS_METRIC = re.compile(r"\b(?:process|python)_[a-zA-Z0-9_]+")
# an alert on the proxy's scrape target itself, from Prometheus's own `up`
UP = 'up{job="sfq-proxy"}'
# a metric with its label matchers: sfq_x{a="1", b=~"2"}
SELECTOR = re.compile(r"\b(sfq_[a-zA-Z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')

REQUIRED_PANELS = [
    "Served cost share per org",
    "Request rate per org",
    "End-to-end latency p50, p95 and p99",
    "End-to-end latency p99 per org",
    "Tokens per request per org",
    "Proxy CPU per process",
    "Proxy memory per process",
    "Queue wait p50 and p99 per class",
    "Queue length per flow",
    "Backend in flight vs slots",
    "Rejections by reason",
    "Meter lag per flow (S − v)",
    "Backend health",
    "Tokens used per org",
    "Time to first token p99 per class",
    "Failures by reason and pool",
    "Provider throttling by reason",
    "Provider rate factor per pool",
    "Provider pause per pool",
]
REQUIRED_ALERTS = [
    "SfqProxyDown",
    "SfqProxyNotScraped",
    "SfqFlowStarving",
    "SfqBackendDown",
    "SfqRejectionsSpiking",
    "SfqPoolThrottledByProvider",
    "SfqBudgetNearlySpent",
]

Scrape = dict[str, list[dict[str, str]]]  # sample name → label sets of its samples


# -- the files ------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict[str, Any]]:
    """Every panel but rows, those nested in collapsed rows included."""
    out = []
    for panel in dashboard()["panels"]:
        out.extend(panel.get("panels", []))
        if panel["type"] != "row":
            out.append(panel)
    return out


def dashboard_exprs() -> list[str]:
    """The PromQL of every panel target and of every query variable."""
    exprs = [target["expr"] for panel in panels() for target in panel.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":  # the datasource variable: a plugin id, no PromQL
            continue
        query = variable.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in load_yaml(PROMETHEUS / "alerts.yml")["groups"] for rule in group["rules"]
    ]


def all_exprs() -> list[str]:
    return dashboard_exprs() + [rule["expr"] for rule in alert_rules()]


# -- a proxy that has seen some traffic -----------------------------------------------------


async def _run_workload(lab: Lab) -> str:
    """Completed, streamed, rejected, failed, retried and provider-throttled requests, then
    /metrics while one request runs (a flow's gauges exist only while it queues or runs)."""
    sim = await lab.backend(time_scale=5.0)  # slow enough to hold one request open
    retry = {"max_attempts": 3, "budget_ratio": 0.5, "backoff_base_s": 0.01, "backoff_max_s": 0.02}
    budget = {"C": {"budgets": [{"period": "day", "tokens": 10**9}]}}  # sfq_budget_*
    served = await lab.proxy(proxy_config([sim.url], retry=retry, orgs=budget))
    registry = served.state.metrics.registry
    backend = served.state.pools["sim"].placement.backends[0]
    a, b, c = (lab.client(served, org) for org in "ABC")
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    # completed: plain and streamed with usage, batch and interactive
    await a.chat.completions.create(**ask, max_tokens=4)
    await b.chat.completions.create(**ask, max_tokens=4)
    for client, headers in ((c, {}), (a, {CLASS_HEADER: "interactive"})):
        stream = await client.chat.completions.create(
            **ask,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=headers,
        )
        assert [chunk async for chunk in stream]

    # rejected: a bad key (auth) and an unknown model (invalid)
    http = await lab.http()
    bad_key = {"Authorization": "Bearer sk-not-a-key"}
    async with http.post(f"{served.url}/v1/chat/completions", json=ask, headers=bad_key) as resp:
        assert resp.status == 401
    with pytest.raises(openai.NotFoundError):
        await a.chat.completions.create(**{**ask, "model": "no-such-model"})

    # the backend answers 503: upstream errors, retries, then retries the budget refuses
    sim.faults.fail_rate = 1.0
    b_batch = {"org": "B", "class": "batch", "pool": "sim"}

    def counted(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {**b_batch, **labels}) or 0.0

    for _ in range(10):
        await eventually(lambda: backend.healthy)  # a 5xx takes it out for a cooldown
        with pytest.raises(openai.InternalServerError):
            await b.chat.completions.create(**ask, max_tokens=4)
        if counted("sfq_retries_total", reason="503") and counted(
            "sfq_retry_budget_refusals_total"
        ):
            break
    sim.faults.fail_rate = 0.0
    await eventually(lambda: backend.healthy)

    # failed: a stream the backend breaks off after its 200 (sfq_failures_total, upstream_cut)
    sim.faults.die_after_tokens = 2
    cut = {**ask, "max_tokens": 10, "stream": True}
    key = {"Authorization": f"Bearer {KEYS['A']}"}
    async with http.post(f"{served.url}/v1/chat/completions", json=cut, headers=key) as resp:
        assert resp.status == 200
        assert b'"upstream_cut"' in await resp.read()
    sim.faults.die_after_tokens = None
    await eventually(lambda: backend.healthy)

    # the provider answers 429: the pool is throttled (sfq_upstream_throttled_total, 429)
    sim.faults.fail_status, sim.faults.fail_rate = 429, 1.0
    with pytest.raises(openai.RateLimitError):
        await b.chat.completions.create(**ask, max_tokens=4)  # B's retry budget is spent
    sim.faults.fail_status, sim.faults.fail_rate = 503, 0.0
    await eventually(lambda: backend.healthy)

    stream = await a.chat.completions.create(**ask, max_tokens=4000, stream=True)
    try:
        async for _ in stream:
            break  # running now
        async with http.get(f"{served.url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()
    finally:
        await stream.close()


@pytest.fixture
async def scrape(lab: Lab) -> Scrape:
    """Sample name → the label sets it was exposed with, after the workload."""
    samples: Scrape = defaultdict(list)
    for family in text_string_to_metric_families(await _run_workload(lab)):
        for sample in family.samples:
            samples[sample.name].append(sample.labels)
    return dict(samples)


async def test_workers_each_serve_the_process_metrics_of_every_process(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    """`serve --workers 2`: a scrape reaches whichever worker the kernel picks, and each
    serves process_* for the parent (worker="main") and both workers, from /proc; no
    python_gc_* (one interpreter's own counters would jump from worker to worker)."""
    sim = await lab.backend()
    config = config_yaml([sim.url], state={"redis": redis_url})
    proc, url = await serve_process(config, tmp_path, workers=2)
    try:
        for _ in range(6):  # a connection each: the kernel spreads them over the workers
            families = await scrape_once(lab, url)
            for name in (
                "process_cpu_seconds",
                "process_resident_memory_bytes",
                "process_open_fds",
            ):
                workers = sorted(sample.labels["worker"] for sample in families[name].samples)
                assert workers == ["0", "1", "main"], (name, workers)
            assert not [name for name in families if name.startswith("python_gc")]
            assert [s.labels for s in families["sfq_build_info"].samples] == [
                {"version": metadata.version("sfq-proxy"), "python": platform.python_version()}
            ]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_workers_each_serve_every_workers_counts_and_none_goes_back(
    lab: Lab, redis_url: str, tmp_path: Path
) -> None:
    """`serve --workers 2`: the sfq_* counters and histograms of both workers in every
    scrape, labelled worker, whichever worker answers: summed, they count every request,
    and no series goes back from one scrape to the next. (Each worker's own counts alone
    alternate between scrapes, which Prometheus reads as resets.)"""
    sim = await lab.backend()
    config = config_yaml([sim.url], state={"redis": redis_url})
    proc, url = await serve_process(config, tmp_path, workers=2)
    try:
        for _ in range(20):  # a connection each: the kernel spreads them over the workers
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"]) as client:
                hello = [{"role": "user", "content": "Hello"}]
                await client.chat.completions.create(model=MODEL, messages=hello, max_tokens=4)
        answered: set[str] = set()

        async def all_counted() -> bool:  # each worker writes its file at least every second
            families = await scrape_once(lab, url)
            return _completed(families)[0] == 20

        await eventually(all_counted, within=10)
        seen: dict[tuple[str, ...], float] = {}
        for _ in range(10):
            families = await scrape_once(lab, url)
            total, by_worker = _completed(families)
            assert total == 20, by_worker
            answered |= set(by_worker)
            for family in families.values():
                if family.type not in ("counter", "histogram"):
                    continue
                for sample in family.samples:
                    assert "worker" in sample.labels, sample
                    key = (sample.name, *sorted(sample.labels.items()))
                    assert sample.value >= seen.get(key, 0.0), sample  # never back
                    seen[key] = sample.value
        assert answered <= {"0", "1"}, answered
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


def _completed(families: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Completed requests in all, and per worker."""
    by_worker: dict[str, float] = defaultdict(float)
    for sample in families["sfq_requests"].samples:
        if sample.labels["outcome"] == "completed" and sample.name.endswith("_total"):
            by_worker[sample.labels.get("worker", "none")] += sample.value
    return sum(by_worker.values()), dict(by_worker)


async def test_requests_in_flight_set_off_no_garbage_collection(lab: Lab, tmp_path: Path) -> None:
    """`serve` sets the collector's first threshold above what requests in flight hold
    (server.GC_THRESHOLDS): 320 requests, 32 at a time, set off no collection, where
    CPython's 700 sets off one every 13–24 requests (python_gc_collections_total)."""
    sim = await lab.backend()
    proc, url = await serve_process(config_yaml([sim.url], slots=32), tmp_path)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEYS["A"], max_retries=0)
    try:
        before = _collections(await scrape_once(lab, url))
        for _ in range(10):
            await asyncio.gather(*(
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                for _ in range(32)
            ))  # fmt: skip
        after = _collections(await scrape_once(lab, url))
    finally:
        await client.close()
        proc.terminate()
        await proc.wait()
    assert after == before, (before, after)


def _collections(families: dict[str, Any]) -> dict[str, float]:
    """python_gc_collections_total by generation."""
    family = families["python_gc_collections"]
    return {s.labels["generation"]: s.value for s in family.samples if s.name.endswith("_total")}


async def scrape_once(lab: Lab, url: str) -> dict[str, Any]:
    """One scrape on a connection of its own (any worker may answer), by family name."""
    http = await lab.http()
    async with http.get(f"{url}/metrics", headers={"Connection": "close"}) as resp:
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


# -- what the files query exists ------------------------------------------------------------


async def test_dashboard_and_alerts_query_only_exposed_samples(scrape: Scrape) -> None:
    referenced = {
        name for expr in all_exprs() for name in METRIC.findall(expr) + PROCESS_METRIC.findall(expr)
    }
    missing = sorted(referenced - scrape.keys())
    assert not missing, f"queried but not exposed: {missing}; exposed: {sorted(scrape)}"
    assert len(referenced) >= 8, referenced
    # the dashboard covers the flow, backend and histogram families
    for name in (
        "sfq_cost_charged_total",
        "sfq_queue_wait_seconds_bucket",
        "sfq_backend_healthy",
        "sfq_request_duration_seconds_bucket",
        "sfq_build_info",
        "process_cpu_seconds_total",
    ):
        assert name in referenced


async def test_the_process_metrics_and_the_build_info_are_served(scrape: Scrape) -> None:
    """prometheus-client's process, platform and GC collectors (left out by a registry of
    the proxy's own until they were added to it) and sfq_build_info."""
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ):
        assert scrape.get(name) == [{}], (name, scrape.get(name))  # one process: no label
    generations = {labels["generation"] for labels in scrape["python_gc_collections_total"]}
    assert generations == {"0", "1", "2"}
    [info] = scrape["python_info"]
    assert info["version"] == platform.python_version()
    assert scrape["sfq_build_info"] == [
        {"version": metadata.version("sfq-proxy"), "python": platform.python_version()}
    ]
    # end to end, per flow: the workload's dispatched requests
    durations = scrape["sfq_request_duration_seconds_count"]
    assert {"org": "A", "class": "batch", "pool": "sim"} in durations
    assert all(labels.keys() == {"org", "class", "pool"} for labels in durations)


async def test_label_matchers_name_exposed_labels_and_values(scrape: Scrape) -> None:
    """A matcher on a label the metric lacks, or an `le` no bucket has, matches nothing."""
    for expr in all_exprs():
        for name, matchers in SELECTOR.findall(expr):
            assert name in scrape, f"{name} is not exposed: {expr}"
            label_sets = scrape[name]
            exposed = {label for labels in label_sets for label in labels}
            for label, op, value in MATCHER.findall(matchers):
                assert label in exposed, f"{name} has no label {label!r}: {expr}"
                if label == "le":  # a fixed bucket bound, as exposed or as Prometheus 3 stores it
                    pattern = (
                        value.replace("\\\\", "\\") if op in ("=~", "!~") else re.escape(value)
                    )
                    bounds = {labels["le"] for labels in label_sets}
                    assert any(re.fullmatch(pattern, bound) for bound in bounds), (expr, bounds)


# -- Prometheus -----------------------------------------------------------------------------


def test_prometheus_config_scrapes_the_proxy_and_loads_the_alerts() -> None:
    config = load_yaml(PROMETHEUS / "prometheus.yml")
    assert config["global"] == {"scrape_interval": "15s", "evaluation_interval": "15s"}
    assert config["rule_files"] == ["alerts.yml"]
    [job] = [job for job in config["scrape_configs"] if job["job_name"] == "sfq-proxy"]
    assert job["static_configs"][0]["targets"] == ["sfq-proxy:8080"]


def test_alert_rules_are_complete() -> None:
    groups = load_yaml(PROMETHEUS / "alerts.yml")["groups"]
    assert [group["name"] for group in groups] == ["sfq-proxy"]
    rules = alert_rules()
    for rule in rules:
        assert {"alert", "expr", "for", "labels", "annotations"} <= rule.keys(), rule
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
        assert METRIC.search(rule["expr"]) or UP in rule["expr"], rule["alert"]
    names = [rule["alert"] for rule in rules]
    assert len(set(names)) == len(names)
    assert set(REQUIRED_ALERTS) <= set(names)


def test_the_proxy_down_alert_watches_the_scrape_job() -> None:
    """`up` of prometheus.yml's job (a ServiceMonitor's job is its Service's name, the same)."""
    rules = {rule["alert"]: rule for rule in alert_rules()}
    [job] = load_yaml(PROMETHEUS / "prometheus.yml")["scrape_configs"]
    assert job["job_name"] == "sfq-proxy"
    down = rules["SfqProxyDown"]
    assert (down["expr"].strip(), down["labels"]["severity"]) == (f"{UP} == 0", "critical")
    assert rules["SfqProxyNotScraped"]["expr"].strip() == f"absent({UP})"
    service = load_yaml(ROOT / "deploy" / "kubernetes" / "service.yaml")
    assert service["metadata"]["name"] == "sfq-proxy"


def test_starving_thresholds_follow_the_default_class_budgets() -> None:
    """The rule hard-codes `classes.*.max_queue_age_s`; it must cover every default class."""
    [rule] = [rule for rule in alert_rules() if rule["alert"] == "SfqFlowStarving"]
    expr = rule["expr"]
    assert 'reason="queue_age"' in expr  # waits past the budget are refused, not observed
    top_bucket = WAIT_BUCKETS[-1]
    for name, spec in default_classes().items():
        assert f'class="{name}"' in expr, name
        assert spec.max_queue_age_s is not None
        if 0.8 * spec.max_queue_age_s < top_bucket:  # a p99 can tell
            assert f"> 0.8 * {spec.max_queue_age_s:g}" in expr, name
        else:  # histogram_quantile() caps at the top bucket: the share of waits beyond it
            assert f'le=~"{top_bucket:g}(\\\\.0)?"' in expr, name


def test_promtool_accepts_config_and_rules_and_the_rule_tests_pass() -> None:
    assert load_yaml(PROMETHEUS / "alerts_test.yml")["rule_files"] == ["alerts.yml"]
    promtool = need_tool("promtool")  # Debian's prometheus: `make tools`
    for args in (
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ):
        result = subprocess.run(
            [promtool, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


# -- Grafana --------------------------------------------------------------------------------


def test_dashboard_is_provisionable() -> None:
    board = dashboard()
    assert board["uid"] == "sfq-proxy"
    assert board["title"] == "sfq-proxy: who gets the GPUs"
    assert board["schemaVersion"] >= 36
    ids = [panel["id"] for panel in board["panels"]] + [
        nested["id"] for panel in board["panels"] for nested in panel.get("panels", [])
    ]
    assert len(ids) == len(set(ids))
    for panel in panels():
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", DATASOURCE) == DATASOURCE, panel["title"]
            assert METRIC.search(target["expr"]), panel["title"]
    titles = [panel["title"] for panel in panels()]
    assert len(titles) == len(set(titles))
    assert set(REQUIRED_PANELS) <= set(titles), set(REQUIRED_PANELS) - set(titles)


def test_dashboard_panels_query_what_their_titles_promise() -> None:
    by_title = {panel["title"]: panel for panel in panels()}
    share = by_title["Served cost share per org"]
    assert share["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "percent"
    assert "sum by (org) (rate(sfq_cost_charged_total" in share["targets"][0]["expr"]
    waits = [t["expr"] for t in by_title["Queue wait p50 and p99 per class"]["targets"]]
    assert [expr.split(",")[0] for expr in waits] == [
        "histogram_quantile(0.5",
        "histogram_quantile(0.99",
    ]
    assert all("sum by (class, le)" in expr for expr in waits)
    backends = " ".join(t["expr"] for t in by_title["Backend in flight vs slots"]["targets"])
    assert "sfq_backend_in_flight" in backends
    assert "sfq_backend_slots" in backends
    # end to end: quantiles of the proxy's own histogram of arrival to the end of the answer
    latency = [t["expr"] for t in by_title["End-to-end latency p50, p95 and p99"]["targets"]]
    assert [expr.split(",")[0] for expr in latency] == [
        f"histogram_quantile({q}" for q in ("0.5", "0.95", "0.99")
    ]
    assert all("rate(sfq_request_duration_seconds_bucket{" in expr for expr in latency)
    rate = by_title["Request rate per org"]["targets"][0]["expr"]
    assert rate.startswith("sum by (org) (rate(sfq_requests_total{")
    tokens = " ".join(t["expr"] for t in by_title["Tokens used per org"]["targets"])
    assert "sfq_prompt_tokens_total" in tokens
    assert "sfq_completion_tokens_total" in tokens
    # the process panels only see sfq-proxy's processes: joined on its build info
    for title in ("Proxy CPU per process", "Proxy memory per process"):
        [target] = by_title[title]["targets"]
        assert "on (instance, job) group_left sfq_build_info" in target["expr"]
        assert "by (instance, worker)" in target["expr"]


def _datasources(node: Any) -> list[Any]:
    """Every ``datasource`` value anywhere in the dashboard."""
    if isinstance(node, dict):
        found = [node["datasource"]] if "datasource" in node else []
        return found + [ds for value in node.values() for ds in _datasources(value)]
    if isinstance(node, list):
        return [ds for value in node for ds in _datasources(value)]
    return []


def test_dashboard_datasource_is_a_variable() -> None:
    """No Prometheus datasource uid is written in: the one chosen in the variable is used,
    so the dashboard imports into any Grafana (the first variable, the others read it)."""
    board = dashboard()
    first = board["templating"]["list"][0]
    assert (first["name"], first["type"], first["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    assert "uid" not in json.dumps(first.get("current", {}))  # no datasource chosen in advance
    sources = _datasources(board)
    assert len(sources) > len(panels())  # panels, targets and query variables
    for source in sources:
        if source.get("type") != "grafana":  # the built-in annotations' own
            assert source == DATASOURCE, source
    assert '"uid": "prometheus"' not in DASHBOARD.read_text()


def test_dashboard_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert list(variables) == ["datasource", "pool", "class", "org"]
    for name in ("pool", "class", "org"):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"] == DATASOURCE
        assert (variable["includeAll"], variable["allValue"], variable["multi"]) == (
            True,
            ".*",
            True,
        )
        query = variable["query"]["query"]
        assert re.fullmatch(rf"label_values\((sfq_\w+)(\{{.*\}})?, {name}\)", query), query
    # each variable's values narrowed by the ones before it
    assert 'pool=~"$pool"' in variables["class"]["query"]["query"]
    assert 'class=~"$class"' in variables["org"]["query"]["query"]
    for expr in dashboard_exprs():
        process_only = set(METRIC.findall(expr)) == {"sfq_build_info"}  # no pool to filter
        if "label_values" not in expr and not process_only:
            assert 'pool=~"$pool"' in expr, expr


async def test_the_org_variable_filters_every_per_org_panel(scrape: Scrape) -> None:
    """Every selector of a metric that carries an org label (every flow metric) matches
    org=~"$org", so the per-org panels (and the others on flow metrics) show the orgs
    chosen; the panels per org group by it."""
    flow_metrics = {
        name for name, label_sets in scrape.items() if any("org" in labels for labels in label_sets)
    }
    per_org = [panel for panel in panels() if "per org" in panel["title"]]
    assert len(per_org) >= 6, [panel["title"] for panel in per_org]
    for panel in per_org:
        for target in panel["targets"]:
            assert "by (org" in target["expr"], (panel["title"], target["expr"])
    filtered = 0
    for expr in dashboard_exprs():
        for name, matchers in SELECTOR.findall(expr):
            if name in flow_metrics and "label_values" not in expr:
                assert 'org=~"$org"' in matchers, expr
                filtered += 1
    assert filtered >= 20


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel's PromQL, its variables filled in, is valid: promtool parses it as a rule."""
    promtool = need_tool("promtool")
    exprs = [expr for expr in dashboard_exprs() if "label_values" not in expr]
    for variable in ("$pool", "$class", "$org"):
        exprs = [expr.replace(variable, ".*") for expr in exprs]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)
    ]}]}  # fmt: skip
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisioning() -> None:
    sources = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    assert sources["apiVersion"] == 1
    [source] = sources["datasources"]
    assert (source["type"], source["uid"], source["url"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
    )
    providers = load_yaml(GRAFANA / "provisioning" / "dashboards" / "sfq-proxy.yml")
    assert providers["apiVersion"] == 1
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
