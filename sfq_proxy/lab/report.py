"""The scenario lab's report: per policy × team wait, completion and share (docs/design.md §10).

Input is what the simulator or the load generator produced: for each policy, the list of
``Served`` records of one run.  Output is a list of ``Row`` (one per policy × team), rendered
as a fixed-width text table, a Markdown table, CSV and JSON, plus two optional plots.

Definitions (all times in seconds from the scenario start):

* wait = ``start_s − time_s`` (before dispatch), done = ``end_s − time_s`` (until completion).
* Percentiles are nearest-rank: for p in (0, 100], the ⌈p/100·n⌉-th smallest value.
* A request is *waiting* over the closed interval ``[time_s, start_s]`` if it waited at all
  (``start_s > time_s``).  A team is *backlogged* at t when one of its requests is waiting at t;
  ``backlogged_intervals`` gives the maximal such intervals.  A request dispatched the instant
  it arrived never waited and backlogs nothing (so a team that never waits has no share).
* Two costs per request.  The cost *charged* at dispatch (``Served.cost``): the proxy's
  estimate (docs/design.md §4) as the simulator's ``CostModel`` made it, or as the proxy
  reported it (``X-Cost-Charged``).  The cost *served* (``Served.served_cost``): what the
  request really cost, the pool's formula on the tokens the backend reported
  (``Served.actual``), or the charge where that is unknown.  They differ where the estimate
  missed: a tenant gaming it, an output shorter than asked for.
* ``share`` (headed ``share@backlog``), the share of served cost while backlogged, for team
  T: over the dispatch events (one per ``Served``, at ``start_s``) at which T was
  backlogged, T's served cost ÷ all served cost.  The request that starts at t still
  counts as waiting at t, so T's own dispatch of a queued request is one of those events.
  NaN when T was never backlogged.  Each team's is over its *own* backlogged time, so the
  teams' shares do not add up to 100 %: it says what T got when it asked, not a division.
* ``share_of_total`` (headed ``share@run``): T's served cost ÷ all served cost in the
  run.  These add up to 100 % over the teams of a run.
* The true-up comparison (``contended_shares``, ``true_up_table``): each org's share of the
  served cost over the dispatches at which *every* org had requests waiting (the
  intersection of the orgs' backlogged intervals, both ends included), in the
  ``sfq-estimate-only`` run (charges never trued up) and in the ``sfq`` run (each charge
  trued up to the actual cost at the request's end).  These add up to 100 %; while every
  org waits, SFQ divides the pool by weight, so this is what the division gave.
* The SFQ bound check (``bound_checks``): for two teams i, j and each maximal interval
  ``[lo, hi]`` over which both were backlogged, take the dispatches with
  ``lo < start_s ≤ hi`` (nothing dispatched at ``lo`` itself can follow the arrival that
  began the interval: completions come before arrivals at one instant, and an arrival frees
  no slot) and the running difference ``D = W_i/w_i − W_j/w_j`` of their charged cost over
  weight.  The largest gap ``max D − min D`` (D starting at 0) over every such interval is
  compared with ``c_i,max/w_i + c_j,max/w_j``, ``c_max`` being each team's largest single
  charge in the run (docs/design.md §3).  Teams of one org and class are one flow to SFQ (a
  team's short and long requests): the check takes them together, named ``short+long``.
  SFQ keeps every gap within its bound when the charges are final; the other policies need
  not.  A pair whose charges were trued up (``Served.trued_up``, an actual cost other than
  the charge) is marked ``trued_up``: its meters also moved when its requests ended, so
  the bound holds for the meters (with what the requests in flight may owe), not for these
  dispatch charges, and a gap above it is shown as "trued up", not as a failure.
  ``table.json`` carries what it takes to check this from the report alone: per team
  ``weight``, ``cost_max``, ``backlogged_intervals`` and ``charged_series`` (``[start_s,
  cumulative charged cost]`` after each of its dispatches), and ``bound`` (per other flow:
  the largest gap, the bound and ``trued_up``).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import logging
import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from functools import reduce
from itertools import accumulate
from pathlib import Path
from typing import Any

from .policies import SFQ_ESTIMATE_ONLY
from .scenario import Served, Team
from .simulator import EngineSample

__all__ = [
    "BOUND_LEGEND",
    "LEGEND",
    "Contention",
    "PairCheck",
    "Row",
    "backlogged_intervals",
    "bound_checks",
    "bound_table",
    "charged_series",
    "contended_shares",
    "engine_table",
    "flow_names",
    "format_table",
    "markdown_table",
    "percentile",
    "rows",
    "size_buckets_table",
    "true_up_table",
    "write_report",
]

log = logging.getLogger(__name__)

NAN = float("nan")

# Plots: fixed size and resolution so the PNG bytes depend on the data only.
FIG_DPI = 100
WAIT_FLOOR_S = 1e-3  # zero waits are drawn at (at most) this on the CDF's log axis


@dataclass(frozen=True)
class Row:
    policy: str
    team: str
    completed: int
    share: float  # share of served cost while backlogged, 0..1 (NaN: never backlogged)
    wait_p50: float
    wait_p95: float
    wait_p99: float
    wait_max: float
    done_p50: float
    done_p99: float
    # added (scripts that read the fields above keep working)
    share_of_total: float = NAN  # share of all cost served in the run, 0..1
    charged: float = 0.0  # total cost charged to the team
    cost_max: float = NAN  # its largest single charge
    weight: float = 1.0
    gap_max: float = NAN  # largest pairwise gap |ΔW_i/w_i − ΔW_j/w_j| with any other team
    gap_bound: float = NAN  # the SFQ bound for the pair with the smallest slack
    served: float = 0.0  # total cost served to the team: actual where known, else charged


@dataclass(frozen=True)
class PairCheck:
    """The SFQ bound check of one pair of teams in one run (see the module docstring)."""

    policy: str
    team_a: str
    team_b: str
    gap: float  # the largest observed gap; 0 when never backlogged together
    bound: float  # c_a,max/w_a + c_b,max/w_b
    intervals: int  # how many common backlogged intervals there were
    trued_up: bool = False  # a true-up moved either flow's meter: the bound is the meters'

    @property
    def within(self) -> bool:
        return self.gap <= self.bound * (1 + 1e-9) + 1e-9

    @property
    def verdict(self) -> str:
        """What the tables say: "yes", "NO", or "trued up" for a gap above a bound that
        does not apply to dispatch charges alone."""
        if self.within:
            return "yes"
        return "trued up" if self.trued_up else "NO"


@dataclass(frozen=True)
class Contention:
    """Each org's share of the served cost while every org had requests waiting, and how
    long that was (see the module docstring)."""

    shares: dict[str, float]  # org → 0..1; NaN when nothing was served in that time
    seconds: float


# -- figures ------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of ascending ``sorted_values``; NaN when empty.

    The rank ⌈p/100·n⌉ is computed exactly (p taken as the decimal it prints as), so e.g.
    p=95, n=20 gives the 19th value and never the 20th through float rounding.
    """
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    n = len(sorted_values)
    if n == 0:
        return NAN
    rank = math.ceil(Fraction(repr(float(p))) * n / 100)
    return sorted_values[max(rank, 1) - 1]


def backlogged_intervals(served: Sequence[Served], team: str) -> list[tuple[float, float]]:
    """The maximal closed intervals during which ``team`` had a request waiting, ascending.

    Each request that waited contributes ``[time_s, start_s]``; overlapping or touching
    intervals are merged.  Requests started the instant they arrived contribute nothing.
    """
    return _backlog(served, {team})


def _backlog(served: Sequence[Served], teams: Collection[str]) -> list[tuple[float, float]]:
    """``backlogged_intervals`` of the requests of any of ``teams``."""
    spans = sorted(
        (s.request.time_s, s.start_s)
        for s in served
        if s.request.team in teams and s.start_s > s.request.time_s
    )
    merged: list[tuple[float, float]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _shares(served: Sequence[Served], team_names: Sequence[str]) -> dict[str, float]:
    """Share of served cost while backlogged for each team (see the module docstring).

    Sort the dispatch events by time once and keep prefix sums of all cost and of each team's
    cost; the events inside one backlogged interval are a contiguous run found by bisection,
    and the intervals of one team are disjoint, so their sums add.  O(n log n) overall.
    """
    events = sorted(served, key=lambda s: s.start_s)
    times = [s.start_s for s in events]
    total = [0.0, *accumulate(s.served_cost for s in events)]
    shares: dict[str, float] = {}
    for name in team_names:
        intervals = backlogged_intervals(served, name)
        if not intervals:
            shares[name] = NAN
            continue
        own = [0.0, *accumulate(s.served_cost if s.request.team == name else 0.0 for s in events)]
        own_sum = all_sum = 0.0
        for lo, hi in intervals:
            i, j = bisect.bisect_left(times, lo), bisect.bisect_right(times, hi)
            own_sum += own[j] - own[i]
            all_sum += total[j] - total[i]
        # all_sum > 0 unless every dispatch in the intervals was free of cost.
        shares[name] = own_sum / all_sum if all_sum > 0 else NAN
    return shares


def contended_shares(served: Sequence[Served], teams: Sequence[Team]) -> Contention:
    """Each org's share of the served cost over the dispatches at which every org of
    ``teams`` had requests waiting (both ends of each interval included, as in ``share``).

    Only there does SFQ divide the pool among all of them by weight: before and after, an
    org alone gets what the others leave, so a run's whole share would say more about who
    sent the most than about the division.
    """
    orgs: dict[str, set[str]] = {}
    for t in teams:
        orgs.setdefault(t.org, set()).add(t.name)
    backlogs = [_backlog(served, names) for names in orgs.values()]
    common = reduce(_intersect, backlogs) if backlogs else []
    starts = [lo for lo, _ in common]
    org_of = {t.name: t.org for t in teams}
    cost = dict.fromkeys(orgs, 0.0)
    for s in served:
        k = bisect.bisect_right(starts, s.start_s) - 1  # the last interval opening by then
        if s.request.team in org_of and k >= 0 and s.start_s <= common[k][1]:
            cost[org_of[s.request.team]] += s.served_cost
    total = math.fsum(cost.values())
    shares = {org: c / total if total > 0 else NAN for org, c in cost.items()}
    return Contention(shares, math.fsum(hi - lo for lo, hi in common))


def _intersect(
    a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The intersections of two ascending lists of disjoint closed intervals."""
    out: list[tuple[float, float]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def flow_names(teams: Sequence[Team]) -> dict[str, str]:
    """Each team's flow as the bound check names it: the team's own name, or its flow's
    teams joined by ``+`` when several teams share an org and class (one flow to SFQ)."""
    members: dict[tuple[str, str], list[str]] = {}
    for t in teams:
        members.setdefault((t.org, t.cls), []).append(t.name)
    return {t.name: "+".join(members[t.org, t.cls]) for t in teams}


def bound_checks(served: Sequence[Served], teams: Sequence[Team], policy: str) -> list[PairCheck]:
    """The SFQ bound check of every pair of flows in one run (see the module docstring)."""
    events = sorted(served, key=lambda s: s.start_s)  # stable: dispatch order within ties
    times = [s.start_s for s in events]
    flow_of = flow_names(teams)
    flows = list(dict.fromkeys(flow_of.values()))
    members = {f: {t for t, of in flow_of.items() if of == f} for f in flows}
    weight = {flow_of[t.name]: t.weight for t in teams}
    cmax = dict.fromkeys(flows, 0.0)
    moved = dict.fromkeys(flows, False)  # a true-up changed the flow's meter
    for s in served:
        if (f := flow_of.get(s.request.team)) is not None:
            cmax[f] = max(cmax[f], s.cost)
            moved[f] |= s.trued_up and s.served_cost != s.cost
    backlog = {f: _backlog(served, members[f]) for f in flows}
    out: list[PairCheck] = []
    for k, a in enumerate(flows):
        for b in flows[k + 1 :]:
            gap, count = 0.0, 0
            for lo, hi in _intersect(backlog[a], backlog[b]):
                count += 1
                d = low = high = 0.0
                for s in events[bisect.bisect_right(times, lo) : bisect.bisect_right(times, hi)]:
                    if s.request.team in members[a]:
                        d += s.cost / weight[a]
                    elif s.request.team in members[b]:
                        d -= s.cost / weight[b]
                    else:
                        continue
                    low, high = min(low, d), max(high, d)
                gap = max(gap, high - low)
            bound = cmax[a] / weight[a] + cmax[b] / weight[b]
            out.append(PairCheck(policy, a, b, gap, bound, count, moved[a] or moved[b]))
    return out


def charged_series(served: Sequence[Served], team: str) -> list[tuple[float, float]]:
    """``(start_s, cumulative charged cost)`` after each dispatch of ``team``, in time order."""
    mine = sorted((s.start_s, s.cost) for s in served if s.request.team == team)
    return list(zip((t for t, _ in mine), accumulate(c for _, c in mine), strict=True))


def rows(runs: Mapping[str, Sequence[Served]], teams: Sequence[Team]) -> list[Row]:
    """One ``Row`` per policy × team: policies in ``runs`` order, teams in ``teams`` order."""
    out: list[Row] = []
    names = [t.name for t in teams]
    weights = {t.name: t.weight for t in teams}
    flow_of = flow_names(teams)
    for policy, served in runs.items():
        shares = _shares(served, names)
        total = math.fsum(s.served_cost for s in served)  # exactly rounded: order-independent
        pairs = bound_checks(served, teams, policy)
        by_team: dict[str, list[Served]] = {name: [] for name in names}
        for s in served:
            if s.request.team in by_team:
                by_team[s.request.team].append(s)
        for name in names:
            mine = by_team[name]
            waits = sorted(s.start_s - s.request.time_s for s in mine)
            dones = sorted(s.end_s - s.request.time_s for s in mine)
            charged = math.fsum(s.cost for s in mine)
            served_cost = math.fsum(s.served_cost for s in mine)
            own = [p for p in pairs if flow_of[name] in (p.team_a, p.team_b) and p.intervals]
            tightest = min(own, key=lambda p: (p.bound - p.gap, p.team_a, p.team_b), default=None)
            out.append(
                Row(
                    policy=policy,
                    team=name,
                    completed=len(mine),
                    share=shares[name],
                    wait_p50=percentile(waits, 50),
                    wait_p95=percentile(waits, 95),
                    wait_p99=percentile(waits, 99),
                    wait_max=waits[-1] if waits else NAN,
                    done_p50=percentile(dones, 50),
                    done_p99=percentile(dones, 99),
                    share_of_total=served_cost / total if total > 0 else NAN,
                    charged=charged,
                    cost_max=max((s.cost for s in mine), default=NAN),
                    weight=weights[name],
                    gap_max=max((p.gap for p in own), default=NAN),
                    gap_bound=NAN if tightest is None else tightest.bound,
                    served=served_cost,
                )
            )
    return out


# -- tables -------------------------------------------------------------------------------------

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


def _bound_markdown(checks: Sequence[PairCheck]) -> str:
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


def _json_text(
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


def _csv_text(rows: Sequence[Row]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[f.name for f in fields(Row)], lineterminator="\n")
    writer.writeheader()
    writer.writerows(_row_dict(r) for r in rows)  # floats as repr: they read back exactly
    return buf.getvalue()


# -- plots --------------------------------------------------------------------------------------


def _interactive_team(runs: Mapping[str, Sequence[Served]], teams: Sequence[Team]) -> str | None:
    """The team with the smallest mean served cost over all runs (first in ``teams`` on ties)."""
    cost = {t.name: 0.0 for t in teams}
    count = {t.name: 0 for t in teams}
    for served in runs.values():
        for s in served:
            if s.request.team in cost:
                cost[s.request.team] += s.served_cost
                count[s.request.team] += 1
    means = [(cost[name] / n, i, name) for i, (name, n) in enumerate(count.items()) if n]
    return min(means)[2] if means else None


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def _save(fig: Any, path: Path) -> None:
    # No "Software" text chunk and no creation time: the bytes depend on the data only.
    fig.savefig(path, dpi=FIG_DPI, metadata={"Software": None, "Creation Time": None})


def _plot_served_cost(
    path: Path,
    scenario_name: str,
    runs: Mapping[str, Sequence[Served]],
    teams: Sequence[Team],
) -> None:
    from matplotlib.figure import Figure

    n = max(len(runs), 1)
    fig = Figure(figsize=(9.0, 1.0 + 2.2 * n), dpi=FIG_DPI, layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    for ax, (policy, served) in zip(axes, runs.items(), strict=False):
        for k, team in enumerate(teams):
            mine = sorted((s.start_s, s.served_cost) for s in served if s.request.team == team.name)
            xs = [0.0, *(t for t, _ in mine)]
            ys = [0.0, *accumulate(c for _, c in mine)]
            ax.step(xs, ys, where="post", color=f"C{k % 10}", label=team.name, linewidth=1.2)
        ax.set_title(policy, fontsize="medium")
        ax.set_ylabel("cumulative cost")
        ax.grid(True, alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(loc="upper left", fontsize="small")
    axes[-1].set_xlabel("time (s), by dispatch")
    fig.suptitle(f"{scenario_name}: cumulative served cost per team")
    _save(fig, path)


def _plot_wait_cdf(
    path: Path,
    scenario_name: str,
    runs: Mapping[str, Sequence[Served]],
    team: str,
) -> None:
    from matplotlib.figure import Figure

    waits = {
        policy: sorted(s.start_s - s.request.time_s for s in served if s.request.team == team)
        for policy, served in runs.items()
    }
    all_waits = [w for ws in waits.values() for w in ws]
    floor = min([WAIT_FLOOR_S, *(w for w in all_waits if w > 0)])
    fig = Figure(figsize=(7.0, 4.5), dpi=FIG_DPI, layout="constrained")
    ax = fig.subplots()
    for k, (policy, ws) in enumerate(waits.items()):
        if not ws:
            continue
        n = len(ws)
        xs = [max(ws[0], floor), *(max(w, floor) for w in ws)]  # rise from 0 at the first
        ys = [0.0, *((i + 1) / n for i in range(n))]
        ax.step(xs, ys, where="post", color=f"C{k % 10}", label=f"{policy} (n={n})")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    xlabel = "wait before start (s, log scale)"
    if any(w < floor for w in all_waits):
        xlabel += f"; waits of 0 drawn at {floor:.3g} s"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(f"{scenario_name}: wait-before-start CDF of team {team} (interactive)")
    _save(fig, path)


# -- the report ---------------------------------------------------------------------------------


def write_report(
    out_dir: Path,
    scenario_name: str,
    rows: Sequence[Row],
    runs: Mapping[str, Sequence[Served]],
    teams: Sequence[Team],
    *,
    plots: bool = True,
) -> list[Path]:
    """Write the tables (and the plots, if asked and matplotlib is importable) into ``out_dir``.

    Files: ``table.txt``, ``table.md``, ``table.csv``, ``table.json`` (a list of row objects,
    NaN as null), then ``served_cost.png`` and ``wait_cdf_<team>.png`` for the team with the
    smallest mean served cost.  The text tables carry the size-buckets and true-up tables when
    ``runs`` hold what they compare.  Returns the paths written, in that order.  Without matplotlib
    the plots are skipped with a warning on this module's logger.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    checks = [c for policy, served in runs.items() for c in bound_checks(served, teams, policy)]
    buckets = size_buckets_table(rows)
    true_up = true_up_table(runs, teams)
    texts = {
        "table.txt": f"Scenario: {scenario_name}\n\n{format_table(rows)}\n{LEGEND}"
        + (f"\n{buckets}" if buckets else "")
        + (f"\n{true_up}" if true_up else "")
        + f"\n{bound_table(checks)}\n{BOUND_LEGEND}",
        "table.md": f"### Scenario: {scenario_name}\n\n{markdown_table(rows)}\n"
        + "".join(f"{line}  \n" for line in LEGEND.splitlines())
        + (f"\n#### Size buckets\n\n```\n{buckets}```\n" if buckets else "")
        + (f"\n#### True-up\n\n```\n{true_up}```\n" if true_up else "")
        + f"\n#### SFQ bound check\n\n{_bound_markdown(checks)}\n{BOUND_LEGEND}",
        "table.csv": _csv_text(rows),
        "table.json": _json_text(rows, runs, teams, checks),
    }
    written: list[Path] = []
    for name, text in texts.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8", newline="")
        written.append(path)
    if not plots:
        return written
    try:
        from matplotlib import style
    except ImportError:
        log.warning("matplotlib is not installed: wrote the tables of %s, no plots", scenario_name)
        return written

    # The figures draw on their own Agg canvases (matplotlib.figure.Figure, no pyplot): no
    # global backend switch, no figure registry; the default style keeps user rc files out.
    with style.context("default"):
        path = out_dir / "served_cost.png"
        _plot_served_cost(path, scenario_name, runs, teams)
        written.append(path)
        team = _interactive_team(runs, teams)
        if team is not None:
            path = out_dir / f"wait_cdf_{_safe_name(team)}.png"
            _plot_wait_cdf(path, scenario_name, runs, team)
            written.append(path)
    return written
