"""The figures of the scenario lab's report: per policy × team wait, completion and share,
the true-up comparison and the SFQ bound check (docs/design.md §10). What each figure means
is defined here, once: ``report_tables`` and ``report_plots`` only render them, and
``report`` writes the files.

Input is what the simulator or the load generator produced: for each policy, the list of
``Served`` records of one run.  Output is a list of ``Row`` (one per policy × team), the
``PairCheck`` of each pair of flows, and each org's ``Contention`` share.

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
* The true-up comparison (``contended_shares``; ``report_tables.true_up_table`` prints
  it): each org's share of the served cost over the dispatches at which *every* org had
  requests waiting (the intersection of the orgs' backlogged intervals, both ends
  included), in the ``sfq-estimate-only`` run (charges never trued up) and in the ``sfq``
  run (each charge trued up to the actual cost at the request's end).  These add up to
  100 %; while every org waits, SFQ divides the pool by weight, so this is what the
  division gave.
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
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import reduce
from itertools import accumulate

from .scenario import Served, Team

__all__ = [
    "Contention",
    "PairCheck",
    "Row",
    "backlogged_intervals",
    "bound_checks",
    "charged_series",
    "contended_shares",
    "flow_names",
    "percentile",
    "rows",
]

NAN = float("nan")


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
