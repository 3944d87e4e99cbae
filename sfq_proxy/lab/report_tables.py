"""The report's figures as text: the table of each policy × team (fixed-width and Markdown),
the size-buckets, engines, true-up and SFQ bound tables with the legends that say what their
columns hold, and the rows as CSV and JSON (``table.json`` carries what it takes to check
the bound from the file alone). Kept apart from the figures (``report_figures``), so that
what a number means and how it is printed are read apart; nothing here needs matplotlib.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from .policies import SFQ_ESTIMATE_ONLY
from .report_figures import (
    PairCheck,
    Row,
    backlogged_intervals,
    charged_series,
    contended_shares,
    flow_names,
    percentile,
)
from .scenario import Served, Team
from .simulator import EngineSample

__all__ = [
    "BOUND_LEGEND",
    "ENGINE_LEGEND",
    "LEGEND",
    "SIZE_BUCKETS_LEGEND",
    "TRUE_UP_LEGEND",
    "bound_markdown",
    "bound_table",
    "csv_text",
    "engine_table",
    "format_table",
    "json_text",
    "markdown_table",
    "size_buckets_table",
    "true_up_table",
]

_HEADERS = (
    "policy",
    "team",
    "completed",
    "share@backlog",
    "wait p50",
    "wait p95",
    "wait p99",
    "wait max",
    "done p50",
    "done p99",
    "share@run",
)
LEGEND = """\
share@backlog: the team's share of the cost served while it had requests waiting (its own
  backlogged time, so teams' figures do not add up to 100 %); JSON/CSV field "share".
share@run: the team's share of all cost served in the run (adds up to 100 %); field
  "share_of_total".
cost served: the actual cost (the pool's formula on the tokens the backend reported) where
  known, else the cost charged at dispatch; fields "served" and "charged".
wait: from arrival to dispatch; done: from arrival to completion; percentiles nearest-rank.
"""
_NUMERIC_FROM = 2  # columns from this index on are right-aligned


def _fmt_seconds(x: float) -> str:
    """A duration for people, about four significant digits; ``"-"`` for NaN.

    ``"7.3 ms"``, ``"420 ms"``, ``"12.35 s"``, ``"321.4 s"``, ``"42.5 min"``, ``"26.9 h"``.
    """
    if math.isnan(x):
        return "-"
    if x < 0.1:
        return f"{x * 1e3:.1f} ms"
    if x < 1:
        return f"{x * 1e3:.0f} ms"
    if x < 100:
        return f"{x:.2f} s"
    if x < 1000:
        return f"{x:.1f} s"
    if x < 2 * 3600:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h"


def _fmt_share(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def _cells(row: Row) -> list[str]:
    return [
        row.policy,
        row.team,
        str(row.completed),
        _fmt_share(row.share),
        *(
            _fmt_seconds(x)
            for x in (
                row.wait_p50,
                row.wait_p95,
                row.wait_p99,
                row.wait_max,
                row.done_p50,
                row.done_p99,
            )
        ),
        _fmt_share(row.share_of_total),
    ]


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table, one line per row, a rule under the header and between policies.

    Shares are percentages ("-" when the team was never backlogged); waits and completion
    times are human durations ("-" when the team had nothing served).
    """
    body = [_cells(r) for r in rows]
    widths = [max(len(c) for c in col) for col in zip(_HEADERS, *body, strict=False)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i >= _NUMERIC_FROM else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines = [line(_HEADERS), rule]
    for i, cells in enumerate(body):
        if i > 0 and rows[i].policy != rows[i - 1].policy:
            lines.append("")
        lines.append(line(cells))
    return "\n".join(lines) + "\n"


def markdown_table(rows: Sequence[Row]) -> str:
    """The same table in GitHub Markdown (numbers right-aligned)."""
    align = [":---" if i < _NUMERIC_FROM else "---:" for i in range(len(_HEADERS))]
    lines = [
        "| " + " | ".join(_HEADERS) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows),
    ]
    return "\n".join(lines) + "\n"


def _fmt_cost(x: float) -> str:
    return f"{x:.6g}"


def _grid(head: Sequence[str], body: Sequence[Sequence[str]], left: int) -> str:
    """A fixed-width table: its first ``left`` columns aligned left, the others right, a
    rule under the header."""
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in (head, *body)
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def bound_table(checks: Sequence[PairCheck]) -> str:
    """The SFQ bound check, one line per policy × pair of teams."""
    head = ("policy", "pair", "intervals", "largest gap", "bound", "within")
    body = [
        (c.policy, f"{c.team_a}~{c.team_b}", str(c.intervals), _fmt_cost(c.gap),
         _fmt_cost(c.bound), c.verdict)
        for c in checks
    ]  # fmt: skip
    return _grid(head, body, left=2)


SIZE_BUCKETS_LEGEND = """\
size buckets (docs/design.md §3): sfq-fifo is the same SFQ with every flow a strict FIFO;
sfq lets a flow's smaller requests overtake its larger ones, each at most max_overtaken times.
"""


def size_buckets_table(rows: Sequence[Row]) -> str:
    """Each team's wait p50 and p99 under ``sfq-fifo`` and ``sfq``, and their ratio: what size
    buckets change. Empty unless ``rows`` hold both runs."""
    fifo = {r.team: r for r in rows if r.policy == "sfq-fifo"}
    sized = {r.team: r for r in rows if r.policy == "sfq"}
    if not fifo or not sized:
        return ""
    head = ("team", "wait p50 sfq-fifo", "wait p50 sfq", "wait p99 sfq-fifo", "wait p99 sfq",
            "p99 sfq ÷ sfq-fifo")  # fmt: skip
    body = [
        (name, _fmt_seconds(f.wait_p50), _fmt_seconds(sized[name].wait_p50),
         _fmt_seconds(f.wait_p99), _fmt_seconds(sized[name].wait_p99),
         _fmt_ratio(sized[name].wait_p99, f.wait_p99))
        for name, f in fifo.items()
        if name in sized
    ]  # fmt: skip
    return _grid(head, body, left=1) + SIZE_BUCKETS_LEGEND


ENGINE_LEGEND = """\
engine (sim/engine.py): the requests the proxy sent that its backends' engines did not run
yet wait in the engines' own queues (FCFS or by priority), where no fair queue orders them.
queue mean/max: sequences in those queues, over the run (mean weighted by time); batch
mean: sequences running; kv peak: the most KV cache one backend held (tokens; "-": an
unlimited cache); engine wait: dispatch → into the batch, per team; ttft: arrival → its
first output token (prefill done).
"""


def engine_table(
    runs: Mapping[str, Sequence[Served]],
    logs: Mapping[str, Sequence[EngineSample]],
    teams: Sequence[Team],
) -> str:
    """What the engines did in each run: their queues and batches over time (from ``logs``,
    the simulator's ``engine_log`` of each run), preemptions, and each team's wait in them
    (``Served.admitted_s − start_s``) and time to first token. Empty when there is no log."""
    if not logs:
        return ""
    head = ("policy", "team", "engine wait p50", "engine wait p99", "engine wait max",
            "ttft p50", "ttft p99", "preempted", "queue mean", "queue max", "batch mean",
            "kv peak")  # fmt: skip
    body = []
    for policy, samples in logs.items():
        queue, batch = _time_means(samples, "waiting"), _time_means(samples, "running")
        kv = [x.kv_used for x in samples if x.kv_used is not None]
        pool = [
            _fmt_count(queue[0]), f"{queue[1]:.0f}", _fmt_count(batch[0]),
            str(max(kv)) if kv else "-",
        ]  # fmt: skip
        for i, team in enumerate(teams):
            mine = [s for s in runs.get(policy, ()) if s.request.team == team.name]
            waits = sorted(s.admitted_s - s.start_s for s in mine if s.admitted_s is not None)
            ttft = sorted(
                s.first_token_s - s.request.time_s for s in mine if s.first_token_s is not None
            )
            body.append((
                policy if i == 0 else "", team.name,
                *(_fmt_seconds(percentile(waits, p)) for p in (50, 99, 100)),
                *(_fmt_seconds(percentile(ttft, p)) for p in (50, 99)),
                str(sum(s.preemptions for s in mine)),
                *(pool if i == 0 else ["", "", "", ""]),
            ))  # fmt: skip
    return _grid(head, body, left=2) + ENGINE_LEGEND


def _time_means(samples: Sequence[EngineSample], field: str) -> tuple[float, float]:
    """The time-weighted mean and the max of ``field`` summed over the backends, from the
    first sample to the last."""
    now: dict[str, int] = {}
    total = area = peak = 0.0
    last = samples[0].time_s if samples else 0.0
    for x in samples:
        area += total * (x.time_s - last)
        last = x.time_s
        now[x.backend] = getattr(x, field)
        total = sum(now.values())
        peak = max(peak, total)
    span = last - (samples[0].time_s if samples else 0.0)
    return (area / span if span > 0 else total, peak)


def _fmt_count(x: float) -> str:
    return f"{x:.1f}"


TRUE_UP_LEGEND = f"""\
true-up (docs/design.md §3): each org's share of the cost served (the actual cost, the pool's
formula on the tokens the backend reported) while every org had requests waiting. In
{SFQ_ESTIMATE_ONLY} each request is charged its estimate for good; in sfq its charge is
trued up to its actual cost when it ends, as the proxy does. charged ÷ actual: the org's
estimates over its actual cost, in the sfq run.
"""


def true_up_table(runs: Mapping[str, Sequence[Served]], teams: Sequence[Team]) -> str:
    """Each org's share of the served cost while every org waited, under
    ``sfq-estimate-only`` and ``sfq``: what the true-up changes. Empty unless ``runs`` hold
    both."""
    before, after = runs.get(SFQ_ESTIMATE_ONLY), runs.get("sfq")
    if before is None or after is None:
        return ""
    was, now = contended_shares(before, teams), contended_shares(after, teams)
    org_of = {t.name: t.org for t in teams}
    head = ("org", "charged ÷ actual", f"share {SFQ_ESTIMATE_ONLY}", "share sfq")
    body = [
        (org, _fmt_estimate_ratio(*_charged_and_served(after, org, org_of)),
         _fmt_share(was.shares[org]), _fmt_share(now.shares[org]))
        for org in was.shares
    ]  # fmt: skip
    every = (
        f"every org waiting: {_fmt_seconds(was.seconds)} of the {SFQ_ESTIMATE_ONLY} run, "
        f"{_fmt_seconds(now.seconds)} of the sfq run\n"
    )
    return _grid(head, body, left=1) + every + TRUE_UP_LEGEND


def _fmt_estimate_ratio(charged: float, served: float) -> str:
    return f"{charged / served:.2f}" if served > 0 else "-"


def _charged_and_served(
    served: Sequence[Served], org: str, org_of: Mapping[str, str]
) -> tuple[float, float]:
    """What ``org``'s requests were charged at dispatch, and what they served, in all."""
    mine = [s for s in served if org_of.get(s.request.team) == org]
    return math.fsum(s.cost for s in mine), math.fsum(s.served_cost for s in mine)


def _fmt_ratio(new: float, old: float) -> str:
    if math.isnan(new) or math.isnan(old) or old <= 0:
        return "-"
    return f"{new / old:.3g}"


BOUND_LEGEND = """\
SFQ bound: over every interval in which both teams of a pair had requests waiting, the
largest |W_i/w_i - W_j/w_j| of their charged cost W over weight w, against
c_i,max/w_i + c_j,max/w_j (each team's largest single charge). Checkable from table.json
alone: "charged_series", "backlogged_intervals", "weight", "cost_max" per team. "trued up":
a charge of the pair was trued up to an actual cost other than it when its request ended,
so the meters moved by more than these charges and the bound is theirs (with what the
requests in flight may owe), not these figures'.
"""


def bound_markdown(checks: Sequence[PairCheck]) -> str:
    lines = [
        "| policy | pair | intervals | largest gap | bound | within |",
        "| :--- | :--- | ---: | ---: | ---: | :--- |",
        *(
            f"| {c.policy} | {c.team_a}~{c.team_b} | {c.intervals} | {_fmt_cost(c.gap)} | "
            f"{_fmt_cost(c.bound)} | {c.verdict} |"
            for c in checks
        ),
    ]
    return "\n".join(lines) + "\n"


def _row_dict(row: Row) -> dict[str, Any]:
    """The row's fields in order, NaN → None (JSON null, empty CSV cell)."""
    return {
        k: None if isinstance(v, float) and math.isnan(v) else v for k, v in asdict(row).items()
    }


def _r6(x: float) -> float | int:
    """Six decimals (a microsecond, a millionth of a cost unit), as an int when whole."""
    r = round(float(x), 6)
    return int(r) if r.is_integer() else r


def json_text(
    rows: Sequence[Row],
    runs: Mapping[str, Sequence[Served]],
    teams: Sequence[Team],
    checks: Sequence[PairCheck],
) -> str:
    """A list of row objects (every ``Row`` field, NaN as null) with, per row, what the SFQ
    bound check needs: ``backlogged_intervals``, ``charged_series`` (both to six decimals)
    and ``bound``. One row per line, so the long series stay readable in a diff."""
    records = []
    flow_of = flow_names(teams)
    for row in rows:
        served = runs.get(row.policy, [])
        flow = flow_of.get(row.team, row.team)
        record = _row_dict(row)
        record["backlogged_intervals"] = [
            [_r6(lo), _r6(hi)] for lo, hi in backlogged_intervals(served, row.team)
        ]
        record["charged_series"] = [[_r6(t), _r6(w)] for t, w in charged_series(served, row.team)]
        bound: dict[str, dict[str, float | int]] = {}
        for c in checks:
            if c.policy == row.policy and flow in (c.team_a, c.team_b):
                other = c.team_b if c.team_a == flow else c.team_a
                bound[other] = {
                    "gap": c.gap, "bound": c.bound, "intervals": c.intervals,
                    "trued_up": c.trued_up,
                }  # fmt: skip
        record["bound"] = bound
        records.append(json.dumps(record, separators=(",", ":"), allow_nan=False))
    return "[\n" + ",\n".join(records) + "\n]\n"


def csv_text(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[f.name for f in fields(Row)], lineterminator="\n")
    writer.writeheader()
    writer.writerows(_row_dict(r) for r in rows)  # floats as repr: they read back exactly
    return buf.getvalue()
