"""The scenario lab's report (docs/design.md §10): ``write_report`` writes its files, and the
lab and its tests import every part of it from here. The parts, each in a module of its own
so that none is too long to read: ``report_figures`` (the figures of a run, and what each
one means), ``report_tables`` (those figures as text, Markdown, CSV and JSON) and
``report_plots`` (the PNG plots, the one part that needs matplotlib).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from .report_figures import (
    Contention,
    PairCheck,
    Row,
    backlogged_intervals,
    bound_checks,
    charged_series,
    contended_shares,
    flow_names,
    percentile,
    rows,
)
from .report_plots import interactive_team, plot_served_cost, plot_wait_cdf, safe_name
from .report_tables import (
    BOUND_LEGEND,
    LEGEND,
    bound_markdown,
    bound_table,
    csv_text,
    engine_table,
    format_table,
    json_text,
    markdown_table,
    size_buckets_table,
    true_up_table,
)
from .scenario import Served, Team

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
        + f"\n#### SFQ bound check\n\n{bound_markdown(checks)}\n{BOUND_LEGEND}",
        "table.csv": csv_text(rows),
        "table.json": json_text(rows, runs, teams, checks),
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
        plot_served_cost(path, scenario_name, runs, teams)
        written.append(path)
        team = interactive_team(runs, teams)
        if team is not None:
            path = out_dir / f"wait_cdf_{safe_name(team)}.png"
            plot_wait_cdf(path, scenario_name, runs, team)
            written.append(path)
    return written
