"""The report's two plots: each team's cumulative served cost, one panel per policy, and the
wait-before-start CDF of the interactive team (the one with the smallest mean served cost).
Kept apart from the tables because they need matplotlib (the ``lab`` extra): it is imported
here only, inside the functions, so the tables are written without it. A PNG's bytes depend
on the data only (fixed size and resolution, no software name or time stamp): a report run
again writes the same files.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from .scenario import Served, Team

__all__ = [
    "FIG_DPI",
    "WAIT_FLOOR_S",
    "interactive_team",
    "plot_served_cost",
    "plot_wait_cdf",
    "safe_name",
]

# Plots: fixed size and resolution so the PNG bytes depend on the data only.
FIG_DPI = 100
WAIT_FLOOR_S = 1e-3  # zero waits are drawn at (at most) this on the CDF's log axis


def interactive_team(runs: Mapping[str, Sequence[Served]], teams: Sequence[Team]) -> str | None:
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


def safe_name(name: str) -> str:
    """A team's name as part of a file name: any other character than ``A-Za-z0-9_.-`` is ``_``."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "_"


def _save(fig: Any, path: Path) -> None:
    # No "Software" text chunk and no creation time: the bytes depend on the data only.
    fig.savefig(path, dpi=FIG_DPI, metadata={"Software": None, "Creation Time": None})


def plot_served_cost(
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


def plot_wait_cdf(
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
