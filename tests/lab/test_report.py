"""The scenario lab's report (sfq_proxy/report.py): figures worked by hand, tables, files."""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import astuple, fields
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfq_proxy.lab.report import (
    PairCheck,
    Row,
    backlogged_intervals,
    bound_checks,
    bound_table,
    charged_series,
    contended_shares,
    format_table,
    markdown_table,
    percentile,
    rows,
    true_up_table,
    write_report,
)
from sfq_proxy.lab.scenario import Request, Served, Team

NAN = float("nan")
TEAMS = [Team("A", "org1", "batch", 1.0), Team("B", "org2", "interactive", 1.0)]
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

_ids = iter(range(10**9))


def served(
    team: str,
    arrive: float,
    start: float,
    end: float,
    cost: float,
    actual: float | None = None,
    *,
    trued_up: bool = False,
) -> Served:
    request = Request(next(_ids), arrive, team, "org", "cls", 1, 1, 1)
    return Served(request, start, end, cost, actual, trued_up)


def plain(row: Row) -> tuple[object, ...]:
    """The row as a tuple with NaN → None, so rows compare with ==."""
    return tuple(None if isinstance(v, float) and math.isnan(v) else v for v in astuple(row))


# Two teams on one slot; a request's cost is also its service time.  A floods at t=0 with four
# requests of cost 4; B sends requests of cost 1 at t=1 and t=2.
#
# "rr" alternates between the backlogged teams:
#   t=0 a1 (A, 4)   t=4 b1 (B, 1)   t=5 a2 (A, 4)   t=9 b2 (B, 1)   t=10 a3   t=14 a4
#   A waits on [0, 14] (a1 starts at once; a2..a4 wait from 0): all six dispatches count,
#     share A = 16 / 18.
#   B waits on [1, 4] ∪ [2, 9] = [1, 9]: dispatches at 4 (B 1), 5 (A 4), 9 (B 1) count;
#     a1 at 0 (B had not arrived) and a3, a4 at 10, 14 (B had nothing waiting) do not:
#     share B = 2 / 6.
# "fifo" serves in arrival order:
#   t=0 a1   t=4 a2   t=8 a3   t=12 a4   t=16 b1   t=17 b2
#   A waits on [0, 12]: dispatches at 0, 4, 8, 12, all A's: share A = 1; B's dispatches at 16
#     and 17 come after A's backlog ended and must not count against A.
#   B waits on [1, 17]: dispatches at 4, 8, 12 (A 4 each), 16 and 17 (B 1 each): 2 / 14.
def worked_runs() -> dict[str, list[Served]]:
    return {
        "rr": [
            served("A", 0, 0, 4, 4),
            served("B", 1, 4, 5, 1),
            served("A", 0, 5, 9, 4),
            served("B", 2, 9, 10, 1),
            served("A", 0, 10, 14, 4),
            served("A", 0, 14, 18, 4),
        ],
        "fifo": [
            served("A", 0, 0, 4, 4),
            served("A", 0, 4, 8, 4),
            served("A", 0, 8, 12, 4),
            served("A", 0, 12, 16, 4),
            served("B", 1, 16, 17, 1),
            served("B", 2, 17, 18, 1),
        ],
    }


# -- figures --------------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]  # 1..20
    assert percentile(values, 50) == 10  # ⌈10⌉
    assert percentile(values, 95) == 19  # ⌈19⌉, not 20
    assert percentile(values, 99) == 20  # ⌈19.8⌉
    assert percentile(values, 100) == 20
    assert percentile(values, 1) == 1  # ⌈0.2⌉
    assert percentile(list(range(1, 101)), 7) == 7  # 0.07·100 is 7.000000000000001 in floats
    assert percentile([3.5], 50) == 3.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 0)


def test_worked_example_rows() -> None:
    got = [plain(r)[:10] for r in rows(worked_runs(), TEAMS)]
    # policy, team, completed, share, wait p50/p95/p99/max, done p50/p99
    assert got == [
        ("rr", "A", 4, 16 / 18, 5, 14, 14, 14, 9, 18),  # waits 0 5 10 14, done 4 9 14 18
        ("rr", "B", 2, 2 / 6, 3, 7, 7, 7, 4, 8),  # waits 3 7, done 4 8 → p50 is the 1st
        ("fifo", "A", 4, 1.0, 4, 12, 12, 12, 8, 16),  # waits 0 4 8 12, done 4 8 12 16
        ("fifo", "B", 2, 2 / 14, 15, 15, 15, 15, 16, 16),  # waits 15 15, done 16 16
    ]


def test_worked_example_shares_of_the_run_and_the_bound_check() -> None:
    got = {(r.policy, r.team): r for r in rows(worked_runs(), TEAMS)}
    # share of all charged cost: A 16 of 18, B 2 of 18 in both runs; these add up to 1
    assert got["rr", "A"].share_of_total == 16 / 18
    assert got["fifo", "B"].share_of_total == 2 / 18
    assert (got["rr", "A"].charged, got["rr", "A"].cost_max, got["rr", "B"].cost_max) == (16, 4, 1)
    # rr: A and B both wait over [1, 9]; dispatches in (1, 9]: b1 (−1), a2 (+4), b2 (−1),
    # D = 0, −1, 3, 2: the gap is 3 − (−1) = 4, within 4/1 + 1/1 = 5
    # fifo: both wait over [1, 12]; a2, a3, a4 (+4 each): gap 12 > 5
    checks = {c.policy: c for c in bound_checks(worked_runs()["rr"], TEAMS, "rr")}
    checks |= {c.policy: c for c in bound_checks(worked_runs()["fifo"], TEAMS, "fifo")}
    assert (checks["rr"].gap, checks["rr"].bound, checks["rr"].intervals) == (4, 5, 1)
    assert checks["rr"].within
    assert (checks["fifo"].gap, checks["fifo"].bound) == (12, 5)
    assert not checks["fifo"].within
    assert (got["rr", "B"].gap_max, got["rr", "B"].gap_bound) == (4, 5)
    assert charged_series(worked_runs()["rr"], "B") == [(4, 1), (9, 2)]


def hidden_b(*, trued_up: bool = False) -> list[Served]:
    """The "rr" run of ``worked_runs``, B's requests really costing 3 each (charged 1)."""
    return [
        served("A", 0, 0, 4, 4, 4, trued_up=trued_up),
        served("B", 1, 4, 5, 1, 3, trued_up=trued_up),
        served("A", 0, 5, 9, 4, 4, trued_up=trued_up),
        served("B", 2, 9, 10, 1, 3, trued_up=trued_up),
        served("A", 0, 10, 14, 4, 4, trued_up=trued_up),
        served("A", 0, 14, 18, 4, 4, trued_up=trued_up),
    ]


def test_shares_are_of_the_actual_cost_served_where_it_is_known() -> None:
    got = {r.team: r for r in rows({"rr": hidden_b()}, TEAMS)}
    # served: A 4 × 4 = 16, B 2 × 3 = 6 (charged 2); A waits on [0, 14], all six dispatches
    assert (got["A"].served, got["B"].served, got["B"].charged) == (16, 6, 2)
    assert got["A"].share_of_total == 16 / 22
    assert got["A"].share == 16 / 22
    # B waits on [1, 9]: b1 (3), a2 (4), b2 (3)
    assert got["B"].share == 6 / 10
    # unknown actual costs: the charge stands for them (worked_runs: shares of 18)
    unknown = {r.team: r for r in rows({"rr": worked_runs()["rr"]}, TEAMS)}
    assert (unknown["B"].served, unknown["B"].share_of_total) == (2, 2 / 18)
    # the charges, and the bound check on them, are the dispatch charges still
    assert (got["B"].cost_max, got["B"].gap_max, got["B"].gap_bound) == (1, 4, 5)


def test_contended_shares_are_of_the_actual_cost_while_every_org_waits() -> None:
    # A (org1) waits on [0, 14], B (org2) on [1, 9]: both on [1, 9], whose dispatches are
    # b1 at 4 (3), a2 at 5 (4) and b2 at 9 (3); a1 at 0 and a3, a4 after 9 do not count
    got = contended_shares(hidden_b(), TEAMS)
    assert got.shares == {"org1": 4 / 10, "org2": 6 / 10}
    assert got.seconds == 8
    # teams of one org wait together: its backlog is theirs (C's [2, 3] is inside B's)
    teams = [*TEAMS, Team("C", "org2", "batch", 1.0)]
    run = [*hidden_b(), served("C", 2, 3, 4, 1, 1)]
    assert contended_shares(run, teams).shares == {"org1": 4 / 11, "org2": 7 / 11}
    # never all waiting at once: no time, no shares
    apart = contended_shares([served("A", 0, 1, 2, 1), served("B", 3, 4, 5, 1)], TEAMS)
    assert apart.seconds == 0
    assert all(math.isnan(share) for share in apart.shares.values())


def test_true_up_table_compares_sfq_estimate_only_with_sfq(tmp_path: Path) -> None:
    # the same run twice, for the arithmetic: both show B 60 %, A 40 %
    runs = {"sfq-estimate-only": hidden_b(), "sfq": hidden_b(trued_up=True)}
    text = true_up_table(runs, TEAMS)
    lines = text.splitlines()
    assert lines[0].split() == ["org", "charged", "÷", "actual", "share", "sfq-estimate-only",
                                "share", "sfq"]  # fmt: skip
    assert lines[2].split() == ["org1", "1.00", "40.0%", "40.0%"]
    assert lines[3].split() == ["org2", "0.33", "60.0%", "60.0%"]
    assert "8.00 s of the sfq-estimate-only run, 8.00 s of the sfq run" in text
    assert true_up_table({"sfq": hidden_b()}, TEAMS) == ""
    assert true_up_table({"sfq-estimate-only": hidden_b()}, TEAMS) == ""
    paths = write_report(tmp_path, "t", rows(runs, TEAMS), runs, TEAMS, plots=False)
    assert text in paths[0].read_text()  # table.txt
    assert f"#### True-up\n\n```\n{text}```" in paths[1].read_text()  # table.md


def test_a_gap_over_the_bound_is_a_failure_unless_true_ups_moved_the_meters() -> None:
    # fifo of worked_runs: gap 12 over a bound of 5 (see above)
    fifo = worked_runs()["fifo"]
    [plain_check] = bound_checks(fifo, TEAMS, "fifo")
    assert (plain_check.trued_up, plain_check.verdict) == (False, "NO")
    # the scheduler told of actual costs equal to the charges: nothing moved, still a failure
    told = [served(s.request.team, s.request.time_s, s.start_s, s.end_s, s.cost, s.cost,
                   trued_up=True) for s in fifo]  # fmt: skip
    assert bound_checks(told, TEAMS, "fifo")[0].verdict == "NO"
    # actual costs it was not told of move no meter either
    assert bound_checks(hidden_b(), TEAMS, "rr")[0].trued_up is False
    # B's charges trued up from 1 to 3: the meters moved, the bound is theirs
    moved = bound_checks(hidden_b(trued_up=True), TEAMS, "sfq")[0]
    assert moved.trued_up
    assert moved.verdict == "yes"  # within anyway: a gap of 4 against 5
    over = PairCheck("sfq", "A", "B", gap=12, bound=5, intervals=1, trued_up=True)
    assert over.verdict == "trued up"
    assert bound_table([over]).splitlines()[2].split()[-2:] == ["trued", "up"]


def test_rows_follow_mapping_and_team_order() -> None:
    teams = list(reversed(TEAMS))
    got = [(r.policy, r.team) for r in rows(worked_runs(), teams)]
    assert got == [("rr", "B"), ("rr", "A"), ("fifo", "B"), ("fifo", "A")]


def test_team_with_nothing_served_is_nan_and_a_team_that_never_waits_has_no_share() -> None:
    teams = [*TEAMS, Team("C", "org3", "burst", 1.0)]
    # Two slots.  A's requests start the instant they arrive; B's waits on [1, 2].
    run = [served("A", 0, 0, 2, 2), served("A", 2, 2, 4, 2), served("B", 1, 2, 3, 1)]
    by_team = {r.team: r for r in rows({"p": run}, teams)}
    assert plain(by_team["C"])[:10] == ("p", "C", 0, *([None] * 7))
    assert by_team["C"].share_of_total == 0
    a = by_team["A"]  # started both requests the instant they arrived
    assert a.completed == 2
    assert math.isnan(a.share)
    assert (a.wait_p50, a.wait_max, a.done_p99) == (0, 0, 2)
    # B's events: A's dispatch (2) and its own (1), both at t=2; A's at 0 precedes B's arrival.
    assert by_team["B"].share == 1 / 3


def test_backlogged_intervals_exact() -> None:
    run = [
        served("A", 7, 9, 10, 1),  # [7, 9]
        served("A", 0, 2, 3, 1),  # [0, 2]
        served("A", 1, 3, 4, 1),  # [1, 3] overlaps → [0, 3]
        served("A", 3, 5, 6, 1),  # [3, 5] touches → [0, 5]
        served("A", 6, 6, 7, 1),  # no wait: not backlogged
        served("A", 7.5, 8, 9, 1),  # inside [7, 9]
        served("B", 4, 12, 13, 1),  # another team
    ]
    assert backlogged_intervals(run, "A") == [(0, 5), (7, 9)]
    assert backlogged_intervals(run, "B") == [(4, 12)]
    assert backlogged_intervals(run, "C") == []


def test_the_share_counts_a_dispatch_at_either_end_of_a_backlog() -> None:
    # B waits on [2, 6].  Dispatches at exactly 2 (A) and 6 (B) count; at 1 and 7 they don't.
    run = [
        served("A", 0, 1, 2, 8),
        served("A", 0, 2, 3, 4),
        served("B", 2, 6, 7, 1),
        served("A", 7, 7, 8, 16),
    ]
    (b,) = rows({"p": run}, [TEAMS[1]])
    assert b.share == 1 / 5


# -- properties -----------------------------------------------------------------------------------

team_names = st.sampled_from(["A", "B", "C"])
records = st.lists(
    st.tuples(team_names, st.integers(0, 20), st.integers(0, 10), st.integers(1, 8)),
    max_size=40,
)


def brute_force_share(run: Sequence[Served], team: str) -> float:
    """The definition, literally: O(n²)."""

    def waiting(s: Served, t: float) -> bool:
        return s.request.team == team and s.request.time_s <= t <= s.start_s > s.request.time_s

    events = [e for e in run if any(waiting(s, e.start_s) for s in run)]
    own = sum(e.cost for e in events if e.request.team == team)
    total = sum(e.cost for e in events)
    return own / total if total else NAN


@given(records)
def test_share_matches_the_definition(recs: list[tuple[str, int, int, int]]) -> None:
    run = [served(team, t, t + w, t + w + 1, c) for team, t, w, c in recs]
    teams = [Team(n, "o", "c", 1.0) for n in "ABC"]
    for row in rows({"p": run}, teams):
        expected = brute_force_share(run, row.team)
        if math.isnan(expected):
            assert math.isnan(row.share)
        else:
            assert row.share == pytest.approx(expected)
            assert 0 <= row.share <= 1


@given(
    st.lists(st.tuples(team_names, st.integers(1, 8)), max_size=30),
    st.lists(st.integers(1, 8), min_size=3, max_size=3),
)
def test_shares_sum_to_one_when_every_team_is_always_backlogged(
    middle: list[tuple[str, int]], last_costs: list[int]
) -> None:
    # Everything arrives at 0.  Dispatches at t=1, 2, ..., then one per team at the end: every
    # team has a request waiting from 0 to the end, so it is backlogged at every dispatch.
    end = len(middle) + 1
    run = [served(team, 0, t, t + 1, c) for t, (team, c) in enumerate(middle, start=1)]
    run += [served(n, 0, end, end + 1, c) for n, c in zip("ABC", last_costs, strict=True)]
    teams = [Team(n, "o", "c", 1.0) for n in "ABC"]
    got = rows({"p": run}, teams)
    assert sum(r.share for r in got) == pytest.approx(1.0)
    total = sum(s.cost for s in run)
    for r in got:
        own = sum(s.cost for s in run if s.request.team == r.team)
        assert r.share == pytest.approx(own / total)


def test_rows_on_a_large_run() -> None:
    rng = random.Random(7)
    teams = [Team(n, "o", "c", 1.0) for n in "ABC"]
    run = []
    for _ in range(20_000):
        t = rng.uniform(0, 1000)
        start = t + rng.expovariate(1.0)
        run.append(served(rng.choice("ABC"), t, start, start + 2, rng.uniform(1, 100)))
    got = rows({"sfq": run, "fifo": run[::-1]}, teams)
    assert len(got) == 6
    assert sum(r.completed for r in got) == 40_000
    assert all(0 < r.share < 1 for r in got)
    # The order of the records does not matter.
    assert [plain(r)[1:] for r in got[:3]] == [plain(r)[1:] for r in got[3:]]


# -- tables and files -----------------------------------------------------------------------------


def test_format_table_reads_well() -> None:
    text = format_table(rows(worked_runs(), TEAMS))
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["policy", "team", "completed", "share@backlog"]
    assert lines[0].split()[-1] == "share@run"
    assert set(lines[1]) == {"-", " "}
    for policy in ("rr", "fifo"):
        assert sum(line.startswith(policy) for line in lines) == 2
    for share in ("88.9%", "33.3%", "100.0%", "14.3%"):
        assert share in text
    assert "14.00 s" in text
    widths = {len(line) for line in lines if line and line[0] != "-"}
    assert len(widths) <= 2  # header and rows line up (trailing blanks stripped)


def test_format_table_units_and_missing_values() -> None:
    run = [served("A", 0, 0.0042, 0.5, 1), served("A", 0, 0.25, 75, 1)]
    text = format_table(rows({"p": run}, [TEAMS[0], Team("C", "o", "c", 1.0)]))
    assert "4.2 ms" in text  # wait p50
    assert "250 ms" in text  # wait max
    assert "75.00 s" in text  # done p99
    c_line = next(line for line in text.splitlines() if line.split()[1:2] == ["C"])
    assert c_line.split()[2:] == ["0", *(["-"] * 7), "0.0%"]  # share@run: 0 of the run
    long = [served("A", 0, 321.44, 2550, 1), served("A", 0, 321.44, 96840, 1)]
    text = format_table(rows({"p": long}, [TEAMS[0]]))
    assert "321.4 s" in text
    assert "42.5 min" in text
    assert "26.9 h" in text


def test_markdown_table() -> None:
    md = markdown_table(rows(worked_runs(), TEAMS))
    lines = md.splitlines()
    assert lines[0].startswith("| policy | team | completed | share@backlog |")
    assert lines[1].startswith("| :--- | :--- | ---: |")
    assert len(lines) == 2 + 4
    assert "| rr | B | 2 | 33.3% |" in md
    assert lines[2].endswith("| 88.9% |")  # share@run of rr's A


def test_write_report_tables_round_trip(tmp_path: Path) -> None:
    teams = [*TEAMS, Team("C", "org3", "burst", 1.0)]
    table = rows(worked_runs(), teams)
    paths = write_report(tmp_path / "out", "worked", table, worked_runs(), teams, plots=False)
    names = ["table.txt", "table.md", "table.csv", "table.json"]
    assert paths == [tmp_path / "out" / n for n in names]
    assert "worked" in paths[0].read_text()
    assert format_table(table) in paths[0].read_text()
    assert markdown_table(table) in paths[1].read_text()

    def from_record(record: dict[str, object]) -> Row:
        kinds = {f.name: f.type for f in fields(Row)}
        out: dict[str, object] = {}
        for key, value in record.items():
            if key not in kinds:  # the JSON's bound-check extras
                continue
            if kinds[key] == "float":
                out[key] = NAN if value in (None, "") else float(value)  # type: ignore[arg-type]
            elif kinds[key] == "int":
                out[key] = int(value)  # type: ignore[call-overload]
            else:
                out[key] = value
        return Row(**out)  # type: ignore[arg-type]

    with paths[2].open(newline="") as f:
        from_csv = [from_record(r) for r in csv.DictReader(f)]
    data = json.loads(paths[3].read_text())
    from_json = [from_record(r) for r in data]
    assert [plain(r) for r in from_csv] == [plain(r) for r in table]
    assert [plain(r) for r in from_json] == [plain(r) for r in table]
    c_rr = data[2]
    assert c_rr["team"] == "C"
    assert c_rr["completed"] == 0
    assert c_rr["share"] is None
    assert c_rr["wait_p99"] is None
    assert "NaN" not in paths[3].read_text()
    # what the SFQ bound check needs, per row
    rr_b = data[1]
    assert rr_b["backlogged_intervals"] == [[1, 9]]
    assert rr_b["charged_series"] == [[4, 1], [9, 2]]
    assert rr_b["bound"]["A"] == {"gap": 4, "bound": 5, "intervals": 1, "trued_up": False}
    assert "largest gap" in paths[0].read_text()


def test_write_report_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with caplog.at_level(logging.WARNING, logger="sfq_proxy.lab.report"):
        paths = write_report(tmp_path, "worked", rows(worked_runs(), TEAMS), worked_runs(), TEAMS)
    assert [p.name for p in paths] == ["table.txt", "table.md", "table.csv", "table.json"]
    assert all(p.stat().st_size > 0 for p in paths)
    assert not list(tmp_path.glob("*.png"))
    assert "matplotlib is not installed" in caplog.text


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_plots_are_written_and_reproducible(tmp_path: Path) -> None:
    runs = worked_runs()
    table = rows(runs, TEAMS)
    first = write_report(tmp_path / "one", "worked", table, runs, TEAMS)
    second = write_report(tmp_path / "two", "worked", table, runs, TEAMS)
    pngs = [p for p in first if p.suffix == ".png"]
    assert [p.name for p in pngs] == ["served_cost.png", "wait_cdf_B.png"]  # B: mean cost 1
    for a, b in zip(first, second, strict=True):
        assert a.stat().st_size > 0
        assert a.read_bytes() == b.read_bytes(), a.name
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert b"Software" not in p.read_bytes()
